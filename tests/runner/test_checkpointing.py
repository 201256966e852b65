"""Storage faults in the checkpoint folder: a lost or garbled index, a damaged newest checkpoint, a
full disk and leftovers of interrupted saves. Nothing resumed is ever wrong, nothing good is lost."""

import logging
import os
import re
import shutil
import subprocess

import cli_runs
import numpy as np
import pytest
import tensorflow as tf
import tiny_experiment

from cli_runs import TINY_CONFIG
from mixloop.errors import UserError
from mixloop.runner.run import Run

DATA = ".data-00000-of-00001"


def make_trainer(workdir, num_steps):
    config = tiny_experiment.get_config()
    config.train.num_steps = num_steps
    config.deterministic = True
    config.jit_compile = False  # Faster to start; storage does not depend on it.
    return tiny_experiment.TinyTrainer(config, str(workdir))


def saved_steps(workdir):
    names = os.listdir(os.path.join(workdir, "checkpoints"))
    return sorted(int(name[len("ckpt-"):-len(".index")]) for name in names if name.endswith(".index"))


def tensors(prefix):
    """Every model and optimizer tensor of the checkpoint `prefix`."""
    reader = tf.train.load_checkpoint(str(prefix))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith(("model_variables/", "objectives/"))}


def restored_from(caplog):
    return [r.getMessage().split()[-1] for r in caplog.records if r.getMessage().startswith("Restored ")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workdir trained to step 60, with checkpoints at 20, 40 and 60."""
    workdir = tmp_path_factory.mktemp("trained")
    make_trainer(workdir, 60).train()
    assert saved_steps(workdir) == [20, 40, 60]
    return workdir


@pytest.fixture
def workdir(trained, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


# ----- The index (`checkpoints/checkpoint`) -----

@pytest.mark.parametrize("index", [None, "garbage {{{\n\x00\x01", ""], ids=["deleted", "garbled", "empty"])
def test_a_lost_or_garbled_index_resumes_from_the_newest_checkpoint_on_disk(workdir, caplog, index):
    checkpoints = workdir / "checkpoints"
    os.remove(checkpoints / "checkpoint")
    if index is not None:
        (checkpoints / "checkpoint").write_text(index)
    newest_written = os.stat(checkpoints / "ckpt-60.index").st_mtime_ns

    trainer = make_trainer(workdir, 80)
    trainer.train()

    assert "The checkpoint index" in caplog.text and "rebuilt it from the checkpoints on disk" in caplog.text
    assert restored_from(caplog) == [str(checkpoints / "ckpt-60")]
    assert int(trainer.run.global_step.numpy()) == 80
    assert os.stat(checkpoints / "ckpt-60.index").st_mtime_ns == newest_written  # Read, not rewritten.
    # The rotation knew every checkpoint: the oldest went, as with the index intact.
    assert saved_steps(workdir) == [40, 60, 80]
    state = tf.train.get_checkpoint_state(str(checkpoints))
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [
        "ckpt-40", "ckpt-60", "ckpt-80"]


def test_an_index_naming_only_deleted_checkpoints_starts_afresh(workdir):
    for name in os.listdir(workdir / "checkpoints"):
        if name.startswith("ckpt-"):
            os.remove(workdir / "checkpoints" / name)

    trainer = make_trainer(workdir, 80)

    assert trainer.run.restore() is None and int(trainer.run.global_step.numpy()) == 0
    assert os.listdir(workdir / "checkpoints") == []


# ----- A damaged newest checkpoint -----

def sizes(prefix):
    """The sizes of the index and data files of checkpoint `prefix` that are on disk."""
    return {suffix: os.path.getsize(prefix + suffix) for suffix in (".index", DATA)
            if os.path.exists(prefix + suffix)}


def truncate_data(prefix):
    size = os.path.getsize(prefix + DATA)
    os.truncate(prefix + DATA, size // 2)


def flip_bytes(prefix):
    with open(prefix + DATA, "r+b") as data:
        data.seek(os.path.getsize(prefix + DATA) // 2)
        middle = data.read(16)
        data.seek(-len(middle), os.SEEK_CUR)
        data.write(bytes(byte ^ 0xFF for byte in middle))


def empty_index(prefix):
    os.truncate(prefix + ".index", 0)


def delete_index(prefix):
    os.remove(prefix + ".index")


@pytest.mark.parametrize("damage, problem", [
    (truncate_data, "Read less bytes than requested"),
    (flip_bytes, "does not match|Unable to parse"),  # A checksum, or the data position's header.
    (empty_index, "too short"),
    (delete_index, "its index file ckpt-60.index is missing"),
])
def test_a_damaged_newest_checkpoint_is_named_kept_and_the_previous_one_resumed(
        trained, workdir, caplog, damage, problem):
    newest = str(workdir / "checkpoints" / "ckpt-60")
    damage(newest)
    damaged_sizes = sizes(newest)
    leftover = workdir / "checkpoints" / "ckpt-60_temp"  # As a save killed mid-way leaves it.
    leftover.mkdir()
    (leftover / "part-00000-of-00001.data-00000-of-00001.tempstate1").write_bytes(b"\0" * 100)

    trainer = make_trainer(workdir, 60)
    # Kept on disk, and out of the index: the manager's rotation will not delete it.
    assert sizes(newest) == damaged_sizes
    assert trainer.run.checkpoints.checkpoints == [str(workdir / "checkpoints" / f"ckpt-{step}")
                                               for step in (20, 40)]
    trainer.train()

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "absl"]
    assert len(warnings) == 1 and re.search(problem, warnings[0]), warnings
    assert warnings[0].startswith(f"Checkpoint {newest} is unreadable (")
    assert f"resuming from {workdir}/checkpoints/ckpt-40 instead" in warnings[0]
    assert restored_from(caplog) == [str(workdir / "checkpoints" / "ckpt-40")]
    # The new save of step 60 replaced the damaged one with the same state as before the damage.
    reference, resumed = tensors(trained / "checkpoints" / "ckpt-60"), tensors(newest)
    assert resumed.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)
    assert not leftover.exists()


def test_no_readable_checkpoint_is_refused_in_one_line_touching_nothing(workdir):
    for step in (20, 40, 60):
        truncate_data(str(workdir / "checkpoints" / f"ckpt-{step}"))
    before = sorted(os.listdir(workdir / "checkpoints"))

    with pytest.raises(UserError) as raised:
        make_trainer(workdir, 80)

    assert str(raised.value).startswith(
        f"no checkpoint in {workdir}/checkpoints is readable (the newest, "
        f"{workdir}/checkpoints/ckpt-60: Read less bytes than requested); move them away")
    assert sorted(os.listdir(workdir / "checkpoints")) == before


@pytest.mark.slow
def test_every_index_file_deleted_is_refused_in_one_line_touching_nothing(workdir):
    """Their data files still there: no restart at step 0 over them."""
    for step in (20, 40, 60):
        os.remove(workdir / "checkpoints" / f"ckpt-{step}.index")
    before = cli_runs.snapshot(workdir)

    result = run_cli(f"--workdir={workdir}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert cli_runs.error_lines(result) == [
        f"error: no checkpoint in {workdir}/checkpoints is readable (the newest, "
        f"{workdir}/checkpoints/ckpt-60: its index file ckpt-60.index is missing); move them away "
        "to start again from step 0, or use a new --workdir"]
    assert cli_runs.snapshot(workdir) == before


def test_the_data_of_a_save_killed_before_its_index_is_no_loss(workdir):
    """A save killed between moving its data into place and writing its index leaves the data of a
    step newer than every checkpoint, which the `checkpoint` index does not list: resumed past."""
    checkpoints = workdir / "checkpoints"
    shutil.copy(checkpoints / f"ckpt-60{DATA}", checkpoints / f"ckpt-80{DATA}")

    trainer = make_trainer(workdir, 80)

    assert trainer.run.checkpoints.latest_checkpoint == str(checkpoints / "ckpt-60")


# ----- A full disk -----

def test_a_full_disk_during_a_save_is_one_line_and_the_last_good_checkpoint_stays(
        workdir, monkeypatch, caplog):
    trainer = make_trainer(workdir, 80)
    checkpoints = trainer.run.checkpoints.directory

    def save_on_a_full_disk(checkpoint_number):
        """What TensorFlow leaves when the disk fills mid-save: a temp folder and an empty index."""
        os.mkdir(f"{checkpoints}/ckpt-{checkpoint_number}_temp")
        open(f"{checkpoints}/ckpt-{checkpoint_number}.index", "w").close()
        raise tf.errors.ResourceExhaustedError(None, None, (
            f"{checkpoints}/ckpt-{checkpoint_number}_temp/part-00000-of-00001.data-00000-of-00001"
            ".tempstate1760; No space left on device"))

    monkeypatch.setattr(trainer.run.checkpoints, "save", save_on_a_full_disk)
    with pytest.raises(UserError) as raised:
        trainer.train()

    assert str(raised.value) == (f"could not write checkpoint ckpt-80 in {checkpoints}: No space left "
                                 "on device; free space and run the same command to resume from ckpt-60")
    assert sorted(os.listdir(checkpoints)) == ["checkpoint"] + [
        f"ckpt-{step}{suffix}" for step in (20, 40, 60) for suffix in (DATA, ".index")]
    assert tf.train.latest_checkpoint(checkpoints) == f"{checkpoints}/ckpt-60"

    caplog.clear()
    resumed = make_trainer(workdir, 80)
    resumed.train()
    assert restored_from(caplog) == [f"{checkpoints}/ckpt-60"]
    assert saved_steps(workdir) == [40, 60, 80]


# ----- Through the command line: one line, and no flood of TensorFlow warnings after it -----

def run_cli(*args):
    return cli_runs.run("mixloop.train", f"--config={TINY_CONFIG}", *args)


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_one_line_with_nothing_after_it(workdir):
    result = run_cli(f"--workdir={workdir}", "--config.model.width=32")

    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: the checkpoint {workdir}/checkpoints/ckpt-60 does not match "
                                "this run's model"), result.stderr
    assert sum(line.startswith("error:") for line in lines) == 1
    assert "could not be found" not in result.stderr


@pytest.fixture
def tiny_disk(tmp_path):
    """A 300 KB tmpfs: room for two checkpoints of the tiny experiment, not three."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.slow
def test_a_really_full_disk_is_one_line_and_leaves_no_partial_checkpoint(tiny_disk):
    workdir = tiny_disk / "run"
    result = run_cli(f"--workdir={workdir}", "--config.train.num_steps=60")

    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: could not write checkpoint ckpt-60 in {workdir}/checkpoints: No space "
                      "left on device; free space and run the same command to resume from ckpt-40"], \
        result.stderr
    assert result.stderr.strip().splitlines()[-1] == errors[0]  # Nothing after it, no traceback.
    assert sorted(os.listdir(workdir / "checkpoints")) == ["checkpoint"] + [
        f"ckpt-{step}{suffix}" for step in (20, 40) for suffix in (DATA, ".index")]


def test_a_full_disk_before_the_start_says_to_free_space(tmp_path, monkeypatch):
    """A lock file that cannot be written for want of space: one line that names the workdir and
    both ways out, with no '(None)' for the path the error does not carry."""
    import errno

    from mixloop.runner import workdir as workdir_module

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(workdir_module.os, "open", full)
    with pytest.raises(UserError) as raised:
        with workdir_module.WorkdirLock(str(tmp_path / "run")):
            pass
    assert str(raised.value) == (f"cannot write to the workdir {tmp_path / 'run'}: No space left on "
                                 "device; free some space or choose another --workdir")


# ----- The workdir's lock and the probes' temporary folders -----


def no_space(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device", kwargs.get("prefix", "lock"))


def test_a_lock_a_full_disk_stops_half_written_is_removed(tmp_path, monkeypatch):
    """Created, but its owner not written: left there, the next run would call it stale."""
    from mixloop.runner import workdir as workdir_module

    real_fdopen = os.fdopen

    class FullFile:
        def __init__(self, fd, mode):
            self.file = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.file.close()

        def write(self, text):
            no_space()

    monkeypatch.setattr(workdir_module.os, "fdopen", FullFile)
    with pytest.raises(UserError, match="No space left on device"):
        with workdir_module.WorkdirLock(str(tmp_path)):
            pass
    assert not (tmp_path / ".lock").exists()


@pytest.mark.parametrize("failing", ["copy2", "replace"])
def test_a_changed_config_that_cannot_be_kept_or_renamed_leaves_the_files_as_they_were(
        tmp_path, monkeypatch, failing):
    """The disk fills at the copy of the earlier config.json, or at the rename of the new one: one
    line, and config.json as it was, with no copy or temporary file left."""
    from mixloop.runner import workdir as workdir_module

    config = tiny_experiment.get_config()
    workdir_module.write_config(str(tmp_path), config, 0)
    before = (tmp_path / "config.json").read_bytes()
    monkeypatch.setattr(workdir_module.shutil if failing == "copy2" else workdir_module.os,
                        failing, no_space)
    config.train.num_steps = 80
    with pytest.raises(workdir_module.UnusableWorkdir, match="No space left on device"):
        workdir_module.write_config(str(tmp_path), config, 40)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["config.json"]
    assert (tmp_path / "config.json").read_bytes() == before


def test_the_probes_temporary_folders_a_kill_left_are_removed_at_the_next_start(tmp_path):
    from mixloop.runner import workdir as workdir_module

    for name in (".compile-probe-abc123", ".precision-probe-xyz"):
        (tmp_path / name / "state").mkdir(parents=True)
        (tmp_path / name / "state" / "ckpt.data").write_bytes(b"\0" * 1000)
    (tmp_path / ".compile-probe-notes.txt").write_text("a file of the user's")  # Not a folder.
    (tmp_path / "checkpoints").mkdir()
    with workdir_module.WorkdirLock(str(tmp_path)):
        assert sorted(os.listdir(tmp_path)) == [".compile-probe-notes.txt", ".lock", "checkpoints"]


@pytest.mark.parametrize("prefix", [".compile-probe-", ".precision-probe-"])
def test_a_probe_folder_a_full_disk_refuses_is_one_line(tmp_path, monkeypatch, prefix):
    from mixloop.runner import workdir as workdir_module

    monkeypatch.setattr(workdir_module.tempfile, "TemporaryDirectory", no_space)
    with pytest.raises(UserError) as raised:
        workdir_module.scratch_folder(str(tmp_path), prefix)
    assert str(raised.value) == (f"cannot write to the workdir {tmp_path}: No space left on device "
                                 f"({prefix}); free some space or choose another --workdir")


@pytest.mark.parametrize("prefix, policy", [
    (".compile-probe-", "float32"),  # The compile probe alone.
    (".precision-probe-", "mixed_float16"),  # float32_layers and initial_scale "auto": probed first.
])
def test_a_full_disk_at_a_probe_is_one_line_and_leaves_no_lock(tmp_path, monkeypatch, prefix, policy):
    """The probe's folder cannot be made: the run stops in one line (it could save nothing either),
    where the precision probe used to log "not probed" and train on to its first checkpoint."""
    from mixloop.runner import compile_mode
    from mixloop.runner import workdir as workdir_module

    real = workdir_module.tempfile.TemporaryDirectory

    def no_space_for_the_probe(*args, **kwargs):  # The iterator's own temporary folder is elsewhere.
        return (no_space if kwargs.get("prefix") == prefix else real)(*args, **kwargs)

    monkeypatch.setattr(compile_mode, "MIN_PROBED_UPDATES", 0)
    monkeypatch.setattr(workdir_module.tempfile, "TemporaryDirectory", no_space_for_the_probe)
    config = tiny_experiment.get_config()
    config.precision.policy = policy
    with pytest.raises(UserError, match=rf"^cannot write to the workdir .*: No space left on device "
                                        rf"\({re.escape(prefix)}\); free some space"):
        tiny_experiment.TinyTrainer(config, str(tmp_path)).train()
    assert not (tmp_path / ".lock").exists() and not (tmp_path / "checkpoints").exists()


def test_a_full_disk_at_the_compile_probes_state_copy_is_one_line(tmp_path, monkeypatch):
    """Not "could not time it without XLA" and a run that fails at its first checkpoint."""
    from mixloop.runner import compile_mode

    def full(self, path):
        raise tf.errors.ResourceExhaustedError(None, None, f"{path}.index; No space left on device")

    monkeypatch.setattr(compile_mode, "MIN_PROBED_UPDATES", 0)
    monkeypatch.setattr(Run, "save_state", full)
    config = tiny_experiment.get_config()
    config.precision.policy = "float32"  # The compile probe alone.
    with pytest.raises(UserError, match=r"^cannot write to the workdir .*: the compile-mode probe "
                                        r"could not copy the state \(No space left on device\)"):
        tiny_experiment.TinyTrainer(config, str(tmp_path)).train()
    assert not (tmp_path / ".lock").exists() and not (tmp_path / "checkpoints").exists()


def test_a_full_disk_at_the_precision_probes_position_save_is_one_line(tmp_path, monkeypatch):
    """The probe's folder is made (one inode left), its data position cannot be written: not a
    'not probed' warning and a run that fails later (TensorBoard's events file, a checkpoint)."""
    real_write = tf.train.Checkpoint.write

    def full(self, file_prefix, *args, **kwargs):
        if ".precision-probe-" in str(file_prefix):
            raise tf.errors.ResourceExhaustedError(None, None,
                                                   f"{file_prefix}.index; No space left on device")
        return real_write(self, file_prefix, *args, **kwargs)

    monkeypatch.setattr(tf.train.Checkpoint, "write", full)
    config = tiny_experiment.get_config()  # mixed_float16: the precision probe runs first.
    with pytest.raises(UserError, match=r"^cannot write to the workdir .*No space left on device"):
        tiny_experiment.TinyTrainer(config, str(tmp_path)).train()
    assert not (tmp_path / ".lock").exists() and not (tmp_path / "checkpoints").exists()


def test_a_full_disk_at_the_tensorboard_events_file_is_one_line(tmp_path, monkeypatch):
    def full(logdir, *args, **kwargs):
        raise tf.errors.ResourceExhaustedError(None, None,
                                               f"{logdir}/events.out.tfevents; No space left on device")

    monkeypatch.setattr(tf.summary, "create_file_writer", full)
    config = tiny_experiment.get_config()
    config.precision.policy, config.jit_compile = "float32", False  # No probe before it.
    with pytest.raises(UserError, match=r"^cannot write to the workdir .*No space left on device"):
        tiny_experiment.TinyTrainer(config, str(tmp_path)).train()
    assert not (tmp_path / ".lock").exists()
