"""The routing decision (no I/O): route entry + this host + hop header + fence -> serve here,
forward to the owner, or refuse (loop, fenced, owner not live)."""

from __future__ import annotations

import pytest

from gateway.cluster.records import SandboxRecord
from gateway.cluster.routes import Route
from gateway.cluster.routing import (
    Forward, Refuse, ServeHere, client_of, decide, sandbox_in_path,
)
from gateway.sandbox.states import State


def route(host: str, address: str | None = "10.0.0.9:8080", gen: int = 3) -> Route:
    return Route("sbx1", host, gen, address, SandboxRecord("sbx1", host, State.RUNNING, gen))


def test_ours_or_unknown_is_served_here() -> None:
    assert decide("sbx1", route("host-a"), "host-a", forwarded_by=None, fenced=None) \
        == ServeHere()
    assert decide("sbx1", None, "host-a", forwarded_by=None, fenced=None) == ServeHere()
    # A forwarded request for our own sandbox is served (that is the point of forwarding).
    assert decide("sbx1", route("host-a"), "host-a", forwarded_by="host-b", fenced=None) \
        == ServeHere()


def test_another_live_owner_gets_the_request() -> None:
    assert decide("sbx1", route("host-b"), "host-a", forwarded_by=None, fenced=None) \
        == Forward("host-b", "10.0.0.9:8080", 3)


def test_a_forwarded_request_is_never_forwarded_again() -> None:
    got = decide("sbx1", route("host-c"), "host-a", forwarded_by="host-b", fenced=None)
    assert isinstance(got, Refuse) and got.code == "forward_loop"
    assert "host-b" in got.message and "host-c" in got.message
    got = decide("sbx1", route("host-c", None), "host-a", forwarded_by="host-b", fenced=None)
    assert isinstance(got, Refuse) and got.code == "forward_loop"


def test_a_fenced_host_serves_nothing_of_its_own() -> None:
    for r in (route("host-a"), None):
        got = decide("sbx1", r, "host-a", forwarded_by=None, fenced="lease expired")
        assert isinstance(got, Refuse) and got.code == "host_fenced"
        assert "lease expired" in got.message
        got = decide("sbx1", r, "host-a", forwarded_by="host-b", fenced="lease expired")
        assert isinstance(got, Refuse) and got.code == "host_fenced"
    # What another live host owns is still forwarded: the owner checks its own fence.
    assert decide("sbx1", route("host-b"), "host-a", forwarded_by=None, fenced="x") \
        == Forward("host-b", "10.0.0.9:8080", 3)


def test_an_owner_without_a_record_is_unavailable_not_served_here() -> None:
    got = decide("sbx1", route("host-b", None), "host-a", forwarded_by=None, fenced=None)
    assert isinstance(got, Refuse) and got.code == "owner_unavailable"


@pytest.mark.parametrize("path,expected", [
    ("/v1/sandboxes/sbx1", "sbx1"), ("/v1/sandboxes/sbx1/exec", "sbx1"),
    ("/v1/sandboxes/a_b-C9/terminal", "a_b-C9"), ("/v1/sandboxes/sbx1/files/x/y", "sbx1"),
    ("/v1/sandboxes", None), ("/v1/sandboxes/", None), ("/v1/templates/x", None),
    ("/v1/sandboxes/a.b", None), ("/v1/sandboxes/" + "a" * 129, None), ("/healthz", None),
])
def test_which_sandbox_an_api_path_is_for(path: str, expected: str | None) -> None:
    assert sandbox_in_path(path) == expected


def test_only_a_fleet_host_is_believed_about_its_client() -> None:
    fleet = {"10.0.0.2", "10.0.0.3"}
    assert client_of("host-b", "10.0.0.2", "1.2.3.4, 5.6.7.8", fleet) == "5.6.7.8"
    assert client_of(None, "10.0.0.2", "5.6.7.8", fleet) is None  # not forwarded
    assert client_of("host-b", "9.9.9.9", "5.6.7.8", fleet) is None  # not a fleet host
    assert client_of("host-b", "10.0.0.2", "", fleet) is None
    assert client_of("host-b", None, "5.6.7.8", fleet) is None


def test_a_sandbox_still_arriving_here_is_retried_not_404() -> None:
    got = decide("sbx1", route("host-a"), "host-a", forwarded_by=None, fenced=None,
                 arriving=True)
    assert isinstance(got, Refuse) and got.code == "owner_unavailable" and "retry" in got.message
    got = decide("sbx1", route("host-a"), "host-a", forwarded_by="host-b", fenced=None,
                 arriving=True)
    assert isinstance(got, Refuse) and got.code == "owner_unavailable"
