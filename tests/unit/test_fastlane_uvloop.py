"""test_fastlane's connection-level tests again on uvloop, the daemon's loop (its transports
are not asyncio's: the hand-off's set_protocol, pausing and closing run on them here)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from tests.unit import test_fastlane as t

CASES = [
    (t.test_parity_with_aiohttp, ("POST", "/plain", "", b"xyz")),
    (t.test_parity_with_aiohttp, ("GET", "/chunked", "", b"")),
    (t.test_parity_with_aiohttp, ("PUT", "/plain", "", t.BIG)),
    (t.test_keep_alive_and_pipelining, ()),
    (t.test_fast_request_then_hand_off_on_one_connection, ()),
    (t.test_hand_off_matches_aiohttp, ("POST /plain HTTP/1.1\r\nHost: HOST\r\nX-AgentBox-Token: "
                                       "TOKEN\r\nTransfer-Encoding: chunked\r\n\r\n"
                                       "3\r\nabc\r\n0\r\n\r\n",)),
    (t.test_refused_connect_is_handed_off, ()),
    (t.test_no_free_pacing_slot_is_handed_off, ()),
    (t.test_smuggling_never_forwards_two_requests,
     (b"POST /plain HTTP/1.1\r\nHost: HOST\r\nX-AgentBox-Token: TOKEN\r\nContent-Length: 0"
      b"\r\nContent-Length: 40\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: HOST\r\n\r\n",)),
    (t.test_slow_head_is_cut_off, ()),
    (t.test_upstream_failures_before_the_response, ("/hang", 504, b"upstream_timeout")),
    (t.test_upstream_closing_mid_body_closes_the_client, ()),
    (t.test_client_leaving_releases_and_closes_upstream, ()),
    (t.test_large_bodies_stream_both_ways_with_flow_control, ()),
]


@pytest.mark.parametrize(("test", "args"), CASES,
                         ids=[f"{i}-{c[0].__name__}" for i, c in enumerate(CASES)])
def test_on_uvloop(tmp_path, test, args):  # type: ignore[no-untyped-def]
    async def main() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        async with t.make_env(tmp_path) as env:
            await test(env, *args)

    uvloop.run(main())
