"""Find the Debian mirror the host's apt is configured with.

Images are built only from the mirror the operator already trusts (a local
cache, a snapshot, a corporate proxy), never from a hard-coded URL. Both apt
formats are read: deb822 ``*.sources`` files and one-line ``sources.list``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SUITE = "bookworm"
APT_ETC = Path("/etc/apt")


class MirrorError(RuntimeError):
    """No usable Debian mirror is configured on this host."""


@dataclass(frozen=True)
class AptSource:
    """One ``deb`` entry: a URI and the suites/components taken from it."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str = ""

    def __post_init__(self) -> None:
        if not self.uri or not self.suites:
            raise MirrorError(f"incomplete apt source: {self!r}")


def parse_deb822(text: str) -> list[AptSource]:
    """Parse a deb822 ``.sources`` file (stanzas separated by blank lines)."""
    out: list[AptSource] = []
    for stanza in re.split(r"\n\s*\n", text):
        fields = _deb822_fields(stanza)
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        for uri in fields.get("uris", "").split():
            out.append(AptSource(
                uri=uri.rstrip("/"),
                suites=tuple(fields.get("suites", "").split()),
                components=tuple(fields.get("components", "main").split()),
                signed_by=fields.get("signed-by", "").strip(),
            ))
    return out


def _deb822_fields(stanza: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    key = ""
    for line in stanza.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line[0] in " \t" and key:  # continuation line
            fields[key] += "\n" + line.strip()
            continue
        name, sep, value = line.partition(":")
        if sep:
            key = name.strip().lower()
            fields[key] = value.strip()
    return fields


def parse_one_line(text: str) -> list[AptSource]:
    """Parse the one-line format: ``deb [opts] URI SUITE COMPONENT...``."""
    out: list[AptSource] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        opts: dict[str, str] = {}
        match = re.match(r"deb\s+\[([^\]]*)\]\s*(.*)", line)
        rest = line[4:]
        if match:
            for opt in match.group(1).split():
                name, _, value = opt.partition("=")
                opts[name.lower()] = value
            rest = match.group(2)
        parts = rest.split()
        if len(parts) < 2:
            continue
        out.append(AptSource(
            uri=parts[0].rstrip("/"),
            suites=(parts[1],),
            components=tuple(parts[2:]) or ("main",),
            signed_by=opts.get("signed-by", ""),
        ))
    return out


def host_sources(apt_etc: Path = APT_ETC) -> list[AptSource]:
    """All ``deb`` entries of the host's apt configuration, in apt's order."""
    out: list[AptSource] = []
    one_line = apt_etc / "sources.list"
    if one_line.is_file():
        out += parse_one_line(one_line.read_text())
    parts = apt_etc / "sources.list.d"
    for path in sorted(parts.glob("*")) if parts.is_dir() else []:
        if path.suffix == ".sources":
            out += parse_deb822(path.read_text())
        elif path.suffix == ".list":
            out += parse_one_line(path.read_text())
    return out


def suite_sources(sources: list[AptSource], suite: str = SUITE) -> list[AptSource]:
    """Entries for ``suite`` and its companions (-updates, -security), http(s) only.

    Each result names just the matching suites, so it can be written verbatim
    into the guest's apt configuration.
    """
    out: list[AptSource] = []
    for src in sources:
        if not src.uri.startswith(("http://", "https://", "file:/")):
            continue
        suites = tuple(s for s in src.suites if s == suite or s.startswith(suite + "-"))
        if suites:
            out.append(AptSource(src.uri, suites, src.components, src.signed_by))
    return out


def debian_mirror(sources: list[AptSource], suite: str = SUITE) -> AptSource:
    """The entry debootstrap should use: the first that carries ``suite`` itself."""
    for src in suite_sources(sources, suite):
        if suite in src.suites:
            return src
    raise MirrorError(
        f"no apt source on this host serves Debian {suite!r}; "
        "add one to /etc/apt/sources.list.d/ (deb822) or /etc/apt/sources.list"
    )


def render_deb822(sources: list[AptSource]) -> str:
    """Write entries back as one deb822 file (for the guest's /etc/apt)."""
    stanzas = []
    for src in sources:
        lines = [
            "Types: deb",
            f"URIs: {src.uri}",
            f"Suites: {' '.join(src.suites)}",
            f"Components: {' '.join(src.components)}",
        ]
        if src.signed_by and not src.signed_by.startswith("-----"):
            lines.append(f"Signed-By: {src.signed_by}")
        stanzas.append("\n".join(lines) + "\n")
    return "\n".join(stanzas)
