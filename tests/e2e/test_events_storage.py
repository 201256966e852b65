"""The TensorBoard events files, and the doctor's --output, on a file system with no inode or no
space left: one `error:` line naming the folder and the fix, exit 2, nothing in the workdir lost.
The file systems are small tmpfs mounts, really full (root only; skipped elsewhere)."""

import errno
import gc
import itertools
import os
import subprocess

import cli_runs
import pytest
import tensorflow as tf
import tiny_experiment

from cli_runs import TINY_CONFIG

import mixloop
from mixloop.errors import UserError
from mixloop.runner import reporting


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(options): a tmpfs mounted with `options` in `tmp_path`, unmounted at the end."""
    mounted = []

    def mount(options):
        point = tmp_path / f"disk-{len(mounted)}"
        point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                                capture_output=True)
        if result.returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(point)
        return point

    yield mount
    gc.collect()  # A failed run's writers, held by its traceback, close their events files.
    for point in mounted:
        subprocess.run(["umount", "--lazy", str(point)], check=True)


def fill(directory):
    """Writes into `directory/filler` until its file system has no byte left."""
    with open(os.path.join(directory, "filler"), "wb") as f:
        for _ in itertools.count():
            try:
                f.write(b"\0" * 65536)
                f.flush()
            except OSError as error:
                assert error.errno == errno.ENOSPC
                return


FLOAT32_GRAPH = ("--config.precision.policy=float32", "--config.jit_compile=False")  # No probe.


def make_trainer(workdir, num_steps):
    config = tiny_experiment.get_config()
    config.precision.policy = "float32"  # No probe: the summaries alone.
    config.jit_compile = False
    config.train.num_steps = num_steps
    return tiny_experiment.TinyTrainer(config, str(workdir))


@pytest.mark.slow
def test_one_inode_left_for_the_events_file_is_one_line(mount_tmpfs):
    """Five inodes: the root, the workdir, config.json and the lock take four; train/ the last, so
    the events file in it finds none (the campaign's case: a ResourceExhaustedError traceback)."""
    workdir = mount_tmpfs("size=5m,nr_inodes=5") / "run"
    result = cli_runs.run("mixloop.train", f"--config={TINY_CONFIG}", f"--workdir={workdir}",
                          *FLOAT32_GRAPH)

    assert result.returncode == 2, result.stderr
    assert cli_runs.error_lines(result) == [
        f"error: cannot write to the workdir {workdir}: No space left on device ({workdir}/train); "
        "its file system has no free inodes (df -i): remove some files or choose another --workdir"]
    assert result.stderr.strip().splitlines()[-1].startswith("error:")  # No traceback after it.
    assert sorted(os.listdir(workdir)) == ["config.json", "train"]  # The lock released.


@pytest.mark.slow
def test_a_changed_config_on_a_full_disk_is_one_line_and_config_json_stays(mount_tmpfs):
    """A resume with a changed config where one page is left, which the lock takes: the new
    config.json cannot be written (the campaign's case: a traceback, and the old config.json moved
    away with no new one in its place)."""
    disk = mount_tmpfs("size=5m")
    workdir = disk / "run"
    args = (f"--config={TINY_CONFIG}", f"--workdir={workdir}", *FLOAT32_GRAPH)
    assert cli_runs.run("mixloop.train", *args, "--config.train.num_steps=20").returncode == 0
    before = cli_runs.snapshot(workdir)
    fill(disk)
    os.truncate(disk / "filler", os.path.getsize(disk / "filler") - os.statvfs(disk).f_bsize)

    result = cli_runs.run("mixloop.train", *args, "--config.train.num_steps=40")
    assert result.returncode == 2, result.stderr
    assert cli_runs.error_lines(result) == [
        f"error: cannot write to the workdir {workdir}: No space left on device "
        f"({workdir}/config.json); free some space or choose another --workdir"]
    assert cli_runs.snapshot(workdir) == before  # config.json as it was; no copy, no .tmp, no lock.

    os.remove(disk / "filler")
    assert cli_runs.run("mixloop.train", *args, "--config.train.num_steps=40").returncode == 0
    assert sorted(path.name for path in workdir.glob("config*.json")) == [
        "config-step-20.json", "config.json"]


@pytest.mark.slow
@pytest.mark.parametrize("inodes, jit_compile, written", [
    (3, "False", "config.json"),  # The root, the workdir and the lock: config.json finds none.
    (4, "auto", "config.json"),  # config.json written; the compile mode's record finds none.
])
def test_no_inode_for_the_config_record_is_one_line(mount_tmpfs, inodes, jit_compile, written):
    workdir = mount_tmpfs(f"size=5m,nr_inodes={inodes}") / "run"
    result = cli_runs.run("mixloop.train", f"--config={TINY_CONFIG}", f"--workdir={workdir}",
                          "--config.precision.policy=float32", f"--config.jit_compile={jit_compile}")
    assert result.returncode == 2, result.stderr
    assert cli_runs.error_lines(result) == [
        f"error: cannot write to the workdir {workdir}: No space left on device "
        f"({workdir}/{written}); its file system has no free inodes (df -i): remove some files or "
        "choose another --workdir"]
    assert result.stderr.strip().splitlines()[-1].startswith("error:")  # No traceback after it.
    assert sorted(os.listdir(workdir)) == ([] if inodes == 3 else ["config.json"])  # Lock released.


def test_a_disk_full_at_a_summary_write_is_one_line_and_the_checkpoints_stay(mount_tmpfs,
                                                                             monkeypatch):
    """The disk fills while the resumed run trains: its progress line's summaries (more than the
    page its events file has left) stop it in one line, ckpt-20 untouched; with space freed, the
    same run resumes from it."""
    disk = mount_tmpfs("size=2m")
    workdir = disk / "run"
    make_trainer(workdir, 20).train()
    saved = cli_runs.snapshot(workdir / "checkpoints")
    real_write = reporting.MetricWriter.write

    def write_on_a_full_disk(writer, split, step, scalars):
        fill(disk)
        real_write(writer, split, step, {**scalars, **{f"more/{i}": 0.0 for i in range(500)}})

    monkeypatch.setattr(reporting.MetricWriter, "write", write_on_a_full_disk)
    with pytest.raises(UserError) as raised:
        make_trainer(workdir, 40).train()
    assert str(raised.value) == (f"cannot write to the workdir {workdir}: No space left on device "
                                 f"({workdir}/train); free some space or choose another --workdir")
    assert cli_runs.snapshot(workdir / "checkpoints") == saved
    assert not (workdir / ".lock").exists()

    monkeypatch.setattr(reporting.MetricWriter, "write", real_write)
    os.remove(disk / "filler")
    make_trainer(workdir, 40).train()
    assert cli_runs.checkpoint_steps(workdir) == [20, 40]


class SummarizingTrainer(tiny_experiment.TinyTrainer):
    """Its action writes 500 summaries of its own every 10 updates, after filling `self.disk`."""

    disk = None

    def actions(self):
        def summarize(step):
            fill(self.disk)
            for i in range(500):  # More than the page the events file has left.
                tf.summary.scalar(f"sample/{i}", 0.0, step=step)

        return [mixloop.Action(summarize, every_steps=10)]


def test_an_actions_own_summaries_on_a_full_disk_are_the_workdirs_line_not_the_actions(
        mount_tmpfs):
    disk = mount_tmpfs("size=2m")
    workdir = disk / "run"
    config = make_trainer(workdir, 20).config
    trainer = SummarizingTrainer(config, str(workdir))
    trainer.disk = disk
    with pytest.raises(UserError) as raised:
        trainer.train()
    assert str(raised.value) == (f"cannot write to the workdir {workdir}: No space left on device "
                                 f"({workdir}/train); free some space or choose another --workdir")
    assert not (workdir / ".lock").exists()


@pytest.mark.slow
def test_the_doctors_output_on_a_full_file_system_is_one_line(mount_tmpfs, tmp_path):
    """Three inodes: the root, the output folder and report.json; the events file finds none."""
    output = mount_tmpfs("size=5m,nr_inodes=3") / "doctor"
    result = cli_runs.run("mixloop.diagnose", f"--config={TINY_CONFIG}",
                          f"--workdir={tmp_path / 'run'}", f"--output={output}")

    assert result.returncode == 2, result.stderr
    assert cli_runs.error_lines(result) == [
        f"error: cannot write --output={output}: No space left on device; its file system has no "
        "free inodes (df -i): remove some files or choose another --output"]
    assert result.stderr.strip().splitlines()[-1].startswith("error:")
