"""Which compile mode the train step runs in: XLA, TensorFlow's graph kernels, or both, configured or measured.

`config.jit_compile` is True (XLA), False (graph mode: TensorFlow's own kernels, oneDNN on a CPU),
"elementwise" (graph mode whose elementwise and reduction ops XLA fuses, while TensorFlow's kernels
keep the matrix products and convolutions) or "auto" (the default). No mode wins everywhere: XLA
fuses the many small ops of a step, which pays on GPUs and for small models, while on a CPU with
AVX512_BF16 only TensorFlow's own kernels multiply bfloat16 matrices at the hardware's speed (XLA on
a CPU does not use those instructions) and TensorFlow's float16 convolutions on a CPU are slow;
"elementwise" takes each side's strength (TensorFlow's auto-clustering limited to its fusible ops
but the gradient reductions, `CLUSTERED_OPS`, turned on for the train loop's calls alone). So
"auto" measures::

    several replicas: without XLA, no probe (the step calls `strategy.run`, which XLA does not
        compile here)
    config.json records an earlier choice for this workdir, measured for the same policy, batch,
        accumulation and model: that one, no probe (a resume keeps it)
    the same setup measured on this machine before (`compile_cache`): that choice, no probe
        (unless it is plain XLA and a known rule now leaves that out)
    fewer than MIN_PROBED_UPDATES updates left, `deterministic=True`, or a train iterator a
        checkpoint cannot hold (a Python generator): with XLA, or graph mode where a known rule
        holds (`_known_rule`: bfloat16 on a CPU with its instructions, float16 on a CPU for a
        model without convolutions), no probe (compiling and timing all modes would cost a large
        share of so short a run; a deterministic run must not depend on a timing; the data
        position could not be put back; XLA was the default before "auto")
    otherwise, the probe, before the first real update:
        save everything a checkpoint holds (weights, optimizer, scales, counters, the data position)
            to a temporary folder in the workdir
        per mode (the three, plain XLA left out where a known rule holds; no further mode once
            compiling it would take the probe past PROBE_SHARE of the run): trace and compile the
            loop (one update), then time loops of a few updates each, the modes interleaved, on
            the run's own batches
        restore it all: the run's numbers and data order are those of a run without the probe (a
            second iterator would not do: over a dataset that reshuffles, it moves the shuffle seed)
        keep the fastest mode's compiled loop; log the speeds and the probe's cost beyond
            compiling that loop (which the run would do anyway); record the choice, and what it
            was measured for, in config.json's `resolved` record and the machine's cache
    a mode that fails in the probe: XLA without a kernel for an op, or out of memory: graph mode
        (XLA in graph mode's place); any other error (of the data, say): that mode, so the run
        meets it and reports it

The auto-clustering filter is TensorFlow's `TF_XLA_FLAGS`, read once per process when TensorFlow
first optimizes a function: importing this module adds `--tf_xla_ops_to_cluster=CLUSTERED_OPS` and
`--tf_xla_min_cluster_size=8` (each unless the variable names it already), which change nothing
until auto-clustering is on. A process that ran TensorFlow functions before importing mixloop has
read the flags without them; there "elementwise" clusters the matrix products and the gradient
reductions too (slower in 16 bits on a CPU, and heavier), as the probe measures.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Union

import keras
import tensorflow as tf
from absl import logging
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context

from mixloop import errors, interrupts, machine
from mixloop.config import AUTO, ELEMENTWISE, ConfigError
from mixloop.engine import keras_adapter
from mixloop.engine.layer_precision import named_layers
from mixloop.runner import compile_cache, workdir

KEY = "jit_compile"  # Its config key, and its key in config.json's `resolved` record,
MEASURED_FOR_KEY = "jit_compile_measured_for"  # beside the settings it was measured for.
MIN_PROBED_UPDATES = 250  # Fewer updates left than this: XLA, unprobed (the probe costs seconds).
PROBE_ROUNDS = 3  # Timed loops per mode, interleaved; the median counts.
PROBE_SECONDS = 0.3  # Each timed loop runs about this long (more updates for a fast step)...
MAX_PROBE_UPDATES = 20  # ...but no more updates than this.
# The probe compiles no further mode once that would take it past this share of the run's time
# (estimated from the fastest step timed so far); the modes left are not measured.
PROBE_SHARE = 0.05
STOP_POLL_SECONDS = 0.1  # How often the probe looks for a stop while a loop compiles.
MODES = (True, False, ELEMENTWISE)
Mode = Union[bool, str]


class ModeNames(NamedTuple):
    """How each place names a compile mode."""

    phrase: str  # In log lines: "Train step with XLA".
    key: str  # In JSON: the compile-mode cache's speeds, the benchmark's `auto` record.
    label: str  # In the benchmark's chart, a group of bars.


NAMES = {True: ModeNames("with XLA", "xla", "XLA"),
         False: ModeNames("without XLA", "graph", "graph"),
         ELEMENTWISE: ModeNames("with XLA fusing its elementwise ops", "elementwise", "elementwise")}


# The ops "elementwise" lets XLA cluster: TensorFlow's FUSIBLE categories (matrix products and
# convolutions stay out) but for their gradient reductions, Sum and BiasAddGrad (category
# REDUCEWINDOWPW, with LRN). Each layer's bias, LayerNorm scale and broadcast kernel gets its gradient
# as such a reduction of an activation-sized tensor, and no reduction depends on another, so
# clustering merged a model's all into one cluster (through a shape constant they share, or the
# step's loss weight and scale), which runs only once the last exists: every layer's activation-
# sized gradient stayed alive to the end of the backward pass, at no gain in speed (docs/speed.md).
CLUSTERED_OPS = "PW,PWRED,REDUCEWINDOW,BN,SORT,MISC,All,Any,Min,Max,Mean,Prod"

# TensorFlow's auto-clustering flags for "elementwise", each unless TF_XLA_FLAGS names it already:
AUTO_CLUSTERING_FLAGS = {
    "--tf_xla_ops_to_cluster": CLUSTERED_OPS,
    # Each cluster's call has a fixed cost on a CPU, so a shorter run of ops stays on TensorFlow's
    # kernels (TensorFlow's default is 4; 8 measured fastest on charlm, docs/speed.md).
    "--tf_xla_min_cluster_size": "8",
}


def _cluster_elementwise_ops_only() -> None:
    """Limits TensorFlow's auto-clustering (off unless a call turns it on) to the runs of ops XLA
    fuses that are long enough to pay for a cluster's call."""
    flags = os.environ.get("TF_XLA_FLAGS", "")
    for name, value in AUTO_CLUSTERING_FLAGS.items():
        if name not in flags:
            flags = f"{flags} {name}={value}".strip()
    os.environ["TF_XLA_FLAGS"] = flags


_cluster_elementwise_ops_only()


def step_with_xla(jit_compile: Optional[Mode]) -> bool:
    """Whether the train step itself is compiled with XLA in mode `jit_compile`: for True, and
    while undecided (None: XLA until measured); "elementwise" runs the graph-mode step."""
    return jit_compile is True or jit_compile is None


def fastest(speeds: dict[Mode, float]) -> Mode:
    """The mode of `speeds` (examples/s by mode, the modes measured) with the most, the earlier of
    MODES on a tie."""
    return max((mode for mode in MODES if mode in speeds), key=speeds.get)


def describe(jit_compile: Mode) -> str:
    """How the log lines name a mode."""
    return NAMES[jit_compile].phrase


def mode_of_key(key: str) -> Mode:
    """The mode JSON names `key` (`ModeNames.key`)."""
    return next(mode for mode, names in NAMES.items() if names.key == key)


@contextlib.contextmanager
def calls_in(jit_compile: Optional[Mode]) -> Iterator[None]:
    """Inside, the `tf.function` calls made (and traced) run in mode `jit_compile`'s graph options:
    for "elementwise", TensorFlow's auto-clustering on, CPU included; else as they are. TensorFlow
    has no public call for one call's options (`tf.config.optimizer.set_jit` is process-wide), so
    this sets the eager context's (tests/runner/test_compile_mode.py pins it)."""
    if jit_compile != ELEMENTWISE:
        yield
        return
    eager = context.context()
    previous = eager.function_call_options
    config = config_pb2.ConfigProto()
    config.ParseFromString(previous.config_proto_serialized)
    config.graph_options.optimizer_options.global_jit_level = config_pb2.OptimizerOptions.ON_1
    config.graph_options.optimizer_options.cpu_global_jit = True
    eager.function_call_options = context.FunctionCallOptions(
        executor_type=previous.executor_type, config_proto=config)
    try:
        yield
    finally:
        eager.function_call_options = previous


def configured(jit_compile: Any, num_replicas: int) -> tuple[Optional[Mode], str]:
    """(the mode `config.jit_compile` fixes, or None when the probe must decide; why).

    Raises:
      ConfigError: for jit_compile=True or "elementwise" with more than one replica.
    """
    if jit_compile in (True, ELEMENTWISE) and num_replicas > 1:
        raise ConfigError(f"config.jit_compile={jit_compile} is not supported with more than one "
                          "replica yet; set it to False or 'auto'")
    if jit_compile in MODES:
        return jit_compile, f"config.jit_compile={jit_compile}"
    if num_replicas > 1:
        return False, f"jit_compile=auto: {num_replicas} replicas, which XLA does not compile here"
    return None, "jit_compile=auto: measured before the first update"


def choose(run, stop_requested: Callable[[], bool] = lambda: False) -> bool:
    """Sets `run`'s compile mode when `config.jit_compile` is "auto" and nothing decided it yet
    (the module docstring), logging one line with the evidence; returns whether it compiled the
    loop in the chosen mode (the probe did). A probe gives up at its next loop once
    `stop_requested()`: the state is put back and the unprobed mode set, unrecorded, so that the
    run saves and exits and its resume measures."""
    if run.jit_compile is not None:
        return False
    measured_for = _measured_for(run.config)
    resolved = workdir.read_resolved(run.workdir)
    recorded = resolved.get(KEY)
    if KEY in resolved and not is_mode(recorded):
        raise workdir.refuse_recorded(run.workdir, KEY, recorded,
                                      'a compile mode: true, false or "elementwise"')
    if KEY in resolved and resolved.get(MEASURED_FOR_KEY) == measured_for:
        run.set_jit_compile(recorded)
        logging.info("Train step %s: jit_compile=auto, as config.json records for this workdir",
                     describe(recorded))
        return False
    # Neither may depend on a timing: a deterministic run, and one whose data position a
    # checkpoint cannot hold (the probe could not put it back).
    unmeasurable = ("a deterministic run (config.deterministic)" if run.config.deterministic
                    else None if run.iterator_in_checkpoint
                    else "a run whose data position a checkpoint cannot hold")
    cache_key = compile_cache.key_of(compile_cache.setup(run))
    cached = None if unmeasurable else compile_cache.lookup(cache_key)
    rule = _known_rule(run.policy.compute_dtype, run.model)
    if cached is not None and is_mode(cached["mode"]) and not (cached["mode"] is True and rule):
        run.set_jit_compile(cached["mode"])
        logging.info("Train step %s: jit_compile=auto, as measured for this setup on this machine "
                     "at %s (cache %s; %s=off measures again)", describe(cached["mode"]),
                     cached.get("measured_at", "?"), compile_cache.cache_path(),
                     compile_cache.CACHE_ENV)
        _record(run, cached["mode"], measured_for)
        return False
    left = run.config.train.num_steps - int(run.global_step.numpy())
    unprobed = unmeasurable or (f"a run of {left} updates (under {MIN_PROBED_UPDATES})"
                                if left < MIN_PROBED_UPDATES else None)
    if unprobed:
        mode = False if rule else True
        run.set_jit_compile(mode)
        logging.info("Train step %s: jit_compile=auto does not measure %s%s; --config.jit_compile=%s "
                     "runs it %s", describe(mode), unprobed, f", and {rule}" if rule else "",
                     not mode, describe(not mode))
        _record(run, mode, measured_for)  # A resume keeps it, whatever the cache learns meanwhile.
        return False
    modes = _modes_to_probe(run.policy.compute_dtype, rule)
    try:
        probe = measure(run, modes, run_updates=left, stop_requested=stop_requested,
                        abandon_on_stop=interrupts.running_a_command())
    except interrupts.ProbeStopped:
        run.set_jit_compile(False if rule else True)  # As unprobed: by the rule, else XLA.
        logging.info("jit_compile=auto: the probe gave up for the stop request, state restored")
        return False
    except tf.errors.OpError as error:
        failed = run.jit_compile
        chosen = (_fallback(failed, modes) if isinstance(error, (tf.errors.UnimplementedError,
                                                                 tf.errors.ResourceExhaustedError))
                  else failed)
        run.set_jit_compile(chosen)
        logging.warning("Train step %s: jit_compile=auto could not time it %s: %s", describe(chosen),
                        describe(failed), errors.op_error_summary(error))
        return False
    speeds = probe.speeds
    chosen = fastest(speeds)
    run.set_jit_compile(chosen)
    others = [mode for mode in speeds if mode != chosen]
    untimed = [describe(mode) for mode in modes if mode not in speeds]
    # The chosen mode's compilation is no cost of the probe: the run goes on with that loop.
    logging.info("Train step %s: jit_compile=auto measured %.1f examples/s%s (probe: %.1f s, "
                 "%.1f s more than compiling the loop the run keeps; %d mode(s) compiled, state "
                 "restored)%s%s", describe(chosen), speeds[chosen],
                 " vs " + ", ".join(f"{speeds[mode]:.1f} {describe(mode)}" for mode in others)
                 if others else "", probe.seconds, probe.extra_seconds(chosen), len(speeds),
                 f"; not timed {describe(True)}: {rule}" if rule else "",
                 f"; not timed {', '.join(untimed)}: the probe stays under {PROBE_SHARE:.0%} of "
                 f"the run's estimated time" if untimed else "")
    _record(run, chosen, measured_for)
    if run.is_chief:
        compile_cache.store(cache_key, chosen, {NAMES[mode].key: round(speed, 1)
                                                for mode, speed in speeds.items()})
    return True


def first_loop(run) -> dict[str, Any]:
    """The run's first loop, one update (it traces and compiles). When `jit_compile="auto"` chose
    XLA without compiling it (recorded, cached, or by a rule) and XLA cannot compile the step (an
    op without an XLA kernel), the run takes graph mode instead: the data position and the step
    count put back (the failed loop read a batch, and its step's increment, which waits for
    nothing, may have run), the choice recorded in config.json and the cache, one warning line.

    Raises:
      tf.errors.OpError: any other failure, and XLA's where the user chose it.
    """
    if run.config.jit_compile != AUTO or run.jit_compile is not True:
        return run.train_loop(1)
    step = int(run.global_step.numpy())
    with workdir.scratch_folder(run.workdir, ".compile-probe-") as directory:
        position = (tf.train.Checkpoint(iterator=run.train_iterator).write(
            os.path.join(directory, "position")) if run.iterator_in_checkpoint else None)
        try:
            return run.train_loop(1)
        except tf.errors.OpError as error:
            summary = errors.op_error_summary(error)
            if not summary.startswith(errors.XLA_CANNOT_COMPILE):
                raise
            run.global_step.assign(step)
            if position is None:
                run.restart_train_iterator()  # Made again, fast-forwarded by the step.
            else:
                tf.train.Checkpoint(iterator=run.train_iterator).read(position).assert_consumed()
    run.set_jit_compile(False)
    logging.warning("Train step %s: jit_compile=auto had chosen %s, which cannot run this step (%s); "
                    "recorded", describe(False), describe(True), summary)
    _record(run, False, _measured_for(run.config))
    if run.is_chief:
        compile_cache.store(compile_cache.key_of(compile_cache.setup(run)), False, {})
    return run.train_loop(1)


def _record(run, mode: Mode, measured_for: dict[str, Any]) -> None:
    """Records `mode` in config.json, with what it was measured for: a resume keeps it."""
    if run.is_chief:
        workdir.record_resolved(run.workdir, {KEY: mode, MEASURED_FOR_KEY: measured_for})


def _known_rule(compute_dtype: Any, model: keras.Model) -> Optional[str]:
    """Why graph mode wins unmeasured over plain XLA, or None; on a CPU (no GPU):

    - a bfloat16 policy where the flags have AVX512_BF16 or AMX, whose bfloat16 matrix products
      only TensorFlow's own kernels use (XLA on a CPU does not: plain XLA measured the slowest mode
      there);
    - a float16 policy for a model without convolutions: the memory TensorFlow's kernels keep from
      the precision probe's passes is reused by a loop in graph mode, while XLA's buffers come on
      top of it, and XLA on a CPU has no float16 arithmetic to gain speed from. TensorFlow's
      float16 convolutions on a CPU are slow, so a model with them keeps XLA.

    docs/speed.md gives the measurements behind each rule.
    """
    if tf.config.list_physical_devices("GPU"):
        return None
    if tf.as_dtype(compute_dtype) == tf.float16:
        if any(isinstance(layer, _CONVOLUTIONS) for layer in named_layers(model).values()):
            return None
        return ("a float16 policy on a CPU, for a model without convolutions, stays lighter than "
                "float32 in graph mode (XLA's buffers come on top of the memory the precision "
                "probe leaves)")
    if tf.as_dtype(compute_dtype) != tf.bfloat16:
        return None
    flags = set(machine.cpu()["flags"].split())
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if not found:
        return None
    return (f"a bfloat16 policy on a CPU with {' and '.join(f.upper() for f in found)} runs fastest "
            "on TensorFlow's kernels (XLA on a CPU does not use them)")


# Keras's convolution layers, transposed, depthwise and separable ones included.
_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
                 keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
                 keras.layers.Conv3DTranspose, keras.layers.DepthwiseConv1D,
                 keras.layers.DepthwiseConv2D, keras.layers.SeparableConv1D,
                 keras.layers.SeparableConv2D)


def _modes_to_probe(compute_dtype: Any, rule: Optional[str]) -> list[Mode]:
    """The modes the probe times, in order (within its budget a shorter run times only the first):
    all three; where a known rule holds, plain XLA left out, and for bfloat16 XLA fusing the
    elementwise ops first (measured the faster on an AVX512_BF16 CPU, docs/speed.md; float16 keeps
    graph mode first, its lighter mode)."""
    if not rule:
        return list(MODES)
    return [ELEMENTWISE, False] if tf.as_dtype(compute_dtype) == tf.bfloat16 else [False, ELEMENTWISE]


def _fallback(failed: Mode, modes: Sequence[Mode]) -> Mode:
    """The mode a run takes when `failed` had no kernel or memory in the probe: graph mode, or
    where graph mode failed the other of `modes` first (XLA, or where a rule leaves XLA out,
    XLA fusing the elementwise ops)."""
    return False if failed is not False else next(mode for mode in modes if mode is not False)


def _over_budget(elapsed: float, num_measured: int, run_updates: int,
                 seconds: dict[Mode, float]) -> bool:
    """Whether compiling one more mode, at the cost of each so far, would take the probe past
    PROBE_SHARE of `run_updates` updates at the fastest `seconds` per update timed."""
    run_seconds = run_updates * min(seconds.values())
    return elapsed * (num_measured + 1) / num_measured > PROBE_SHARE * run_seconds


def _saved_state(run, directory: str) -> str:
    """`run.save_state` into `directory` (the probe's way back).

    Raises:
      workdir.UnusableWorkdir: when the disk is full: the run could save no checkpoint either.
    """
    try:
        return run.save_state(os.path.join(directory, "state"))
    except (tf.errors.ResourceExhaustedError, OSError) as error:
        raise workdir.UnusableWorkdir(
            f"cannot write to the workdir {run.workdir}: the compile-mode probe could not copy "
            f"the state ({workdir.error_reason(error)}); free some space or choose another "
            "--workdir") from None


def is_mode(value: Any) -> bool:
    """Whether `value` is one of MODES itself: 1 equals True, but is no mode a run records."""
    return isinstance(value, bool) or value == ELEMENTWISE


def _measured_for(config: Any) -> dict[str, Any]:
    """The settings a compile mode's speed depends on: the policy, the batch, the model."""
    return {"precision.policy": config.precision.policy, "train.batch_size": config.train.batch_size,
            "train.accumulation_steps": config.train.accumulation_steps,
            "model": json.loads(json.dumps(config.model.to_dict(), default=str))}


class Probe(NamedTuple):
    """What `measure` found: each mode's speed, and what the probe cost."""

    speeds: dict[Mode, float]  # Examples/s of each mode measured.
    seconds: float  # The whole probe's wall time.
    compile_seconds: dict[Mode, float]  # Each mode's first loop: tracing, compiling, one update.

    def extra_seconds(self, kept: Mode) -> float:
        """What the probe added to the run that keeps `kept`'s compiled loop: all but that
        compilation, which the run would have spent at its first update anyway."""
        return max(0.0, self.seconds - self.compile_seconds[kept])


def measure(run, modes: Sequence[Mode] = MODES, run_updates: Optional[int] = None,
            stop_requested: Callable[[], bool] = lambda: False, abandon_on_stop: bool = False
            ) -> Probe:
    """The probe: each of `modes` compiled and timed from the run's current state, which it
    leaves as it was (the benchmark reports it too). With
    `run_updates` (the run's length) it compiles no further mode once that would take it past
    PROBE_SHARE of the run's time at the fastest step timed so far: at least the first is measured.
    With `abandon_on_stop` (a command that can end itself) a stop during a compilation abandons it.

    Raises:
      interrupts.ProbeStopped: at the first loop boundary after `stop_requested()` turned true.
      interrupts.ProbeAbandoned: with `abandon_on_stop`, once `stop_requested()` during a
        compilation.
    """
    started = time.perf_counter()
    with workdir.scratch_folder(run.workdir, ".compile-probe-") as directory:
        saved = _saved_state(run, directory)
        abandoned = False
        try:
            seconds, compile_seconds = {}, {}
            for mode in modes:
                if seconds and run_updates is not None and _over_budget(
                        time.perf_counter() - started, len(seconds), run_updates, seconds):
                    break
                interrupts.check_stop(stop_requested)
                run.set_jit_compile(mode)
                compile_seconds[mode] = _seconds_of_first_loop(
                    run, stop_requested if abandon_on_stop else None)
                interrupts.check_stop(stop_requested)
                seconds[mode] = seconds_of_loop(run, 1)
            # Per mode, about PROBE_SECONDS a loop: a mode 30x slower is timed on fewer updates.
            num_updates = {mode: max(1, min(MAX_PROBE_UPDATES,
                                            math.ceil(PROBE_SECONDS / max(seconds[mode], 1e-9))))
                           for mode in seconds}
            rounds = {mode: [] for mode in seconds}
            for _ in range(PROBE_ROUNDS):
                for mode in seconds:
                    interrupts.check_stop(stop_requested)
                    run.set_jit_compile(mode)
                    before = int(run.global_step.numpy())
                    seconds_taken = seconds_of_loop(run, num_updates[mode])
                    # A loop the guard ends early (a divergence) made fewer updates.
                    done = max(1, int(run.global_step.numpy()) - before)
                    rounds[mode].append(seconds_taken / done)
        except interrupts.ProbeAbandoned:
            abandoned = True  # A thread still runs the loop: the state is the process's to drop.
            raise
        finally:
            if not abandoned:
                run.restore_state(saved)
    batch_size = run.config.train.batch_size
    speeds = {mode: batch_size / statistics.median(values) for mode, values in rounds.items()}
    return Probe(speeds, time.perf_counter() - started, compile_seconds)


def _seconds_of_first_loop(run, stop_requested: Optional[Callable[[], bool]]) -> float:
    """Seconds of the run's first loop in the mode set, one update: it traces and compiles.
    With `stop_requested` the loop runs in a thread of its own, seeing this thread's Keras state,
    while this one watches `stop_requested()`: compiling runs in C++ for seconds, where no signal
    handler runs.

    Raises:
      interrupts.ProbeAbandoned: once `stop_requested()` while the loop runs (its thread goes on).
    """
    started = time.perf_counter()
    if stop_requested is None:
        run.train_loop(1)
        return time.perf_counter() - started
    keras_state, failure = keras_adapter.thread_state(), []

    def first_loop() -> None:
        keras_adapter.adopt_thread_state(keras_state)  # Keras keeps its global state per thread.
        try:
            run.train_loop(1)
        except BaseException as error:  # Raised again in the caller's thread.
            failure.append(error)

    thread = threading.Thread(target=first_loop, name="mixloop compile-mode probe", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(STOP_POLL_SECONDS)
        if thread.is_alive() and stop_requested():
            raise interrupts.ProbeAbandoned()
    if failure:
        raise failure[0]
    return time.perf_counter() - started


def seconds_of_loop(run, num_updates: int) -> float:
    """Seconds `num_updates` updates of the run's compiled loop take, read back to the host (the
    probe's one measurement: tests pin it)."""
    started = time.perf_counter()
    run.train_loop(num_updates)
    return time.perf_counter() - started
