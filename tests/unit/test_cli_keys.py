"""`agentbox-server keys create|ls|set|revoke` on a registry in a temporary data dir."""

from __future__ import annotations

import json

from gateway.cli import main
from gateway.store.registry import Registry


def keys(capsys, data_dir, *argv: str) -> tuple[int, str, str]:
    rc = main(["keys", "--data-dir", str(data_dir), "--json", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_create_set_ls_revoke(tmp_path, capsys):
    rc, out, _ = keys(capsys, tmp_path, "create", "--name", "t", "--max-sandboxes", "2",
                      "--rate", "1.5")
    assert rc == 0
    created = json.loads(out)
    reg = Registry(tmp_path / "registry.sqlite")
    try:
        assert reg.lookup_key(created["key"]).limits == {"max_sandboxes": 2, "rate": 1.5}
        rc, out, _ = keys(capsys, tmp_path, "set", created["id"], "--max-sandboxes", "default",
                          "--burst", "5")
        assert rc == 0 and reg.get_key(created["id"]).limits == {"rate": 1.5, "burst": 5}
        row = json.loads(out)[0]
        assert row["limits"]["max_sandboxes"] == 64 and row["limits"]["burst"] == 5
        rc, _, err = keys(capsys, tmp_path, "set", created["id"], "--burst", "0")
        assert rc == 2 and "burst" in err and reg.get_key(created["id"]).limits["burst"] == 5
        rc, out, _ = keys(capsys, tmp_path, "ls")
        assert [k["id"] for k in json.loads(out)] == [created["id"]]
        assert keys(capsys, tmp_path, "revoke", created["id"])[0] == 0
        assert reg.lookup_key(created["key"]) is None
        assert json.loads(keys(capsys, tmp_path, "list")[1]) == []
        assert keys(capsys, tmp_path, "set", "key_nope", "--rate", "1")[0] == 1
    finally:
        reg.close()
