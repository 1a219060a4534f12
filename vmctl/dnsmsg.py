"""The few DNS message shapes the sandboxes' resolver handles, parsed strictly (pure, no I/O).

A guest's query is untrusted input: it is accepted only as one standard query (opcode 0, one
IN question, no answers, at most one additional record: EDNS), at most ``MAX_QUERY`` bytes,
with an uncompressed name of valid labels. Anything else is dropped without a reply. The
upstream's answer is parsed just enough to find the A/AAAA addresses (and TTLs) that an
allowed name resolved to, following compression pointers with a bounded number of jumps.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

MAX_QUERY = 512
MAX_RESPONSE = 65535
MAX_RECORDS = 64
NOERROR, SERVFAIL, NXDOMAIN, REFUSED = 0, 2, 3, 5
TYPE_A, TYPE_AAAA, CLASS_IN = 1, 28, 1
_HEADER = struct.Struct("!HHHHHH")


class DnsError(ValueError):
    """A message that is not what we accept."""


@dataclass(frozen=True)
class Query:
    id: int
    name: str  # lower-case, no trailing dot
    qtype: int
    end: int  # offset just past the question section


def parse_query(data: bytes) -> Query:
    if not _HEADER.size <= len(data) <= MAX_QUERY:
        raise DnsError(f"query of {len(data)} bytes")
    qid, flags, qd, an, ns, ar = _HEADER.unpack_from(data)
    if flags & 0x8000 or (flags >> 11) & 0xF or flags & 0x000F:
        raise DnsError("not a standard query")
    if qd != 1 or an or ns or ar > 1:
        raise DnsError("a query asks exactly one question")
    labels, pos = [], _HEADER.size
    while True:
        if pos >= len(data):
            raise DnsError("truncated name")
        length = data[pos]
        pos += 1
        if length == 0:
            break
        if length > 63 or pos + length > len(data):
            raise DnsError("bad label")  # also every compression pointer (0xC0..)
        label = data[pos:pos + length]
        if not all(c == 0x2D or c == 0x5F or 0x30 <= c <= 0x39 or 0x41 <= c <= 0x5A
                   or 0x61 <= c <= 0x7A for c in label):
            raise DnsError("a label holds a character a host name does not")
        labels.append(label.decode("ascii").lower())
        pos += length
    name = ".".join(labels)
    if not labels or len(name) > 253 or pos + 4 > len(data):
        raise DnsError("bad question")
    qtype, qclass = struct.unpack_from("!HH", data, pos)
    if qclass != CLASS_IN:
        raise DnsError("not class IN")
    return Query(qid, name, qtype, pos + 4)


def error_reply(data: bytes, query: Query, rcode: int) -> bytes:
    """An answer-less reply to ``query`` (its question echoed) with ``rcode``."""
    _, flags, *_ = _HEADER.unpack_from(data)
    reply_flags = 0x8000 | 0x0080 | (flags & 0x0100) | rcode  # QR, RA, the client's RD
    return _HEADER.pack(query.id, reply_flags, 1, 0, 0, 0) + data[_HEADER.size:query.end]


def _skip_name(data: bytes, pos: int) -> int:
    """Offset just past the (possibly compressed) name at ``pos``."""
    for _ in range(128):
        if pos >= len(data):
            raise DnsError("truncated name")
        length = data[pos]
        if length & 0xC0 == 0xC0:
            if pos + 2 > len(data):
                raise DnsError("truncated pointer")
            return pos + 2
        if length & 0xC0:
            raise DnsError("bad label type")
        if length == 0:
            return pos + 1
        pos += 1 + length
    raise DnsError("name too long")


def answer_addresses(data: bytes, query: Query) -> list[tuple[str, int]]:
    """(address, TTL) of every A/AAAA record in the answer section of the reply to ``query``
    (checked: same id, a reply, the same question)."""
    if not _HEADER.size <= len(data) <= MAX_RESPONSE:
        raise DnsError(f"reply of {len(data)} bytes")
    qid, flags, qd, an, _, _ = _HEADER.unpack_from(data)
    if qid != query.id or not flags & 0x8000 or qd != 1:
        raise DnsError("not the reply to this query")
    pos = _skip_name(data, _HEADER.size) + 4
    found = []
    for _ in range(min(an, MAX_RECORDS)):
        pos = _skip_name(data, pos)
        if pos + 10 > len(data):
            raise DnsError("truncated record")
        rtype, rclass, ttl, rdlen = struct.unpack_from("!HHIH", data, pos)
        pos += 10
        if pos + rdlen > len(data):
            raise DnsError("truncated record data")
        rdata = data[pos:pos + rdlen]
        pos += rdlen
        if rclass == CLASS_IN and (rtype, rdlen) in ((TYPE_A, 4), (TYPE_AAAA, 16)):
            found.append((str(ipaddress.ip_address(rdata)), ttl & 0x7FFFFFFF))
    return found


def rcode(data: bytes) -> int:
    return _HEADER.unpack_from(data)[1] & 0xF if len(data) >= _HEADER.size else SERVFAIL
