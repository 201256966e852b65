"""The compile-mode cache: keyed by what decides a mode's speed, and never in the way when it
cannot be read or written."""

import json
import logging
import multiprocessing
import os

import pytest
from test_compile_mode import make_trainer

from mixloop import machine as mixloop_machine
from mixloop.runner import compile_cache


def test_a_changed_batch_policy_or_model_is_another_key(tmp_path):
    keys = {name: compile_cache.key_of(compile_cache.setup(make_trainer(tmp_path / name, **change).run))
            for name, change in {
                "configured": {}, "same": {}, "batch": {"train.batch_size": 64},
                "accumulation": {"train.accumulation_steps": 1},
                "policy": {"precision.policy": "mixed_bfloat16"},
                "width": {"model.width": 24}}.items()}
    assert keys["same"] == keys["configured"]
    others = [keys[name] for name in ("batch", "accumulation", "policy", "width")]
    assert len(set(others)) == 4 and keys["configured"] not in others


def test_a_changed_engine_is_another_key(tmp_path, monkeypatch):
    """mixloop's step and gradients decide a mode's speed too: a changed engine measures again."""
    trainer = make_trainer(tmp_path)
    configured = compile_cache.key_of(compile_cache.setup(trainer.run))
    engine = tmp_path / "engine"
    engine.mkdir()
    for path in sorted(compile_cache.ENGINE_FOLDER.glob("*.py")):
        (engine / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(compile_cache, "ENGINE_FOLDER", engine)
    assert compile_cache.key_of(compile_cache.setup(trainer.run)) == configured
    (engine / "step.py").write_text((engine / "step.py").read_text() + "\n# changed\n")
    assert compile_cache.key_of(compile_cache.setup(trainer.run)) != configured


def test_the_machine_part_names_the_cpu_and_its_flags(tmp_path):
    machine = compile_cache.setup(make_trainer(tmp_path).run)["machine"]
    assert machine["model"] and machine["gpus"] == []
    if os.path.exists("/proc/cpuinfo"):
        assert "sse2" in machine["flags"].split() and machine == {**mixloop_machine.cpu(), "gpus": []}


def test_a_stored_choice_is_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "cache"))
    assert compile_cache.lookup("k") is None
    compile_cache.store("k", "elementwise", {"xla": 1.0, "graph": 2.0, "elementwise": 3.0})
    compile_cache.store("j", False, {})
    entry = compile_cache.lookup("k")
    assert entry["mode"] == "elementwise" and entry["examples_per_sec"]["elementwise"] == 3.0
    assert compile_cache.lookup("j")["mode"] is False
    # No temporary file left; the lock file that orders two runs' stores stays, empty.
    assert sorted(os.listdir(tmp_path / "cache")) == [compile_cache.FILE_NAME,
                                                      compile_cache.FILE_NAME + ".lock"]


def test_off_neither_reads_nor_writes(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.CACHE_ENV, compile_cache.OFF)
    assert compile_cache.cache_path() is None
    compile_cache.store("k", True, {})
    assert compile_cache.lookup("k") is None


def test_default_folder_is_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.cache_path() == str(tmp_path / "mixloop" / compile_cache.FILE_NAME)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "\x00\x01"])
def test_a_corrupt_cache_is_ignored_with_one_warning_and_rewritten(tmp_path, monkeypatch, caplog,
                                                                   content):
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path))
    (tmp_path / compile_cache.FILE_NAME).write_text(content)
    with caplog.at_level(logging.WARNING):
        assert compile_cache.lookup("k") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("Ignoring the compile-mode cache ")
    compile_cache.store("k", True, {})
    assert json.loads((tmp_path / compile_cache.FILE_NAME).read_text())["k"]["mode"] is True


def test_an_unwritable_cache_is_one_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(blocker / "cache"))  # Under a file: unwritable.
    with caplog.at_level(logging.WARNING):
        compile_cache.store("k", True, {})
        assert compile_cache.lookup("k") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("Could not write the compile-mode cache ")


def _store_many(start: int, count: int) -> None:
    for key in range(start, start + count):
        compile_cache.store(f"key-{key}", False, {"graph": 1.0})


def test_two_processes_storing_at_once_lose_no_entry(compile_mode_cache):
    """Each store reads the file, adds its entry and writes it whole: without a lock, one process's
    write replaced entries the other had just added."""
    context = multiprocessing.get_context("fork")  # The store is plain Python: no TensorFlow runs.
    writers = [context.Process(target=_store_many, args=(start, 40)) for start in (0, 40)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
        assert writer.exitcode == 0
    entries = json.loads(open(compile_cache.cache_path()).read())
    assert sorted(entries) == sorted(f"key-{key}" for key in range(80))
