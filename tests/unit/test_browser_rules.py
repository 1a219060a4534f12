"""Pure rules for browsers on preview hosts: Origin, redirect Location, repeated cookies."""

from __future__ import annotations

import itertools

import pytest

from gateway.preview.browser_rules import (
    from_guest_page,
    needs_same_origin,
    origin_allowed,
    origin_hostname,
    read_cookies,
    safe_location,
)

HOST = "8000-aaaa.preview.example.com"


def test_which_requests_need_their_own_origin():
    assert needs_same_origin("GET", websocket=True)
    for method in ("POST", "PUT", "PATCH", "DELETE", "post", "PROPFIND"):
        assert needs_same_origin(method, websocket=False)
    for method in ("GET", "HEAD", "OPTIONS", "TRACE"):
        assert not needs_same_origin(method, websocket=False)


def test_origin_hostname():
    assert origin_hostname("http://8000-AAAA.preview.example.com:8080") == HOST
    assert origin_hostname("https://8000-aaaa.preview.example.com.") == HOST
    for opaque in ("null", "NULL", "", "file://", "chrome-extension://abc", "http://", "x"):
        assert origin_hostname(opaque) is None


def test_origin_must_be_the_host_itself():
    assert origin_allowed([f"http://{HOST}:8080"], HOST)
    assert origin_allowed([f"https://{HOST}"], HOST)  # scheme and port are not compared
    assert not origin_allowed(["http://8000-bbbb.preview.example.com:8080"], HOST)  # a sibling
    assert not origin_allowed(["http://preview.example.com"], HOST)  # the parent
    assert not origin_allowed([f"http://x.{HOST}"], HOST)  # a child
    assert not origin_allowed(["null"], HOST)
    assert not origin_allowed([f"http://{HOST}", "http://evil.com"], HOST)
    assert origin_allowed([], HOST)  # programs send none


@pytest.mark.parametrize("path_qs, location", [
    ("/a/b?x=1", "/a/b?x=1"),
    ("/", "/"),
    ("//evil.com/x", "/evil.com/x"),
    ("///evil.com", "/evil.com"),
    ("/\\evil.com", "/%5Cevil.com"),
    ("/\\/evil.com", "/%5C/evil.com"),
    ("/\t/evil.com", "/%09/evil.com"),
    ("/\n/evil.com", "/%0A/evil.com"),
    ("http://evil.com/x", "/http://evil.com/x"),  # absolute-form request target
    ("/a b", "/a%20b"),
])
def test_redirect_location_stays_on_the_host(path_qs, location):
    assert safe_location(path_qs) == location


def test_no_location_can_read_as_another_host():
    # Every string of up to 4 characters over the ones that matter to URL parsers.
    alphabet = "/\\\t\n\r .:?#@e%"
    for n in range(5):
        for chars in itertools.product(alphabet, repeat=n):
            loc = safe_location("".join(chars))
            assert loc.startswith("/") and loc[1:2] not in ("/", "\\"), repr(chars)
            assert not any(c in loc for c in "\\\t\n\r "), repr(chars)


def test_every_value_of_a_repeated_cookie_is_read():
    headers = ["a=1; ours=planted", "ours=\"real\"; b=2"]
    assert read_cookies(headers, "ours") == ("planted", "real")
    assert read_cookies(headers, "none") == ()
    assert len(read_cookies(["; ".join(["ours=x"] * 100)], "ours")) == 16


def test_guest_pages_are_recognised_by_their_origin():
    def guest(host):
        return host.endswith(".preview.example.com")

    assert from_guest_page([f"http://{HOST}"], guest)
    assert not from_guest_page(["http://app.example.com", "null"], guest)
    assert not from_guest_page([], guest)
