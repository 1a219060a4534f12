"""The dashboard's page weight and first render, in headless Chromium (Debian's chromium,
driven by Playwright over CDP).

Serves the real app in-process with the dashboard's tests' fake sandbox service
(tests/unit/dashboard_env.py: the real middlewares, API routes, event feed and static files;
sandboxes are registry rows, no VMs), registers ``--sandboxes`` of them, then, each round in a
fresh browser context (empty HTTP cache):

* weight: bytes of every /dashboard response the page loads (HTML + JS + CSS, as sent:
  the daemon does not compress; gzip -9 of the same files for comparison)
* sign-in page: navigation start -> the sign-in form in the DOM, and first-contentful-paint
* signed in (the key already in sessionStorage): navigation start -> the sandboxes table
  holding its first page of rows (an init script's MutationObserver notes the time)

usage: .venv/bin/python bench/dashboard.py [--rounds 10] [--sandboxes 25]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiohttp import web

from bench._common import report
from gateway.http import dashboard
from tests.browser import browser_page
from tests.unit import dashboard_env

WATCH_FORM = """
new MutationObserver((_, obs) => {
  if (!document.getElementById('signin')) return;
  window.__rendered = performance.now();
  obs.disconnect();
}).observe(document, {childList: true, subtree: true});
"""
WATCH_ROWS = """
new MutationObserver((_, obs) => {
  const rows = document.querySelectorAll('#sandbox-rows tr[data-id]').length;
  if (rows >= %d) { window.__rendered = performance.now(); obs.disconnect(); }
}).observe(document, {childList: true, subtree: true});
"""


async def signin_round(base: str) -> tuple[float, float, int]:
    async with browser_page() as (page, _):
        sizes: list[int] = []

        async def sized(resp) -> None:  # type: ignore[no-untyped-def]
            if "/dashboard" in resp.url:
                sizes.append(len(await resp.body()))

        page.on("response", lambda r: asyncio.ensure_future(sized(r)))
        await page.add_init_script(WATCH_FORM)
        await page.goto(f"{base}/dashboard")
        await page.wait_for_function("() => window.__rendered !== undefined")
        form = float(await page.evaluate("window.__rendered"))
        fcp = await page.evaluate(
            "performance.getEntriesByName('first-contentful-paint')[0]?.startTime ?? -1")
        await asyncio.sleep(0.2)
        return form, fcp, sum(sizes)


async def signed_in_round(base: str, secret: str, rows: int) -> float:
    async with browser_page() as (page, _):
        await page.add_init_script(f"sessionStorage.setItem('agentbox.key', {secret!r});"
                                   + WATCH_ROWS % rows)
        await page.goto(f"{base}/dashboard#/sandboxes")
        await page.wait_for_function("() => window.__rendered !== undefined")
        return float(await page.evaluate("window.__rendered"))


async def main(rounds: int, sandboxes: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        app, registry, admin = dashboard_env.build(Path(tmp))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        import aiohttp

        async with aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {admin}"}) as s:
            for i in range(sandboxes):
                await (await s.post("/v1/sandboxes", json={"metadata": {"n": str(i)}})).read()
        try:
            files = dashboard.load_assets()
            raw = sum(len(a.body) for a in files.values())
            packed = sum(len(gzip.compress(a.body, 9)) for a in files.values())
            print(f"static files: {len(files)}, {raw} bytes, gzip -9 {packed} bytes")
            form, fcp, weight = [], [], set()
            for _ in range(rounds):
                f, p, w = await signin_round(base)
                form.append(f), fcp.append(p), weight.add(w)
            print(f"bytes the sign-in page loaded (HTML+JS+CSS): {sorted(weight)}")
            report("sign-in page: navigation -> form (ms)", form)
            report("sign-in page: first-contentful-paint (ms)", fcp)
            table = [await signed_in_round(base, admin, min(sandboxes, 25))
                     for _ in range(rounds)]
            report(f"signed in: navigation -> {min(sandboxes, 25)} rows (ms)", table)
        finally:
            await runner.cleanup()
            registry.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--sandboxes", type=int, default=25)
    args = ap.parse_args()
    asyncio.run(main(args.rounds, args.sandboxes))
