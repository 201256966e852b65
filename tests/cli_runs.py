"""Running mixloop's commands as a user does, for the end-to-end tests: the command line and its
environment, the `error:` lines it printed, what a workdir holds, and a signal sent mid-way."""

import glob
import os
import shutil
import signal
import subprocess
import sys

import command_server

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
FIXTURES_DIR = os.path.join(TESTS_DIR, "fixtures")  # The fixture experiments.
REPO = os.path.dirname(TESTS_DIR)
TINY_CONFIG = os.path.join(FIXTURES_DIR, "tiny_experiment.py")


FRESH_PROCESSES = os.environ.get("MIXLOOP_TESTS_FRESH_PROCESSES") == "1"


def command_line(command, *args, prefix=(), env=None):
    """The command line and environment of `python -m <command> args`, run via `prefix`, with the
    tests' experiments importable and `env` added."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}),
               PYTHONPATH=os.pathsep.join([TESTS_DIR, FIXTURES_DIR, os.environ.get("PYTHONPATH", "")]))
    return [*prefix, sys.executable, "-m", command, *args], env


def start(command, *args, cwd=None, env=None, stdout=None, stderr=subprocess.PIPE, fresh=False):
    """Starts `python -m <command> args` (text streams, stdin empty): forked from the fork server,
    which has TensorFlow imported already, unless `fresh` or MIXLOOP_TESTS_FRESH_PROCESSES=1 asks for
    a new interpreter (what a test of the import itself needs)."""
    line, env = command_line(command, *args, env=env)
    if fresh or FRESH_PROCESSES:
        return subprocess.Popen(line, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=stderr, text=True)
    return command_server.ServedProcess([command, *args], env, str(cwd or os.getcwd()), stdout, stderr)


def run(command, *args, cwd=None, prefix=(), env=None, fresh=False):
    """Runs `python -m <command> args` to its end (via `prefix`: in a fresh interpreter); its exit
    code, stdout and stderr."""
    if prefix:
        line, env = command_line(command, *args, prefix=prefix, env=env)
        return subprocess.run(line, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    process = start(command, *args, cwd=cwd, env=env, stdout=subprocess.PIPE, fresh=fresh)
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def error_lines(result):
    """The `error:` lines a run printed on stderr."""
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def snapshot(directory):
    """Every file under `directory` with its size and modification time."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            found[os.path.join(root, name)] = (stat.st_size, stat.st_mtime_ns)
    return found


def checkpoint_steps(workdir):
    """The steps of the checkpoints in `workdir` with an index file, in order."""
    return sorted(int(path.rsplit("-", 1)[1].split(".")[0])
                  for path in glob.glob(os.path.join(workdir, "checkpoints", "ckpt-*.index")))


def interrupted(command, *args, signal_number=signal.SIGINT, after=""):
    """Runs `python -m <command> args`, sends it `signal_number` once a line of its stderr contains
    `after`, and returns its exit code and the stderr that followed."""
    process = start(command, *args)
    try:
        while (output := process.stderr.readline()) and after not in output:
            pass
        process.send_signal(signal_number)
        stderr = process.communicate(timeout=120)[1]
        return process.returncode, stderr
    finally:
        process.kill()


def without_root_file_access():
    """A prefix that runs a command as root without its power to bypass file permissions (what a
    chmod means to everyone else), or None when that cannot be had."""
    if os.geteuid() != 0:
        return ()
    prefix = ("setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--")
    if shutil.which("setpriv") and subprocess.run([*prefix, "true"]).returncode == 0:
        return prefix
    return None
