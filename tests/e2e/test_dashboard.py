"""The dashboard against the real daemon and a real sandbox, in headless Chromium (issue 25):
sign in, a sandbox made through the API appears live, a suspend from the page is seen
without a reload, the terminal in the page runs a command (waking the sandbox), a file
uploaded from the page lands in the guest and downloads back, and a script-injection
metadata value is shown as text and never runs. Screenshots: tests/artifacts/dashboard/."""

from __future__ import annotations

import asyncio

import pytest

from tests.browser import browser_page, shot, sign_in
from tests.contract import check_answer

pytestmark = pytest.mark.e2e

XSS = '<img src=x onerror="window.__pwned=1">'
SLOW = 180_000  # ms: a create, suspend or wake under TCG


@pytest.mark.timeout(900)
async def test_dashboard_end_to_end(daemon, api, tmp_path):
    created: list[str] = []
    try:
        async with browser_page() as (page, watch):
            await sign_in(page, daemon.url, daemon.admin_key)
            r = await asyncio.to_thread(api.post, "/v1/sandboxes", json={
                "template": "python", "metadata": {"owner": "e2e", "note": XSS}})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            created.append(sid)
            row = f'tr[data-id="{sid}"]'
            await page.wait_for_selector(f"{row} .state[data-state=running]", timeout=SLOW)
            assert XSS in await page.text_content(f"{row} td.metadata")
            assert await page.locator(f"{row} img").count() == 0
            await shot(page, "e2e-sandboxes")

            await page.click(f"{row} button.act-suspend")
            await page.wait_for_selector(f"{row} .state[data-state=suspended]", timeout=SLOW)
            await shot(page, "e2e-suspended")

            await page.click(f"{row} a")
            await page.wait_for_selector("#transitions tr")
            await page.click("#terminal-open")  # wakes the sandbox
            await page.wait_for_selector("#terminal-status:has-text('open')", timeout=SLOW)
            await page.wait_for_selector("#sandbox-state .state[data-state=running]",
                                         timeout=SLOW)
            await page.focus("#terminal")
            await page.keyboard.type("echo dash$((6*7))board")
            await page.keyboard.press("Enter")
            await page.wait_for_function(
                "() => document.querySelector('#terminal').textContent.includes('dash42board')",
                timeout=60_000)
            await page.keyboard.type("stty size")  # the page sized the terminal to fit
            await page.keyboard.press("Enter")
            await page.wait_for_function(
                "() => /\\n30 \\d+\\n/.test(document.querySelector('#terminal').textContent)",
                timeout=60_000)

            # preview links: a server started in the sandbox is listed, and its link opens it
            r = await asyncio.to_thread(api.post, f"/v1/sandboxes/{sid}/commands", json={
                "command": "cd /tmp && exec python3 -m http.server 8123", "background": True})
            assert r.status_code == 201, r.text
            ports = await asyncio.to_thread(api.get, f"/v1/sandboxes/{sid}/ports")
            check_answer("GET", "/v1/sandboxes/{id}/ports", 200, ports.json(),
                         "application/json")
            for _ in range(50):
                await page.click("#ports-list")
                if await page.locator('#previews li[data-port="8123"]').count():
                    break
                await asyncio.sleep(0.5)
            href = await page.get_attribute('#previews li[data-port="8123"] a', "href")
            assert "8123-" in href and "token=" in href, href
            preview = await page.context.new_page()
            await preview.goto(href)
            assert "Directory listing" in await preview.content()
            await preview.close()

            payload = b"uploaded from the dashboard\n" * 100
            await page.fill("#files-dir", "/tmp")
            await page.set_input_files("#files-upload", files=[{
                "name": "dash-upload.txt", "mimeType": "text/plain", "buffer": payload}])
            await page.wait_for_selector('#files tr[data-name="dash-upload.txt"]',
                                         timeout=60_000)
            got = await asyncio.to_thread(api.get, f"/v1/sandboxes/{sid}/files/tmp/dash-upload.txt")
            assert got.status_code == 200 and got.content == payload
            async with page.expect_download() as info:
                await page.click('#files tr[data-name="dash-upload.txt"] a')
            download = await info.value
            saved = tmp_path / "download.txt"
            await download.save_as(saved)
            assert saved.read_bytes() == payload
            await shot(page, "e2e-sandbox")

            assert await page.evaluate("window.__pwned") is None
            assert not [u for u in watch.urls if daemon.admin_key in u]
            assert daemon.admin_key not in daemon.log_tail(100_000)  # nor in the daemon's log
            assert not watch.errors, (watch.errors, watch.failed)
    finally:
        for sid in created:
            await asyncio.to_thread(api.delete, f"/v1/sandboxes/{sid}")


@pytest.mark.timeout(900)
async def test_dashboard_build_log_streams(daemon):
    """A Dockerfile build started from the templates page: its log streams into the page
    (step, the RUN's output, the error) and the build's end state is shown. A failing RUN
    keeps it to one builder boot."""
    import secrets

    from tests.e2e.test_template_build import context_tar

    nonce = secrets.token_hex(4)
    tar = context_tar({"Dockerfile": f"FROM python\nRUN echo dash-{nonce} && exit 5\n".encode()})
    async with browser_page() as (page, watch):
        await sign_in(page, daemon.url, daemon.admin_key)
        await page.click("a[href='#/templates']")
        await page.wait_for_selector("#templates tr[data-name=python]")
        await page.fill("form.build input[name=name]", f"dash-{nonce}")
        await page.set_input_files("form.build input[type=file]", files=[{
            "name": "context.tar", "mimeType": "application/x-tar", "buffer": tar}])
        await page.click("form.build button[type=submit]")
        await page.wait_for_selector("#build-log:has-text('== step 1')", timeout=60_000)
        await page.wait_for_selector(f"#build-log:has-text('dash-{nonce}')", timeout=SLOW)
        await page.wait_for_selector("#build-state:has-text('failed')", timeout=SLOW)
        log = await page.text_content("#build-log")
        assert "error:" in log and "code 5" in log and log.rstrip().endswith("done")
        await shot(page, "e2e-build")
        assert not watch.errors, (watch.errors, watch.failed)
