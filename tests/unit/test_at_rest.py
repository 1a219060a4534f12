"""The daemon's files at rest: data dir 0700, registry (and its -wal/-shm) and keys 0600,
with those modes from creation. Tests run under umask 0, so only an explicit mode at
creation can give the results asserted (SQLite's own default is 0644)."""

from __future__ import annotations

import os
import stat

import pytest

from gateway.store import at_rest
from gateway.http.app import ensure_admin_key
from gateway.store.registry import Registry


@pytest.fixture
def umask0():
    old = os.umask(0)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_data_dir_is_created_0700_and_an_old_one_tightened(tmp_path, umask0):
    new = at_rest.private_dir(tmp_path / "a" / "data")
    assert mode(new) == 0o700
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    assert mode(at_rest.private_dir(old)) == 0o700


def test_registry_and_its_wal_and_shm_are_0600(tmp_path, umask0):
    reg = Registry(tmp_path / "registry.sqlite")
    reg.create_key("t")  # a write: the -wal and -shm files exist now
    for suffix in ("", "-wal", "-shm"):
        path = tmp_path / f"registry.sqlite{suffix}"
        assert path.exists() and mode(path) == 0o600, (suffix, oct(mode(path)))
    reg.close()


def test_a_registry_left_0644_is_tightened_with_its_side_files(tmp_path, umask0):
    reg = Registry(tmp_path / "registry.sqlite")
    reg.create_key("t")
    for suffix in ("", "-wal", "-shm"):
        os.chmod(tmp_path / f"registry.sqlite{suffix}", 0o644)
    reg2 = Registry(tmp_path / "registry.sqlite")  # while the first still holds -wal/-shm
    for suffix in ("", "-wal", "-shm"):
        assert mode(tmp_path / f"registry.sqlite{suffix}") == 0o600, suffix
    reg.close()
    reg2.close()


def test_admin_key_is_0600_and_never_written_into_a_file_someone_else_opened(tmp_path, umask0):
    stale = tmp_path / "admin.key"
    stale.write_text("old\n")
    os.chmod(stale, 0o644)
    with open(stale) as spy:  # an fd another user opened while the file was readable
        reg = Registry(tmp_path / "registry.sqlite")
        path = ensure_admin_key(reg, tmp_path)
        assert path == stale and mode(path) == 0o600
        secret = path.read_text().strip()
        assert secret.startswith("ab_") and reg.lookup_key(secret) is not None
        assert spy.read() == "old\n"  # a new inode: the secret never went through the old one
    assert not list(tmp_path.glob(".admin.key*"))
    reg.close()
