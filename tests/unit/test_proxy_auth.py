"""Preview access decisions: tokens, cookies, public ports (pure) and the store."""

from __future__ import annotations

import pytest

from gateway.errors import BadRequest
from gateway.preview.access import (
    Access,
    AccessStore,
    Allow,
    Credentials,
    Deny,
    Redirect,
    cookie_name,
    cookie_value,
    decide,
    new_token,
    set_cookie_header,
    validate_public_ports,
)
from gateway.store.registry import Registry
from guest.protocol import AGENT_PORT

HOST = "8000-0123456789abcdef.localhost"
ACCESS = Access("pv_secret", frozenset({3000}))


def run(creds=Credentials(), port=8000, redirectable=True, secure=False, host=HOST):
    return decide(ACCESS, port, host, creds, redirectable=redirectable, secure=secure)


def test_private_by_default():
    d = run()
    assert isinstance(d, Deny) and d.code == "preview_token_required"


def test_header_token():
    assert run(Credentials(header="pv_secret")) == Allow()
    assert run(Credentials(header="pv_wrong")).code == "invalid_preview_token"


def test_cookie_is_bound_to_its_host_and_token():
    good = cookie_value("pv_secret", HOST)
    assert run(Credentials(cookies=(good,))) == Allow(ambient=True)
    assert isinstance(run(Credentials(cookies=(good,)),
                          host="9000-0123456789abcdef.localhost"), Deny)
    assert isinstance(run(Credentials(cookies=(cookie_value("pv_old", HOST),))), Deny)
    assert isinstance(run(Credentials(cookies=("pv_secret",))), Deny)  # the raw token is no cookie


def test_a_planted_cookie_of_the_same_name_cannot_shadow_ours():
    good = cookie_value("pv_secret", HOST)
    # A sibling host set junk under our name for the parent domain: ours is still found,
    # whichever order the browser sends them in; junk alone is still refused.
    assert run(Credentials(cookies=("junk", good))) == Allow(ambient=True)
    assert run(Credentials(cookies=(good, "junk"))) == Allow(ambient=True)
    assert run(Credentials(cookies=("junk",))).code == "invalid_preview_token"


def test_only_the_cookie_alone_is_ambient():
    good = cookie_value("pv_secret", HOST)
    assert run(Credentials(header="pv_secret")).ambient is False
    assert run(Credentials(header="pv_secret", cookies=(good,))).ambient is False
    assert run(Credentials(cookies=(good,), query="pv_secret")).ambient is False
    assert run(Credentials(query="pv_secret"), redirectable=False).ambient is False
    assert run(port=3000).ambient is False  # public: nothing of ours to abuse


def test_cookie_names_are_per_host_and_host_prefixed_when_secure():
    other = "8001-0123456789abcdef.localhost"
    assert cookie_name(HOST, False) != cookie_name(other, False)
    assert cookie_name(HOST, False) == cookie_name(HOST.upper(), False)
    assert cookie_name(HOST, False).startswith("agentbox_preview_")
    assert cookie_name(HOST, True) == "__Host-" + cookie_name(HOST, False)


def test_query_token_redirects_browsers_and_sets_the_cookie():
    d = run(Credentials(query="pv_secret"))
    assert isinstance(d, Redirect)
    assert d.set_cookie == (f"{cookie_name(HOST, False)}={cookie_value('pv_secret', HOST)}; "
                            "Path=/; HttpOnly; SameSite=Lax")
    secure = run(Credentials(query="pv_secret"), secure=True).set_cookie
    assert secure.startswith(f"__Host-{cookie_name(HOST, False)}=") and secure.endswith("; Secure")
    assert "Domain" not in secure  # __Host- cookies must not have one


def test_query_token_on_websockets_and_posts_goes_through_with_the_cookie():
    d = run(Credentials(query="pv_secret"), redirectable=False)
    assert isinstance(d, Allow) and d.strip_query_token
    assert d.set_cookie == set_cookie_header("pv_secret", HOST, False)


def test_someone_elses_query_token_is_left_for_the_app():
    good = cookie_value("pv_secret", HOST)
    assert run(Credentials(cookies=(good,), query="jupyter")) == Allow(ambient=True)
    assert run(Credentials(query="jupyter")).code == "invalid_preview_token"


def test_public_ports_need_nothing():
    assert run(port=3000) == Allow()
    assert run(Credentials(query="pv_secret"), port=3000) == Allow(strip_query_token=True)


def test_api_keys_are_not_tokens():
    assert isinstance(run(Credentials(header="ab_adminkey")), Deny)


def test_public_ports_validation():
    assert validate_public_ports([8000, 80, 8000]) == [80, 8000]
    assert validate_public_ports([]) == []
    for bad in (None, 8000, [0], [65536], ["80"], [True], list(range(1, 100))):
        with pytest.raises(BadRequest):
            validate_public_ports(bad)
    with pytest.raises(BadRequest) as err:
        validate_public_ports([8000, AGENT_PORT])  # the agent is never public
    assert err.value.code == "port_reserved"


def test_store_mints_persists_rotates(tmp_path):
    reg = Registry(tmp_path / "r.sqlite")
    store = AccessStore(reg)
    first = store.get("sb1")
    assert first.token.startswith("pv_") and first.public_ports == frozenset()
    assert store.get("sb1") == first
    assert AccessStore(reg).get("sb1") == first  # survives a restart
    store.set_public_ports("sb1", [8000])
    rotated = store.rotate("sb1")
    assert rotated.token != first.token and rotated.public_ports == frozenset({8000})
    assert AccessStore(reg).get("sb1") == rotated
    assert new_token() != new_token()
    reg.close()
