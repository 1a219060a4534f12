import json
import logging
from types import SimpleNamespace

from gateway.http.app import _warn_if_stale
from images.hashing import files_digest, snapshot_files
from images.inputs import GUEST_DIR
from images.manifest import FORMAT


def _image(tmp_path, digest):
    manifest = {"format": FORMAT, "guest_digest": digest}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return SimpleNamespace(name="python", dir=tmp_path)


def test_stale_guest_code_is_reported(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        _warn_if_stale(_image(tmp_path, "0" * 16))
    assert "different guest/ code" in caplog.text


def test_current_guest_code_is_quiet(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        _warn_if_stale(_image(tmp_path, files_digest(snapshot_files(GUEST_DIR))))
    assert caplog.text == ""
