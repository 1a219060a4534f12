"""Golden snapshots (``vmctl.golden``): a template booted once, warmed and saved, that
every new sandbox of it is restored from.

The template catalog (gateway.templates.catalog) resolves names to them and the build
wiring (gateway.http.build_routes) builds the built-in ones in the background; they name
goldens through this module, so that nothing above the sandbox layer imports vmctl
(tests/unit/test_walls.py).
"""

from __future__ import annotations

from vmctl.golden import Golden, ensure_golden, load_golden_dir

__all__ = ["Golden", "ensure_golden", "load_golden_dir"]
