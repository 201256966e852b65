"""One run per workdir and its config history (runner/workdir.py): the lock, config.json kept per
change with the `resolved` record carried over, and the one-line refusals."""

import json
import os
import socket

import ml_collections
import pytest

from mixloop.errors import UserError
from mixloop.runner import workdir


def config(**train):
    c = ml_collections.ConfigDict()
    c.train = dict(num_steps=10, **train)
    return c


def test_the_lock_refuses_a_live_owner_takes_over_a_stale_one_and_releases_its_own(tmp_path):
    lock = tmp_path / workdir.LOCK_NAME
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))  # Alive.
    with pytest.raises(UserError, match=f"workdir {tmp_path} is in use by process {os.getppid()}"):
        with workdir.WorkdirLock(str(tmp_path)):
            pass
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))  # An earlier life.
    with workdir.WorkdirLock(str(tmp_path)):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()
    lock.mkdir()
    with pytest.raises(UserError, match="is a folder, where mixloop keeps the workdir's lock file"):
        with workdir.WorkdirLock(str(tmp_path)):
            pass


def test_a_changed_config_keeps_the_earlier_one_and_its_resolved_record(tmp_path):
    directory = str(tmp_path)
    workdir.write_config(directory, config(batch_size=8), step=0)
    workdir.record_resolved(directory, {"jit_compile": False})
    workdir.write_config(directory, config(batch_size=8), step=5)  # Unchanged: nothing new.
    assert sorted(os.listdir(directory)) == ["config.json"]
    workdir.write_config(directory, config(batch_size=16), step=5)
    assert sorted(os.listdir(directory)) == ["config-step-5.json", "config.json"]
    assert json.loads((tmp_path / "config-step-5.json").read_text())["train"]["batch_size"] == 8
    assert workdir.read_resolved(directory) == {"jit_compile": False}  # Carried over.
    assert workdir.config_changes({"a": {"b": 1}}, {"a": {"b": 2}, "c": 3}) == [
        "a.b: 1 -> 2", "c: '(absent)' -> 3"]


def test_a_hand_edited_record_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"resolved": [1, 2]}))
    with pytest.raises(UserError, match="its .resolved. record is an array, not a JSON object"):
        workdir.read_resolved(str(tmp_path))
    line = str(workdir.refuse_recorded(str(tmp_path), "jit_compile", 7, "a compile mode"))
    assert line.endswith("records resolved.jit_compile=7, which is not a compile mode; repair it, or "
                         "delete the key from the 'resolved' record to choose it again")
