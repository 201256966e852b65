"""The shipped experiments run end to end through the CLI in their quick variants."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def run_cli(*args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "mixloop.train", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)


def last_eval(stderr):
    """{metric: value} from the last 'eval at step N: name value ...' line."""
    line = [l for l in stderr.splitlines() if "eval at step" in l][-1]
    words = line.split(": ", 2)[-1].split()
    return dict(zip(words[::2], map(float, words[1::2])))


def test_charlm_quick(tmp_path):
    result = run_cli("--config=experiments/charlm.py:quick", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = last_eval(result.stderr)
    assert metrics["bits_per_char"] == pytest.approx(metrics["loss"] / 0.6931472, rel=1e-4)
    assert "unigram" in result.stderr
    assert (tmp_path / "model.keras").exists()


def test_digits_quick(tmp_path):
    result = run_cli("--config=experiments/digits.py:quick", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert 0.0 <= last_eval(result.stderr)["accuracy"] <= 1.0


def test_unknown_variant_is_one_line(tmp_path):
    result = run_cli("--config=experiments/charlm.py:bogus", f"--workdir={tmp_path}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "ValueError: unknown charlm config variant 'bogus'; expected 'quick' or none")
    assert not os.listdir(tmp_path)
