"""Driving the dashboard in headless Chromium (Debian's ``chromium``; Playwright from PyPI
talks to it over CDP, no browser download). Shared by tests/unit/test_dashboard_browser.py
(an in-process app, fake VMs) and tests/e2e/test_dashboard.py (the real daemon).

Screenshots go to ``tests/artifacts/dashboard/`` (gitignored; override with
``AGENTBOX_ARTIFACTS``): a failing run leaves what the page showed.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def artifacts_dir() -> Path:
    root = Path(os.environ.get("AGENTBOX_ARTIFACTS",
                               Path(__file__).parent / "artifacts")) / "dashboard"
    root.mkdir(parents=True, exist_ok=True)
    return root


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("chromium is not installed (Debian package 'chromium')")


@dataclass
class Watch:
    """What the page did that a test asserts on afterwards."""

    errors: list[str] = field(default_factory=list)  # console errors, page errors, CSP reports
    urls: list[str] = field(default_factory=list)  # every request the page made
    failed: list[str] = field(default_factory=list)  # "STATUS METHOD URL" of each 4xx/5xx


@asynccontextmanager
async def browser_page(viewport: dict[str, int] | None = None) -> AsyncIterator[tuple[Any, Watch]]:
    playwright = pytest.importorskip("playwright.async_api")
    path = chromium_path()
    async with playwright.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=path, args=ARGS)
        try:
            context = await browser.new_context(
                viewport=viewport or {"width": 1280, "height": 900}, accept_downloads=True)
            page = await context.new_page()
            page.set_default_timeout(15000)
            watch = Watch()
            page.on("console", lambda m: m.type == "error" and watch.errors.append(m.text))
            page.on("pageerror", lambda e: watch.errors.append(f"pageerror: {e}"))
            page.on("request", lambda r: watch.urls.append(r.url))
            page.on("response", lambda r: r.status >= 400 and watch.failed.append(
                f"{r.status} {r.request.method} {r.url}"))
            try:
                yield page, watch
            except BaseException:  # keep what the page showed, and what it logged
                name = f"failure-{time.strftime('%H%M%S')}"
                await page.screenshot(path=str(artifacts_dir() / f"{name}.png"), full_page=True)
                (artifacts_dir() / f"{name}.txt").write_text(
                    "\n".join(["errors:", *watch.errors, "failed:", *watch.failed]))
                print(f"failure screenshot: {artifacts_dir() / name}.png")
                raise
        finally:
            await browser.close()


async def sign_in(page: Any, base_url: str, secret: str) -> None:
    await page.goto(f"{base_url}/dashboard")
    await page.fill("#key", secret)
    await page.click("#signin button[type=submit]")
    await page.wait_for_selector("#sandboxes")
    await page.wait_for_selector("#live[data-state=live]")


async def shot(page: Any, name: str) -> Path:
    path = artifacts_dir() / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path
