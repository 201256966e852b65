"""`python -m mixloop.diagnose` and `python -m mixloop.benchmark` as commands: Ctrl-C or SIGTERM
mid-work is one line and writes nothing, and --output is checked before the work, not after it."""

import os
import signal

import pytest

import slow_start_experiment
from cli_runs import TINY_CONFIG, error_lines, interrupted, run, without_root_file_access

pytestmark = pytest.mark.slow


def tool_args(command, tmp_path):
    """The command's flags for a short run on the tiny experiment (the doctor's fresh workdir)."""
    return [f"--config={TINY_CONFIG}",
            "--quick" if command == "mixloop.benchmark" else f"--workdir={tmp_path / 'run'}"]


@pytest.mark.parametrize("command, signal_number, after, when", [
    ("mixloop.benchmark", signal.SIGINT, "Timing the compile modes", "before the benchmark finished"),
    # The doctor on a model whose build waits: a diagnosis of the tiny model can end before a
    # signal sent by a busy test process arrives.
    ("mixloop.diagnose", signal.SIGTERM, slow_start_experiment.BUILDING, "before the diagnosis finished"),
])
def test_an_interrupted_tool_is_one_line_and_writes_nothing(tmp_path, command, signal_number,
                                                            after, when):
    output = tmp_path / "output"
    args = tool_args(command, tmp_path)
    if command == "mixloop.diagnose":
        args[0] = f"--config={slow_start_experiment.__file__}"
    returncode, stderr = interrupted(command, *args, f"--output={output}",
                                     signal_number=signal_number, after=after)

    assert returncode == 128 + signal_number
    assert "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
        f"error: interrupted by {signal.Signals(signal_number).name} {when}; nothing was written"]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command, output, message", [
    ("mixloop.benchmark", "{tmp}/speed.json",
     "--output={tmp}/speed.json exists; name a new place for the file it writes, or move it away"),
    ("mixloop.benchmark", "{tmp}/speed.json/new.json",
     "--output={tmp}/speed.json/new.json is under {tmp}/speed.json, which is a file, not a folder; "
     "choose another --output"),
    ("mixloop.diagnose", "{tmp}/speed.json",
     "--output={tmp}/speed.json exists; name a new place for the folder of files it writes, or "
     "move it away"),
], ids=["benchmark: an existing file", "benchmark: under a file", "doctor: a file"])
def test_an_output_that_cannot_be_written_is_refused_before_the_work(tmp_path, command, output,
                                                                     message):
    (tmp_path / "speed.json").write_text("{}\n")  # An earlier benchmark's results.
    result = run(command, *tool_args(command, tmp_path), f"--output={output.format(tmp=tmp_path)}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == ["error: " + message.format(tmp=tmp_path)], result.stderr
    assert os.listdir(tmp_path) == ["speed.json"]
    assert (tmp_path / "speed.json").read_text() == "{}\n"


def test_an_output_in_a_read_only_folder_is_refused_before_the_work(tmp_path):
    prefix = without_root_file_access()
    if prefix is None:
        pytest.skip("runs as root and setpriv cannot drop the file-permission capabilities")
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    result = run("mixloop.benchmark", *tool_args("mixloop.benchmark", tmp_path),
                 f"--output={folder}/speed.json", prefix=prefix)

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == [f"error: cannot write --output={folder}/speed.json: Permission "
                                   f"denied ({folder}); choose a place you can write to"]
    assert os.listdir(folder) == []
