"""The dashboard in headless Chromium against the real app in-process (fake VMs:
tests.unit.dashboard_env): sign in, a sandbox made elsewhere appears live, a suspend from
the page and a wake from the API show up without a reload, a script-injection metadata
value is shown as text and never runs, the key never appears in a URL, the CSP holds
(no console errors), and the other pages render. Screenshots: tests/artifacts/dashboard/."""

from __future__ import annotations

import asyncio

import pytest

from gateway.sandbox.states import Event
from tests.browser import browser_page, shot, sign_in
from tests.unit import dashboard_env
from tests.unit.test_dashboard_feed import _record

XSS = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'


@pytest.fixture
async def served(tmp_path, aiohttp_server):
    app, registry, admin = dashboard_env.build(tmp_path)
    server = await aiohttp_server(app)
    yield server, registry, admin
    registry.close()


@pytest.mark.timeout(120)
async def test_dashboard_in_a_browser(served, aiohttp_client):
    server, registry, admin = served
    base = str(server.make_url("")).rstrip("/")
    auth = {"Authorization": f"Bearer {admin}"}
    import aiohttp

    async with aiohttp.ClientSession(base, headers=auth) as api, browser_page() as (page, watch):
        await sign_in(page, base, admin)
        created = await (await api.post("/v1/sandboxes", json={"metadata": {"note": XSS}})).json()
        row = f'tr[data-id="{created["id"]}"]'
        await page.wait_for_selector(f"{row} .state[data-state=running]")  # live, no reload
        assert await page.text_content(f"{row} td.metadata") == f"note={XSS}"
        assert await page.locator(f"{row} img, {row} script").count() == 0
        assert await page.evaluate("window.__pwned") is None
        await shot(page, "unit-sandboxes")

        # an admin sees every key's sandboxes: another key's appears too, live, with its key,
        # and only what the API lets an admin do to it (delete)
        _, alice = registry.create_key("alice")
        async with aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {alice}"}) as a:
            theirs = await (await a.post("/v1/sandboxes", json={"metadata": {"who": "a"}})).json()
        their_row = f'tr[data-id="{theirs["id"]}"]'
        await page.wait_for_selector(f"{their_row} .state[data-state=running]")
        assert await page.text_content(f"{their_row} td.key-cell") == "alice"
        assert await page.locator(f"{their_row} button.act-suspend").count() == 0
        await page.select_option("#tenant", "")  # this key only
        await page.wait_for_selector(their_row, state="detached")
        assert await page.locator(row).count() == 1
        # a warm-pool sandbox given to this key (a claim: its row's tenant changes, then it
        # wakes) appears too, though its first transition in the key's stream is not a create
        pooled = _record("pooled1", "@pool")
        registry.insert_sandbox(pooled)
        registry.transition("pooled1", Event.CREATED)
        registry.transition("pooled1", Event.PAUSE)
        await asyncio.sleep(1.5)  # the page has seen those (an admin sees the pool's too)
        assert await page.locator('tr[data-id="pooled1"]').count() == 0
        registry.update("pooled1", tenant=registry.lookup_key(admin).id)
        registry.transition("pooled1", Event.UNPAUSE, "claimed")
        await page.wait_for_selector('tr[data-id="pooled1"] .state[data-state=running]')

        await page.click(f"{row} button.act-suspend")
        await page.wait_for_selector(f"{row} .state[data-state=suspended]")
        await api.post(f"/v1/sandboxes/{created['id']}/resume")  # a change made elsewhere
        await page.wait_for_selector(f"{row} .state[data-state=running]")

        await page.click(f"{row} a")
        await page.wait_for_selector("#transitions tr")
        causes = await page.locator("#transitions td:nth-child(5)").all_text_contents()
        assert "requested by API" in causes
        assert await page.text_content("#sandbox-state") == "running"
        await api.post(f"/v1/sandboxes/{created['id']}/suspend")
        await page.wait_for_selector("#sandbox-state .state[data-state=suspended]")
        assert XSS in await page.text_content("p.metadata")
        await shot(page, "unit-sandbox")

        await page.click("a[href='#/keys']")
        await page.fill("form.create input[name=name]", "from-the-page")
        await page.click("form.create button[type=submit]")
        await page.wait_for_selector("#new-secret:has-text('ab_')")
        (made,) = [k for k in registry.list_keys() if k.name == "from-the-page"]
        key_row = f'#keys tr[data-id="{made.id}"]'
        await page.fill(f"{key_row} input[name=max_sandboxes]", "3")
        await page.click(f"{key_row} button:has-text('Save limits')")
        await page.wait_for_selector("#toast.info:has-text('limits of from-the-page saved')")
        assert registry.get_key(made.id).limits == {"max_sandboxes": 3}
        page.once("dialog", lambda d: asyncio.ensure_future(d.accept()))
        await page.click(f"{key_row} button.danger")
        await page.wait_for_selector(key_row, state="detached")
        assert registry.get_key(made.id).revoked
        await page.click("a[href='#/usage']")
        await page.wait_for_selector("#usage-charts svg.chart rect.bar", state="attached")
        await page.wait_for_selector("#usage-charts h3:has-text('alice (key_')")  # per key
        await shot(page, "unit-usage")
        await page.click("a[href='#/templates']")
        await page.wait_for_selector("#templates tr[data-name=python]")

        assert await page.evaluate("window.__pwned") is None
        assert not [u for u in watch.urls if admin in u]  # the key never rides in a URL
        assert not watch.errors, (watch.errors, watch.failed)  # no CSP violation, no script error


@pytest.mark.timeout(60)
async def test_a_refused_key_stays_signed_out(served):
    server, _, _ = served
    base = str(server.make_url("")).rstrip("/")
    async with browser_page() as (page, watch):
        await page.goto(f"{base}/dashboard")
        await page.fill("#key", "ab_not-a-key")
        await page.click("#signin button[type=submit]")
        await page.wait_for_selector("#toast.error")
        assert "sign-in failed" in await page.text_content("#toast")
        assert await page.evaluate("sessionStorage.length") == 0
        assert await page.is_visible("#signin")


@pytest.mark.timeout(120)
async def test_a_key_sees_its_own_filters_and_pages(served):
    """A non-admin key: no key pages, only its own sandboxes (another key's stay out, even
    live), paged 25 at a time, filtered by metadata and state."""
    import aiohttp

    server, registry, admin = served
    base = str(server.make_url("")).rstrip("/")
    _, bob = registry.create_key("bob")
    async with aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {bob}"}) as api:
        for n in range(27):
            resp = await api.post("/v1/sandboxes", json={"metadata": {"n": str(n)}})
            assert resp.status == 201, await resp.text()
    async with browser_page() as (page, watch):
        await sign_in(page, base, bob)
        assert not await page.is_visible("#nav-keys") and await page.locator("#tenant").count() == 0
        rows = page.locator("#sandbox-rows tr[data-id]")
        await page.wait_for_function("() => document.querySelectorAll("
                                     "'#sandbox-rows tr[data-id]').length === 25")
        async with aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {admin}"}) as a:
            await (await a.post("/v1/sandboxes", json={"metadata": {"n": "admin's"}})).read()
        await page.click(".pager button:has-text('Next')")
        await page.wait_for_function("() => document.querySelectorAll("
                                     "'#sandbox-rows tr[data-id]').length === 2")
        assert {t.split("=")[1] for t in await page.locator("td.metadata").all_text_contents()} \
            == {"25", "26"}  # oldest first: the admin's never shows here
        await page.click(".pager button:has-text('Previous')")
        await page.wait_for_function("() => document.querySelectorAll("
                                     "'#sandbox-rows tr[data-id]').length === 25")
        await page.fill("#filters input[name=metadata]", "n=3")
        await page.click("#filters button[type=submit]")
        await page.wait_for_function("() => document.querySelectorAll("
                                     "'#sandbox-rows tr[data-id]').length === 1")
        assert await rows.first.locator("td.metadata").text_content() == "n=3"
        await page.select_option("#filters select[name=state]", "suspended")
        await page.click("#filters button[type=submit]")
        await page.wait_for_selector("#sandbox-rows td:has-text('none')")
        assert not watch.errors, (watch.errors, watch.failed)
