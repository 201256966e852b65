"""Which compile mode the train step runs in: XLA or TensorFlow's graph kernels, configured or measured.

`config.jit_compile` is True (XLA), False (graph mode: TensorFlow's own kernels, oneDNN on a CPU) or
"auto" (the default). Neither mode wins everywhere: XLA fuses the many small ops of a step, which
pays on GPUs and for small models, while on a CPU with AVX512_BF16 only TensorFlow's own kernels
multiply bfloat16 matrices at the hardware's speed (XLA on a CPU does not use those instructions)
and TensorFlow's float16 convolutions on a CPU are slow. So "auto" measures::

    several replicas: without XLA, no probe (the step calls `strategy.run`, which XLA does not
        compile here)
    config.json records an earlier choice for this workdir: that one, no probe (a resume keeps it)
    fewer than MIN_PROBED_UPDATES updates left, or a train iterator a checkpoint cannot hold (a
        Python generator): with XLA, no probe (compiling and timing both modes would cost a large
        share of so short a run; the data position could not be put back; XLA was the default
        before "auto")
    otherwise, the probe, before the first real update:
        save everything a checkpoint holds (weights, optimizer, scales, counters, the data position)
            to a temporary folder
        per mode: trace and compile the loop (one update), then time loops of a few updates each,
            the modes interleaved, on the run's own batches
        restore it all: the run's numbers and data order are those of a run without the probe (a
            second iterator would not do: over a dataset that reshuffles, it moves the shuffle seed)
        keep the faster mode's compiled loop; log both speeds and the probe's cost; record the
            choice in config.json's `resolved` record
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from typing import Any, Optional

import tensorflow as tf
from absl import logging

from mixloop.config import ConfigError
from mixloop.runner import controller, workdir

KEY = "jit_compile"  # Its config key, and its key in config.json's `resolved` record.
MIN_PROBED_UPDATES = 250  # Fewer updates left than this: XLA, unprobed (the probe costs seconds).
PROBE_ROUNDS = 3  # Timed loops per mode, interleaved; the median counts.
PROBE_SECONDS = 0.3  # Each timed loop runs about this long (more updates for a fast step)...
MAX_PROBE_UPDATES = 20  # ...but no more updates than this.


def describe(jit_compile: bool) -> str:
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


def choose(trainer) -> None:
    """Sets `trainer`'s compile mode when `config.jit_compile` is "auto" and nothing decided it yet
    (the module docstring), logging one line with the evidence."""
    if trainer.jit_compile is not None:
        return
    recorded = workdir.read_resolved(trainer.workdir).get(KEY)
    left = trainer.config.train.num_steps - int(trainer.global_step.numpy())
    if isinstance(recorded, bool):
        trainer.set_jit_compile(recorded)
        logging.info("Train step %s: jit_compile=auto, as config.json records for this workdir",
                     describe(recorded))
        return
    unprobed = (f"a run of {left} updates (under {MIN_PROBED_UPDATES})" if left < MIN_PROBED_UPDATES
                else None if trainer.iterator_in_checkpoint
                else "a run whose data position a checkpoint cannot hold")
    if unprobed:
        trainer.set_jit_compile(True)
        logging.info("Train step with XLA: jit_compile=auto does not measure %s; "
                     "--config.jit_compile=False runs it without XLA", unprobed)
        return
    try:
        speeds, probe_seconds = measure(trainer)
    except tf.errors.OutOfRangeError:
        trainer.set_jit_compile(True)
        logging.info("Train step with XLA: the train data ended before jit_compile=auto could time "
                     "both modes")
        return
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as error:
        # An error of the data meets the run in either mode, and the run reports it.
        failed = trainer.jit_compile
        trainer.set_jit_compile(not failed)
        logging.warning("Train step %s: jit_compile=auto could not time it %s (%s)",
                        describe(not failed), describe(failed), controller.op_error_summary(error))
        return
    chosen = speeds[True] > speeds[False]
    trainer.set_jit_compile(chosen)
    logging.info("Train step %s: jit_compile=auto measured %.1f examples/s %s vs %.1f %s (probe: "
                 "%.1f s, both modes compiled, state restored)", describe(chosen), speeds[chosen],
                 describe(chosen), speeds[not chosen], describe(not chosen), probe_seconds)
    if trainer.is_chief:
        workdir.record_resolved(trainer.workdir, {KEY: chosen})


def measure(trainer) -> tuple[dict[bool, float], float]:
    """The probe: ({XLA: examples/s, graph: examples/s}, its seconds), timed from the trainer's
    current state, which it leaves as it was (the benchmark reports it too)."""
    started = time.perf_counter()
    iterator = trainer.train_iterator
    with tempfile.TemporaryDirectory(prefix="mixloop-compile-probe-") as directory:
        saved = trainer.save_state(os.path.join(directory, "state"))
        try:
            seconds = {}
            for mode in (True, False):
                trainer.set_jit_compile(mode)
                trainer.train_loop(1, iterator)  # Traces and compiles.
                seconds[mode] = seconds_of_loop(trainer, iterator, 1)
            num_updates = max(1, min(MAX_PROBE_UPDATES,
                                     math.ceil(PROBE_SECONDS / max(min(seconds.values()), 1e-9))))
            rounds = {True: [], False: []}
            for _ in range(PROBE_ROUNDS):
                for mode in (True, False):
                    trainer.set_jit_compile(mode)
                    rounds[mode].append(seconds_of_loop(trainer, iterator, num_updates) / num_updates)
        finally:
            trainer.restore_state(saved)
    batch_size = trainer.config.train.batch_size
    speeds = {mode: batch_size / statistics.median(values) for mode, values in rounds.items()}
    return speeds, time.perf_counter() - started


def seconds_of_loop(trainer, iterator: Any, num_updates: int) -> float:
    """Seconds `num_updates` updates of the trainer's compiled loop take, read back to the host (the
    probe's one measurement: tests pin it)."""
    started = time.perf_counter()
    trainer.train_loop(num_updates, iterator)
    return time.perf_counter() - started
