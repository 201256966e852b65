"""Which compile mode the train step runs in: XLA or TensorFlow's graph kernels, configured or measured.

`config.jit_compile` is True (XLA), False (graph mode: TensorFlow's own kernels, oneDNN on a CPU) or
"auto" (the default). Neither mode wins everywhere: XLA fuses the many small ops of a step, which
pays on GPUs and for small models, while on a CPU with AVX512_BF16 only TensorFlow's own kernels
multiply bfloat16 matrices at the hardware's speed (XLA on a CPU does not use those instructions)
and TensorFlow's float16 convolutions on a CPU are slow. So "auto" measures::

    several replicas: without XLA, no probe (the step calls `strategy.run`, which XLA does not
        compile here)
    config.json records an earlier choice for this workdir, measured for the same policy, batch,
        accumulation and model: that one, no probe (a resume keeps it)
    fewer than MIN_PROBED_UPDATES updates left, `deterministic=True`, or a train iterator a
        checkpoint cannot hold (a Python generator): with XLA, no probe (compiling and timing both
        modes would cost a large share of so short a run; a deterministic run must not depend on
        a timing; the data position could not be put back; XLA was the default before "auto")
    otherwise, the probe, before the first real update:
        save everything a checkpoint holds (weights, optimizer, scales, counters, the data position)
            to a temporary folder in the workdir
        per mode: trace and compile the loop (one update), then time loops of a few updates each,
            the modes interleaved, on the run's own batches
        restore it all: the run's numbers and data order are those of a run without the probe (a
            second iterator would not do: over a dataset that reshuffles, it moves the shuffle seed)
        keep the faster mode's compiled loop; log both speeds and the probe's cost; record the
            choice, and what it was measured for, in config.json's `resolved` record
    a mode that fails in the probe: XLA without a kernel for an op, or out of memory: the other
        mode; any other error (of the data, say): that mode, so the run meets it and reports it
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Any, Optional

import tensorflow as tf
from absl import logging

from mixloop.config import ConfigError
from mixloop.runner import controller, workdir

KEY = "jit_compile"  # Its config key, and its key in config.json's `resolved` record,
MEASURED_FOR_KEY = "jit_compile_measured_for"  # beside the settings it was measured for.
MIN_PROBED_UPDATES = 250  # Fewer updates left than this: XLA, unprobed (the probe costs seconds).
PROBE_ROUNDS = 3  # Timed loops per mode, interleaved; the median counts.
PROBE_SECONDS = 0.3  # Each timed loop runs about this long (more updates for a fast step)...
MAX_PROBE_UPDATES = 20  # ...but no more updates than this.


def describe(jit_compile: bool) -> str:
    """"with XLA" or "without XLA", as the log lines say it."""
    return "with XLA" if jit_compile else "without XLA"


def configured(jit_compile: Any, num_replicas: int) -> tuple[Optional[bool], str]:
    """(the mode `config.jit_compile` fixes, or None when the probe must decide; why).

    Raises:
      ConfigError: for jit_compile=True with more than one replica.
    """
    if jit_compile is True and num_replicas > 1:
        raise ConfigError("config.jit_compile=True is not supported with more than one replica yet; "
                          "set it to False or 'auto'")
    if isinstance(jit_compile, bool):
        return jit_compile, f"config.jit_compile={jit_compile}"
    if num_replicas > 1:
        return False, f"jit_compile=auto: {num_replicas} replicas, which XLA does not compile here"
    return None, "jit_compile=auto: measured before the first update"


def choose(trainer) -> bool:
    """Sets `trainer`'s compile mode when `config.jit_compile` is "auto" and nothing decided it yet
    (the module docstring), logging one line with the evidence; returns whether it compiled the
    loop in the chosen mode (the probe did)."""
    if trainer.jit_compile is not None:
        return False
    measured_for = _measured_for(trainer.config)
    resolved = workdir.read_resolved(trainer.workdir)
    recorded = resolved.get(KEY) if isinstance(resolved, dict) else None
    if isinstance(recorded, bool) and resolved.get(MEASURED_FOR_KEY) == measured_for:
        trainer.set_jit_compile(recorded)
        logging.info("Train step %s: jit_compile=auto, as config.json records for this workdir",
                     describe(recorded))
        return False
    left = trainer.config.train.num_steps - int(trainer.global_step.numpy())
    unprobed = (f"a run of {left} updates (under {MIN_PROBED_UPDATES})" if left < MIN_PROBED_UPDATES
                else "a deterministic run (config.deterministic)" if trainer.config.deterministic
                else None if trainer.iterator_in_checkpoint
                else "a run whose data position a checkpoint cannot hold")
    if unprobed:
        trainer.set_jit_compile(True)
        logging.info("Train step with XLA: jit_compile=auto does not measure %s; "
                     "--config.jit_compile=False runs it without XLA", unprobed)
        return False
    try:
        speeds, probe_seconds = measure(trainer)
    except tf.errors.OpError as error:
        failed = trainer.jit_compile
        chosen = (not failed if isinstance(error, (tf.errors.UnimplementedError,
                                                   tf.errors.ResourceExhaustedError)) else failed)
        trainer.set_jit_compile(chosen)
        logging.warning("Train step %s: jit_compile=auto could not time it %s: %s", describe(chosen),
                        describe(failed), controller.op_error_summary(error))
        return False
    chosen = speeds[True] > speeds[False]
    trainer.set_jit_compile(chosen)
    logging.info("Train step %s: jit_compile=auto measured %.1f examples/s %s vs %.1f %s (probe: "
                 "%.1f s, both modes compiled, state restored)", describe(chosen), speeds[chosen],
                 describe(chosen), speeds[not chosen], describe(not chosen), probe_seconds)
    if trainer.is_chief:
        workdir.record_resolved(trainer.workdir, {KEY: chosen, MEASURED_FOR_KEY: measured_for})
    return True


def _measured_for(config: Any) -> dict[str, Any]:
    """The settings a compile mode's speed depends on: the policy, the batch, the model."""
    return {"precision.policy": config.precision.policy, "train.batch_size": config.train.batch_size,
            "train.accumulation_steps": config.train.accumulation_steps,
            "model": json.loads(json.dumps(config.model.to_dict(), default=str))}


def measure(trainer) -> tuple[dict[bool, float], float]:
    """The probe: ({XLA: examples/s, graph: examples/s}, its seconds), timed from the trainer's
    current state, which it leaves as it was (the benchmark reports it too)."""
    started = time.perf_counter()
    with workdir.scratch_folder(trainer.workdir, ".compile-probe-") as directory:
        saved = trainer.save_state(os.path.join(directory, "state"))
        try:
            seconds = {}
            for mode in (True, False):
                trainer.set_jit_compile(mode)
                trainer.train_loop(1)  # Traces and compiles.
                seconds[mode] = seconds_of_loop(trainer, 1)
            # Per mode, about PROBE_SECONDS a loop: a mode 30x slower is timed on fewer updates.
            num_updates = {mode: max(1, min(MAX_PROBE_UPDATES,
                                            math.ceil(PROBE_SECONDS / max(seconds[mode], 1e-9))))
                           for mode in seconds}
            rounds = {True: [], False: []}
            for _ in range(PROBE_ROUNDS):
                for mode in (True, False):
                    trainer.set_jit_compile(mode)
                    before = int(trainer.global_step.numpy())
                    seconds_taken = seconds_of_loop(trainer, num_updates[mode])
                    # A loop the guard ends early (a divergence) made fewer updates.
                    done = max(1, int(trainer.global_step.numpy()) - before)
                    rounds[mode].append(seconds_taken / done)
        finally:
            trainer.restore_state(saved)
    batch_size = trainer.config.train.batch_size
    speeds = {mode: batch_size / statistics.median(values) for mode, values in rounds.items()}
    return speeds, time.perf_counter() - started


def seconds_of_loop(trainer, num_updates: int) -> float:
    """Seconds `num_updates` updates of the trainer's compiled loop take, read back to the host (the
    probe's one measurement: tests pin it)."""
    started = time.perf_counter()
    trainer.train_loop(num_updates)
    return time.perf_counter() - started
