"""A real browser (headless Chromium) opens a private preview URL with ?token=, follows the
redirect that sets the host cookie, and the page's script talks to the guest app over a
WebSocket that the cookie authorises (issue 4)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.e2e.test_preview import app_sandbox, host_for, web  # noqa: F401 (fixtures)

pytestmark = pytest.mark.e2e


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("chromium is not installed (Debian package 'chromium'; scripts/setup-host.sh)")


def test_browser_page_websocket_through_preview_url(app_sandbox, daemon, tmp_path):  # noqa: F811
    browser = chromium()
    sid, token = app_sandbox
    port = daemon.url.rsplit(":", 1)[1]
    url = f"http://{host_for(sid, 8000)}:{port}/page?token={token}"
    out = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
         "--host-resolver-rules=MAP *.localhost 127.0.0.1", "--virtual-time-budget=15000",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=120)
    assert "echoed: hello from the browser" in out.stdout, (out.stdout[-2000:],
                                                            out.stderr[-3000:])
