"""What a fast-lane connection remembers of its last exchange, so a repeated head skips work.

Keep-alive clients repeat their headers byte for byte (browsers, polling, load) and often the
method and version: such a head differs at most in its target, which ``preview.admit`` does not
read (a URL carrying a token is never memoized), so while the routing inputs are the same objects
(the running controller, its registry row, the access row) the admission decision holds and only
``preview.destination`` runs again. llhttp still checks every head that is not byte for byte the
previous one (``HeadTemplate``); admission to the sandbox (pacing, activity) is never memoized.
A response head's rewrite is reused only for a Content-Length body, while its Date holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.preview.fastlane.request_head import HeadTemplate, Request
from gateway.preview.hosts import PreviewHost, Target

if TYPE_CHECKING:
    from gateway.preview.fastlane.lane import FastLane


class Memo:
    """A connection's last request headers, parsed, admitted and rewritten for the app, and
    the last response head's rewrite (``resp``)."""

    __slots__ = ("access", "ctl", "decision", "found", "last_raw", "last_req", "last_target",
                 "rec", "resp", "secure", "template", "up_block")

    def __init__(self, req: Request, found: PreviewHost, decision: Any, secure: bool,
                 ctl: Any, access: Any) -> None:
        self.template = HeadTemplate(req)
        self.found, self.decision, self.secure = found, decision, secure
        self.ctl = ctl
        self.rec = ctl.record
        self.access = access
        self.up_block: bytes | None = None  # the headers as sent upstream (Exchange fills it)
        self.resp: RespMemo | None = None
        self.last_raw = b""  # the last head served, its request and target (set by the caller)
        self.last_req: Request | None = None
        self.last_target: Target | None = None

    def valid(self, lane: FastLane) -> bool:
        """The routing inputs are still the ones the decision was made from."""
        sid = self.found.sandbox_id
        running = lane.running
        return running is not None and running(sid) is self.ctl and self.ctl.record is self.rec \
            and lane.access.get(sid) is self.access


class RespMemo:
    """A response head as the app sent it and as it went to the client, for a body of
    ``length`` bytes: the same bytes from the app next time are rewritten the same way."""

    __slots__ = ("client_keep_alive", "date", "length", "out", "raw", "up_keep_alive")

    def __init__(self, raw: bytes, out: bytes, length: int, up_keep_alive: bool,
                 client_keep_alive: bool, date: str | None) -> None:
        self.raw, self.out, self.length = raw, out, length
        self.up_keep_alive, self.client_keep_alive, self.date = \
            up_keep_alive, client_keep_alive, date
