"""Behaviour kept bit for bit: the final checkpoint of a fixed set of short CLI runs, recorded and compared.

A change that should not move a single bit of training (a refactor) is checked by recording these runs
before it and after it, each in a fresh workdir, and comparing every checkpointed variable:

    python tests/bit_identity.py record /tmp/before        # on the commit before the change
    python tests/bit_identity.py record /tmp/after         # on the change
    python tests/bit_identity.py compare /tmp/before /tmp/after

`record` also accepts run names to record only those. Each run fixes its compile mode and turns the
compile-mode cache off, so nothing it records depends on a timing. The 2-replica run starts the
command inside a Python that first splits the CPU into two logical devices (as tests/conftest.py
does), then calls `python -m mixloop.train`'s own `main`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
FIXTURES_DIR = os.path.join(TESTS_DIR, "fixtures")
ROOT = os.path.dirname(TESTS_DIR)
CHARLM = os.path.join(ROOT, "experiments", "charlm.py") + ":quick"
TINY = os.path.join(FIXTURES_DIR, "tiny_experiment.py")
LIGHTER = ["--config.precision.policy=mixed_bfloat16", "--config.precision.master_weights=bfloat16",
           "--config.optimizer.state_dtype=int8", "--config.train.accumulation_dtype=bfloat16",
           "--config.train.recompute=block0_mlp.*|block0_ln2"]

# Name -> the command's arguments after `python -m mixloop.train` (the workdir added).
RUNS = {
    "charlm_float32_xla": [f"--config={CHARLM}", "--config.precision.policy=float32",
                           "--config.jit_compile=True"],
    "charlm_float16_graph": [f"--config={CHARLM}", "--config.precision.policy=mixed_float16",
                             "--config.jit_compile=False"],
    "charlm_bfloat16_elementwise": [f"--config={CHARLM}", "--config.precision.policy=mixed_bfloat16",
                                    "--config.jit_compile=elementwise"],
    "charlm_bfloat16_xla_k4": [f"--config={CHARLM}", "--config.precision.policy=mixed_bfloat16",
                               "--config.jit_compile=True", "--config.train.accumulation_steps=4"],
    "digits": [f"--config={os.path.join(ROOT, 'experiments', 'digits.py')}:quick",
               "--config.jit_compile=False"],
    "gan_digits": [f"--config={os.path.join(ROOT, 'experiments', 'gan_digits.py')}:quick",
                   "--config.jit_compile=False", "--config.train.num_steps=60",
                   "--config.eval.every_steps=30", "--config.checkpoint.every_steps=30"],
    "simclr_digits": [f"--config={os.path.join(ROOT, 'experiments', 'simclr_digits.py')}:quick",
                      "--config.jit_compile=False"],
    "byol_digits": [f"--config={os.path.join(ROOT, 'experiments', 'byol_digits.py')}:quick",
                    "--config.jit_compile=False"],
    "float8_mlp": [f"--config={os.path.join(FIXTURES_DIR, 'float8_experiment.py')}",
                   "--config.jit_compile=False", "--config.train.num_steps=30"],
    "lighter_graph": [f"--config={CHARLM}", *LIGHTER, "--config.jit_compile=False"],
    "lighter_xla": [f"--config={CHARLM}", *LIGHTER, "--config.jit_compile=True"],
    "float16_retries": [f"--config={TINY}", "--config.precision.float32_layers=",
                        "--config.precision.initial_scale=1e15", "--config.precision.max_scale=1e15",
                        "--config.precision.growth_interval=5", "--config.jit_compile=False"],
    "float16_retries_xla": [f"--config={TINY}", "--config.precision.float32_layers=",
                            "--config.precision.initial_scale=1e15", "--config.precision.max_scale=1e15",
                            "--config.precision.growth_interval=5", "--config.jit_compile=True"],
    "mirrored_2_replicas": [f"--config={TINY}", "--config.distribution=mirrored",
                            "--config.jit_compile=False", "--config.train.ema_decay=0.9"],
}
TWO_DEVICES = {"mirrored_2_replicas"}

# Run in the child for TWO_DEVICES: two logical CPUs, then the command's own main.
_TWO_DEVICE_MAIN = """
import sys
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
from mixloop import cli, train
sys.argv = ["mixloop.train", *sys.argv[1:]]
cli.run(train.main)
"""


def record(output: str, names: list[str]) -> None:
    """Runs each named run in `output/work/<name>` and writes its final checkpoint's variables to
    `output/<name>.npz`; stops at the first run that fails, with its stderr's tail."""
    env = dict(os.environ, MIXLOOP_CACHE_DIR="off", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([FIXTURES_DIR, ROOT, os.environ.get("PYTHONPATH", "")]))
    for name in names:
        workdir = os.path.join(output, "work", name)
        if os.path.exists(workdir):
            subprocess.run(["rm", "-rf", workdir], check=True)
        args = [*RUNS[name], f"--workdir={workdir}"]
        line = ([sys.executable, "-c", _TWO_DEVICE_MAIN, *args] if name in TWO_DEVICES
                else [sys.executable, "-m", "mixloop.train", *args])
        started = time.perf_counter()
        result = subprocess.run(line, env=env, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        with open(os.path.join(output, f"{name}.log"), "w") as log:
            log.write(result.stderr)
        if result.returncode:
            sys.exit(f"{name}: exit {result.returncode} after {seconds:.0f} s:\n"
                     + "\n".join(result.stderr.splitlines()[-15:]))
        variables = checkpoint_variables(os.path.join(workdir, "checkpoints"))
        np.savez(os.path.join(output, f"{name}.npz"), **variables)
        print(f"{name}: {len(variables)} variables, {seconds:.0f} s", flush=True)


def checkpoint_variables(directory: str) -> dict[str, np.ndarray]:
    """Every numeric tensor of the newest checkpoint in `directory`, by checkpoint key (the object
    graph and the data iterator's serialized state left out: they are not training's numbers)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(directory))
    variables = {}
    for key in sorted(reader.get_variable_to_shape_map()):
        if key.startswith("_CHECKPOINTABLE_OBJECT_GRAPH") or "train_iterator" in key:
            continue
        value = reader.get_tensor(key)
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" or np.isscalar(value):
            variables[key] = np.asarray(value)
        elif hasattr(value, "dtype") and value.dtype.name == "bfloat16":
            variables[key] = np.asarray(value).view(np.uint16)
    return variables


def compare(before: str, after: str) -> bool:
    """Prints, per run recorded in both folders, whether every variable is bit-identical (and if
    not, how many differ and by how much); returns whether all are."""
    all_same = True
    for name in RUNS:
        paths = [os.path.join(folder, f"{name}.npz") for folder in (before, after)]
        if not all(os.path.exists(path) for path in paths):
            print(f"{name}: not recorded in both")
            all_same = False
            continue
        a, b = (dict(np.load(path)) for path in paths)
        if set(a) != set(b):
            print(f"{name}: different keys: only before {sorted(set(a) - set(b))[:5]}, "
                  f"only after {sorted(set(b) - set(a))[:5]}")
            all_same = False
            continue
        differing = [key for key in a if a[key].shape != b[key].shape
                     or a[key].tobytes() != b[key].tobytes()]
        if not differing:
            print(f"{name}: {len(a)} variables bit-identical")
            continue
        all_same = False
        worst = max(differing, key=lambda key: _relative_difference(a[key], b[key]))
        print(f"{name}: {len(differing)} of {len(a)} variables differ; largest relative "
              f"difference {_relative_difference(a[worst], b[worst]):.3g} in {worst}")
    return all_same


def _relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30)) if a.size else 0.0


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "record":
        names = argv[2:] or list(RUNS)
        unknown = [name for name in names if name not in RUNS]
        if unknown:
            sys.exit(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
        os.makedirs(argv[1], exist_ok=True)
        record(argv[1], names)
    elif len(argv) == 3 and argv[0] == "compare":
        sys.exit(0 if compare(argv[1], argv[2]) else 1)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
