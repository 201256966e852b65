"""Writing a file whole (mixloop/files.py): JSON renamed into place, the earlier file kept on request,
nothing half-written on failure."""

import json
import os

import pytest

from mixloop import files


def test_a_file_is_written_whole_and_the_one_it_replaces_can_be_kept(tmp_path):
    path = str(tmp_path / "config.json")
    files.write_json(path, {"b": 1, "a": float("nan")}, sort_keys=True)
    files.write_json(path, {"b": 2}, keep_as=str(tmp_path / "config-old.json"))
    assert json.loads(open(path).read()) == {"b": 2}
    assert json.loads((tmp_path / "config-old.json").read_text()) == {"a": "nan", "b": 1}
    assert sorted(os.listdir(tmp_path)) == ["config-old.json", "config.json"]


def test_a_failed_write_leaves_the_file_as_it_was_and_no_partial_one(tmp_path):
    path = str(tmp_path / "config.json")
    files.write_json(path, {"kept": True})
    with pytest.raises(OSError):
        files.write_json(path, {"new": True}, keep_as=str(tmp_path / "missing" / "old.json"))
    assert json.loads(open(path).read()) == {"kept": True}
    assert os.listdir(tmp_path) == ["config.json"]
