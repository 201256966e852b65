"""Speed and peak memory: `python -m mixloop.benchmark --config=PATH[:VARIANT] [--quick]
[--repeats=N] [--output=FILE.json] [--config.KEY=VALUE]`.

Builds the experiment's Trainer once (its data, `build_model`, `compute_loss` and optimizer config) and
times, in one process, the same optimizer updates on the same batches done several ways:

    keras-fit        Keras's global dtype policy, a fresh `build_model()`, `model.compile` with the same
                     optimizer (in a LossScaleOptimizer for float16) and loss, `model.fit` as it comes
                     (on a CPU-only machine Keras leaves XLA off)
    keras-fit-tuned  the same with jit_compile=True and steps_per_execution=train.steps_per_loop
    bare             a hand-written tf.function loop: forward, loss, gradient, clipping and update in
                     the same precision, compiled as the Trainer's step; no loss scale, no
                     accumulation, no metrics. The floor; `bare jit_compile=...` is the same in
                     each other compile mode, the floor of the variants compiled that way
    mixloop          the configured Trainer's compiled inner loop, called as the outer loop calls it;
                     with jit_compile="auto", in the mode the run's own probe (`compile_mode`) picks
                     (measured here whatever the run's length: a run under 250 updates, or on a
                     Python generator's data, takes XLA without measuring)
    mixloop KEY=...  the same with settings changed: accumulation_steps 1, 4 and 8 (same global
                     batch), and 1 and 2 in each other compile mode; policy float32, mixed_float16
                     and mixed_bfloat16, each in the three compile modes (XLA, graph, graph with XLA
                     fusing the elementwise ops: `compile_mode`); loss_scale dynamic and none in
                     float16 (the only dtype where a dynamic scale does anything); jit_compile each
                     other way; ema_decay on (0.999) or off,
                     whichever it is not; with train.batch_loss, batch_loss=False (plain
                     accumulation, the loss per micro-batch) beside the two passes; float16 under
                     a dynamic scale with overflow_retries=0 (no retry loop around the step);
                     mixed_bfloat16 and mixed_float16 with precision.float8_layers=auto (Keras's
                     FP8 quantize-dequantize layers: emulated on a CPU, so slower)
    mixloop +metric  the configured run with one more train metric (the mean of the model's first
                     output: a reduction over the logits, weighted and summed like any metric)
    mixloop lighter  mixed_bfloat16 with every lighter setting: bfloat16 master weights, int8
                     Adam moments, bfloat16 accumulators (docs/memory.md); when the experiment's
                     optimizer is config.optimizer's adam or adamw

Peak memory is measured first, apart from the timing: each variant is built and trained (its warm-up
and one repeat) in a process of its own (`memory.peak_of`), so its peak (`memory.peak_bytes`: the
host's peak resident set size on a CPU) counts no other variant. Each such process also holds the
configured Trainer the batches come from (the same in every row) and counts of TensorFlow's code
only the pages it runs: its figures are a few hundred MB below a fresh process's. `--quick`
measures only the variants that differ from the configured run in their policy (`policy_rows`),
and the lighter one.

Every variant is built and warmed up first, which traces all it will run. Then the repeats run
interleaved (A B C ... A B C ...), so a busy neighbour slows every variant alike. A repeat is
`train.steps_per_loop` updates of `train.batch_size` examples (the same batches for every variant),
timed with `perf_counter` until its last result is read back to the host. The table prints each
variant's median examples/s and the median over repeats of its ratio to keras-fit and to the bare
loop of its compile mode, and its peak memory; then the headline: each 16-bit policy against
float32, in speed each in its fastest compile mode, in peak memory all in the configured one, the
mode `auto` picked, and the other ratios. `--output=X.json` writes the same as JSON to a new file,
checked before the work (`cli.check_output`), and with matplotlib a chart to X.png beside it
(`plot`: each policy's speed in each compile mode, float32's fastest as 1.0); Ctrl-C or SIGTERM is
one line (`mixloop.interrupts`). The benchmark needs one replica.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
import warnings
from typing import Any

import ml_collections
from absl import flags, logging

from mixloop import cli, files, interrupts
from mixloop.config import AUTO, validate
from mixloop.errors import UserError
from mixloop.doctor import memory
from mixloop.runner import compile_mode
from mixloop.tools.benchmark_results import format_table, plot, policy_rows, results
from mixloop.tools.benchmark_variants import (LIGHTER, Variant, changed_config, mixloop_configs,
                                              variant_builders)

REPEATS, QUICK_REPEATS = 5, 3
QUICK_STEPS_PER_LOOP = 5  # --quick caps train.steps_per_loop (and so the updates per repeat) at this.


# ----- Peak memory. -----


def measure_peaks(config: ml_collections.ConfigDict, names: list[str]) -> dict[str, int]:
    """Per variant of `names`, the peak memory (`memory.peak_bytes`) of a process of its own that
    trains it (`train_one_variant`): no variant counts another's memory. Logs a line per variant."""
    logging.info("Measuring the peak memory of %d variant(s), each in a process of its own...",
                 len(names))
    peaks = {}
    for index, name in enumerate(names, 1):
        started = time.perf_counter()
        peaks[name] = memory.peak_of(train_one_variant, config, name)
        logging.info("peak memory %d of %d, %s: %s (%.1f s)", index, len(names), name,
                     memory.format_bytes(peaks[name]), time.perf_counter() - started)
    return peaks


def train_one_variant(config: ml_collections.ConfigDict, name: str) -> None:
    """What the variant `name` of `config` is measured on: the Trainer its batches come from (as
    in the timed process), the variant, its warm-up (which traces) and one repeat."""
    logging.set_verbosity(logging.WARNING)  # The timed process has said all this already.
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as workdir:
        trainer = cli.build_trainer(config, workdir)
        variant = variant_builders(trainer, mixloop_configs(config), workdir)[name]()
        for _ in range(2):
            variant.run_fn()


# ----- Timing. -----


def time_interleaved(variants: list[Variant], repeats: int, examples_per_repeat: int) -> None:
    """Runs every variant once untimed (tracing), then `repeats` timed rounds of all of them in turn,
    logging a line per warm-up and per timed repeat as it goes.

    Python's garbage collector is off while timing, as in `timeit`: a full collection over the traced
    graphs takes about half a second, which would land in one variant's repeat.
    """
    for index, variant in enumerate(variants, 1):
        started = time.perf_counter()
        variant.run_fn()
        logging.info("warm-up %d of %d, %s: %.1f s (tracing and compiling)", index, len(variants),
                     variant.name, time.perf_counter() - started)
    gc.collect()
    gc.disable()
    try:
        for repeat in range(repeats):
            for variant in variants:
                started = time.perf_counter()
                variant.run_fn()
                variant.seconds.append(time.perf_counter() - started)
                logging.info("repeat %d of %d, %s: %.1f examples/s", repeat + 1, repeats,
                             variant.name, examples_per_repeat / variant.seconds[-1])
    finally:
        gc.enable()


# ----- The command. -----


def benchmark(config: ml_collections.ConfigDict, *, repeats: int, quick: bool) -> dict[str, Any]:
    """Builds every variant of `config`'s experiment, times them and returns the results.

    Raises:
      UserError: for a bad config, or one that trains on more than one replica.
    """
    if quick:
        config = config.copy_and_resolve_references()
        config.train.steps_per_loop = min(config.train.steps_per_loop, QUICK_STEPS_PER_LOOP)
    validate(config)
    mixloop_configs(config)  # Before anything is built: a variant may not fit.
    with tempfile.TemporaryDirectory() as workdir:
        trainer = cli.build_trainer(config, workdir)
        interrupts.unwind_from_here()  # Built, imports done: the work's cleanup runs on a signal.
        if trainer.run.strategy.num_replicas_in_sync != 1:
            raise UserError(f"the benchmark times one device, but config.distribution="
                            f"{config.distribution!r} gives {trainer.run.strategy.num_replicas_in_sync} "
                            "replicas; set --config.distribution=one_device")
        auto = None
        if config.jit_compile == AUTO:
            logging.info("Timing the compile modes as a run's jit_compile=auto does...")
            probe = compile_mode.measure(trainer.run)
            auto = dict(mode=compile_mode.fastest(probe.speeds), probe_seconds=round(probe.seconds, 1),
                        examples_per_sec={compile_mode.NAMES[mode].key: round(speed, 1)
                                          for mode, speed in probe.speeds.items()})
            config = changed_config(config, {"jit_compile": auto["mode"]})
            trainer.run.config = config
            trainer.run.set_jit_compile(auto["mode"])
        configs = mixloop_configs(config)
        builders = variant_builders(trainer, configs, workdir)
        measured = [*policy_rows(configs).values(), *([LIGHTER] if LIGHTER in builders else [])]
        peaks = measure_peaks(config, measured if quick else list(builders))
        logging.info("Building the variants (one model, and for mixloop one Trainer, each)...")
        variants = [build() for build in builders.values()]
        for variant in variants:
            variant.peak_bytes = peaks.get(variant.name)
        time_interleaved(variants, repeats,
                         examples_per_repeat=config.train.steps_per_loop * config.train.batch_size)
    return results(variants, config, repeats=repeats, quick=quick, auto=auto)


def chart_path(output: str) -> str:
    """Where --output=`output` (X.json) puts the chart: X.png beside it (X.png.png for X.png)."""
    root, extension = os.path.splitext(output)
    return (output if extension == ".png" else root) + ".png"


def define_flags() -> None:
    """The command's flags beside cli's --config and --workdir. Defined only when the module runs as
    a program (`python -m mixloop.benchmark`): the doctor has an --output flag too, and the tests
    import both modules."""
    flags.DEFINE_bool("quick", False, "A smoke run: 3 repeats of at most 5 updates each; the peak "
                      "memory of the policy variants only.")
    flags.DEFINE_integer("repeats", None, "Timed repeats of every variant (default 5, or 3 with "
                         "--quick).", lower_bound=1)
    flags.DEFINE_string("output", None, "Also write the results as JSON to this file (X.json), and "
                        "with matplotlib their chart to X.png beside it.")


def main() -> None:
    config, _ = cli.experiment_from_flags()
    options = flags.FLAGS
    # fit's `shuffle` defaults to True, which a tf.data.Dataset ignores, with a warning.
    warnings.filterwarnings("ignore", message="`shuffle=True` was passed")
    repeats = options.repeats or (QUICK_REPEATS if options.quick else REPEATS)
    if options.output:  # Before the work, not after it.
        cli.check_output(options.output, folder=False)
        if os.path.lexists(chart_path(options.output)):
            raise UserError(f"--output={options.output} writes its chart to "
                            f"{chart_path(options.output)}, which exists; name a new place, or move "
                            "it away")
    report = benchmark(config, repeats=repeats, quick=options.quick)
    print(format_table(report))
    if options.output:
        files.write_json(options.output, report)
        written = [options.output]
        if plot(report, chart_path(options.output)):
            written.append(chart_path(options.output))
        logging.info("Wrote %s", ", ".join(written))
    # Python's last garbage collection, at exit, would spend longer deleting the traced functions
    # than --quick spends timing them; the process is ending anyway.
    gc.freeze()

