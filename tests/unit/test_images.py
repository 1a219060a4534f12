"""images/: content hashing, apt source parsing, manifests, catalog look-ups."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from guest.agent import zygote_preload
from images import catalog, manifest, rootfs
from images.debs import DebPackage
from images.hashing import digest, files_digest, snapshot_files
from images.inputs import BuildInputs
from images.mirror import (
    AptSource, MirrorError, debian_mirror, host_sources, parse_deb822, parse_one_line,
    render_deb822, suite_sources,
)
from images.templates import SPECS, TEMPLATES

DEB822 = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://mirror.example/debian
Suites: bookworm

Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main
Enabled: yes

Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Enabled: no
"""

ONE_LINE = """\
# comment
deb [arch=amd64 signed-by=/etc/apt/k.gpg] http://one.example/debian bookworm main non-free
deb-src http://one.example/debian bookworm main
deb http://one.example/debian-security bookworm-security main   # trailing comment
deb http://old.example/debian bullseye main
"""


def test_parse_deb822_keeps_deb_entries_only() -> None:
    sources = parse_deb822(DEB822)
    assert [s.uri for s in sources] == [
        "http://mirror.example/debian", "http://security.example/debian-security"]
    assert sources[0].suites == ("bookworm", "bookworm-updates")
    assert sources[0].components == ("main", "contrib")
    assert sources[0].signed_by == "/usr/share/keyrings/debian-archive-keyring.gpg"


def test_parse_one_line_with_options_and_comments() -> None:
    sources = parse_one_line(ONE_LINE)
    assert [(s.uri, s.suites) for s in sources] == [
        ("http://one.example/debian", ("bookworm",)),
        ("http://one.example/debian-security", ("bookworm-security",)),
        ("http://old.example/debian", ("bullseye",)),
    ]
    assert sources[0].components == ("main", "non-free")
    assert sources[0].signed_by == "/etc/apt/k.gpg"


def test_mirror_is_first_source_serving_the_suite() -> None:
    sources = suite_sources(parse_one_line(ONE_LINE) + parse_deb822(DEB822))
    assert debian_mirror(sources).uri == "http://one.example/debian"
    assert all(s.suites[0].startswith("bookworm") for s in sources)  # bullseye dropped


def test_no_mirror_is_a_clear_error() -> None:
    with pytest.raises(MirrorError, match="bookworm"):
        debian_mirror(suite_sources(parse_one_line("deb http://x/debian bullseye main\n")))


def test_host_sources_reads_both_formats(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(ONE_LINE)
    (tmp_path / "sources.list.d" / "debian.sources").write_text(DEB822)
    (tmp_path / "sources.list.d" / "ignored.save").write_text(ONE_LINE)
    assert len(host_sources(tmp_path)) == 5


def test_render_deb822_round_trips() -> None:
    sources = suite_sources(parse_deb822(DEB822))
    assert parse_deb822(render_deb822(sources)) == sources


def _inputs(tmp_path: Path, **changes: object) -> BuildInputs:
    src = AptSource("http://mirror.example/debian", ("bookworm",), ("main",))
    base = BuildInputs(
        spec=SPECS["python"], sources=(src,), mirror=src,
        kernel=DebPackage("linux-image-6.1.0-57-cloud-amd64", "6.1.192-3"),
        busybox=DebPackage("busybox-static", "1:1.35.0-4"),
        guest_files=(("init.py", b"v1"),),
    )
    return dataclasses.replace(base, **changes)


def test_template_hash_is_stable(tmp_path: Path) -> None:
    first = _inputs(tmp_path).template_hash
    assert first == _inputs(tmp_path).template_hash
    assert len(first) >= 16 and int(first, 16) >= 0


@pytest.mark.parametrize("change", [
    {"guest_files": (("init.py", b"v2"),)},
    {"kernel": DebPackage("linux-image-6.1.0-58-cloud-amd64", "6.1.200-1")},
    {"busybox": DebPackage("busybox-static", "1:1.36")},
    {"cmdline": "console=ttyS0"},
    {"spec": SPECS["minimal"]},
    {"spec": dataclasses.replace(SPECS["python"], packages=("python3-pip",))},
    {"spec": dataclasses.replace(SPECS["python"], warmup="import os")},
    {"spec": dataclasses.replace(SPECS["python"], preload=("json",))},
    {"mirror": AptSource("http://other.example/debian", ("bookworm",), ("main",))},
    {"rootfs_code": "new"},
    {"initrd_code": "new"},
])
def test_template_hash_changes_with_any_input(tmp_path: Path, change: dict) -> None:
    assert _inputs(tmp_path, **change).template_hash != _inputs(tmp_path).template_hash


def test_layer_keys_change_only_where_affected(tmp_path: Path) -> None:
    base = _inputs(tmp_path)
    warm = _inputs(tmp_path, spec=dataclasses.replace(SPECS["python"], warmup="x = 1"))
    assert warm.rootfs_key == base.rootfs_key  # warm-up needs no new disk
    new_guest = _inputs(tmp_path, guest_files=(("init.py", b"v1"), ("agent.py", b"")))
    assert new_guest.initrd_key == base.initrd_key and new_guest.rootfs_key != base.rootfs_key
    assert new_guest.base_key == base.base_key  # the debootstrap cache is shared


def test_files_digest_tracks_content_and_ignores_caches(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text("print(1)\n")
    first = files_digest(snapshot_files(tmp_path))
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "agent.cpython-311.py").write_text("junk")
    (tmp_path / "notes.txt").write_text("not python")
    assert files_digest(snapshot_files(tmp_path)) == first
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "agent.py").write_text("print(1)\n")
    assert files_digest(snapshot_files(tmp_path)) != first  # same content, other path
    (tmp_path / "sub" / "agent.py").unlink()
    (tmp_path / "agent.py").write_text("print(2)\n")
    assert files_digest(snapshot_files(tmp_path)) != first


def test_digest_ignores_dict_order() -> None:
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    assert digest("a", 1) != digest("a", 2)


def test_write_manifest_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest.write_manifest(tmp_path, {"name": "old"})

    def explode(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", explode)
    with pytest.raises(OSError):
        manifest.write_manifest(tmp_path, {"name": "new"})
    data = manifest.read_manifest(tmp_path)
    assert data is not None and data["name"] == "old"


def test_read_manifest_rejects_partial_or_foreign(tmp_path: Path) -> None:
    assert manifest.read_manifest(tmp_path) is None
    (tmp_path / "manifest.json").write_text('{"name": "py')
    assert manifest.read_manifest(tmp_path) is None
    (tmp_path / "manifest.json").write_text('{"format": 999}')
    assert manifest.read_manifest(tmp_path) is None


def _fake_build(images_dir: Path, name: str, digest_: str, built_at: float,
                with_manifest: bool = True, guest_digest: str = "other") -> Path:
    d = images_dir / name / digest_
    d.mkdir(parents=True)
    for f in ("vmlinuz", "initrd.img", "rootfs.ext4"):
        (d / f).write_bytes(b"x")
    if with_manifest:
        manifest.write_manifest(d, {
            "name": name, "hash": digest_, "built_at": built_at,
            "files": {"kernel": "vmlinuz", "initrd": "initrd.img", "rootfs": "rootfs.ext4"},
            "cmdline": "console=ttyS0", "mem_mib": 512, "warmup": "",
            "guest_digest": guest_digest,
        })
    return d


def test_load_template_takes_latest_complete_build(tmp_path: Path) -> None:
    assert catalog.load_template("python", tmp_path) is None
    _fake_build(tmp_path, "python", "a" * 20, built_at=100.0)
    newest = _fake_build(tmp_path, "python", "b" * 20, built_at=200.0)
    _fake_build(tmp_path, "python", "c" * 20, built_at=300.0, with_manifest=False)
    _fake_build(tmp_path, "python", ".tmp-" + "d" * 20, built_at=400.0)
    image = catalog.load_template("python", tmp_path)
    assert image is not None and image.dir == newest and image.hash == "b" * 20
    assert image.kernel == newest / "vmlinuz" and image.mem_mib == 512


def test_load_template_prefers_a_build_of_this_checkouts_guest_code(tmp_path: Path) -> None:
    """Several checkouts share one images dir: the newest build of *our* guest/ code wins
    over a newer build of another checkout's."""
    from images.hashing import files_digest, snapshot_files
    from images.inputs import GUEST_DIR

    ours = _fake_build(tmp_path, "python", "a" * 20, built_at=100.0,
                       guest_digest=files_digest(snapshot_files(GUEST_DIR)))
    _fake_build(tmp_path, "python", "b" * 20, built_at=200.0)  # another checkout's
    image = catalog.load_template("python", tmp_path)
    assert image is not None and image.dir == ours


def test_load_template_ignores_build_with_missing_file(tmp_path: Path) -> None:
    d = _fake_build(tmp_path, "python", "a" * 20, built_at=1.0)
    os.unlink(d / "rootfs.ext4")
    assert catalog.load_template("python", tmp_path) is None


def test_unknown_template_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown template"):
        catalog.load_template("cobol", tmp_path)


def test_templates_are_the_contracted_four() -> None:
    assert set(TEMPLATES) == {"python", "minimal", "node", "python-datascience"}
    assert TEMPLATES[0] == "python"
    assert "python3-numpy" not in SPECS["python"].packages
    for name in ("python", "python-datascience"):
        compile(SPECS[name].warmup, name, "exec")


def test_zygote_preload_per_template(tmp_path: Path) -> None:
    assert {"numpy", "pandas", "matplotlib.pyplot"} <= set(SPECS["python-datascience"].preload)
    assert SPECS["minimal"].preload == () and "numpy" not in SPECS["python"].preload
    with pytest.raises(ValueError, match="preload"):
        dataclasses.replace(SPECS["python"], preload=("numpy; import os",))
    new = _inputs(tmp_path, spec=dataclasses.replace(SPECS["python"], preload=("json",)))
    assert new.rootfs_key != _inputs(tmp_path).rootfs_key  # the list is a file in the rootfs
    rootfs.install_zygote_preload(tmp_path, ("numpy", "pandas"))
    assert zygote_preload(None, str(tmp_path / rootfs.ZYGOTE_PRELOAD)) == ("numpy", "pandas")
