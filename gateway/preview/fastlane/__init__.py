"""The preview fast lane: simple preview requests proxied without aiohttp on either side.

Theory of operation
-------------------
The daemon's listening socket speaks ``FrontProtocol``. Per connection it reads
request heads and parses them with httptools (llhttp), then either serves the
request itself or hands the connection to aiohttp for good.

It serves a request when all of these hold: the Host is a preview host, the
framing is plain (origin-form target, HTTP/1.0 or 1.1, no Upgrade, Expect or
Transfer-Encoding, at most one Content-Length, ASCII only, CRLF only, no
obs-fold, within aiohttp's line and header limits), it is not an SSE request,
``preview.admit`` and ``preview.destination`` (the two steps of ``preview.route``,
the aiohttp path's: one set of rules) answer with a ``Target``, the sandbox's
controller is RUNNING and admits it at once (``SandboxController.try_request``:
a free pacing slot, then the core's AdmitNow -> Admit; RequestLeft when the
exchange ends) and an upstream connection is pooled or connects. Anything else
(API hosts, errors, wakes, holds, redirects, WebSockets, chunked uploads,
malformed or ambiguous framing, a refused connect: aiohttp does the expose-port
retry) goes to aiohttp at the
request boundary, before any byte of that request went upstream: the buffered
bytes are replayed into ``runner.server()``'s protocol, which owns the
connection from then on.

What the app and the client see is what the aiohttp path gives them: the same
header rewriting (``proxy_headers``), the request line and headers aiohttp's
client would send, the response framing aiohttp's server would choose (bodies
without a length are re-chunked for HTTP/1.1 clients; an HTTP/1.0 client gets
a close-delimited body), 1xx interim responses dropped, and the same error
bodies for upstream failures before the response starts (504
``upstream_timeout``, 502 ``bad_gateway``). Once the response has started, a
broken upstream closes the client connection, so a truncated body is never
taken for a complete one.

Per connection, the last request's headers are memoized with their admission
decision and rewrite (``Memo``): a head that repeats them (keep-alive clients do)
skips the parse and ``preview.admit`` while the routing inputs are unchanged;
llhttp still checks every head that is not byte for byte the previous one, and
admission, pacing and activity are never memoized. Counts: ``/metrics``
``agentbox_events_total{event="fast_lane_served"|"fast_lane_handed_off"}``.

Not done here (aiohttp's path keeps them): the expose-port retry of a refused
connect, wakes and holds, WebSockets and SSE, and any request after a hand-off
(a connection never comes back from aiohttp).

Bounded: request heads by aiohttp's limits (anything bigger is handed off and
refused there), the time to send a head by ``header_read_timeout`` (armed when
the connection opens and after each response, like aiohttp's keep-alive
timer), pipelined bytes by ``PIPELINE_MAX`` (reading pauses), the upstream's
response head by ``MAX_RESPONSE_HEAD`` (502), silence from the upstream by
``proxy_read_timeout``, idle pooled connections by count and age. Flow control
both ways: a side whose write buffer is full pauses reading the other.

Modules, one job each
---------------------
``request_head``   sans I/O: bytes in; a plain request head, NEED_MORE or NOT_FAST out
``response_head``  sans I/O: the response head aiohttp's server would write
``front``          ``FrontProtocol``: a client connection, admission, the hand-off to aiohttp
``memo``           what a connection remembers of its last request: a repeated head skips work
``exchange``       ``Exchange``: one request, from admission to its response
``upstream``       ``Upstream``: one raw connection to the app; its response, rewritten
``upstream_pool``  ``RawPool``: idle upstream connections, per sandbox and VMM
``lane``           ``FastLane``: what a listener's connections share; their deadlines; shutdown
``listener``       ``FastSite``, ``run_app``, ``bind``: the lane on the daemon's listening socket
"""

from gateway.preview.fastlane.lane import FastLane
from gateway.preview.fastlane.listener import FastSite, bind, run_app

__all__ = ["FastLane", "FastSite", "bind", "run_app"]
