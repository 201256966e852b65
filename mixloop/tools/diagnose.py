"""The precision doctor: `python -m mixloop.diagnose --config=PATH[:VARIANT] [--workdir=DIR] [--steps=N]
[--output=DIR] [--loss_scale=X] [--objective=NAME] [--config.KEY=VALUE]`.

Builds the experiment's Trainer as `mixloop.train` does, restores the workdir's latest checkpoint if
there is one (and writes nothing there), diagnoses each of its objectives (or only --objective) on
the same next N train batches with `mixloop.doctor.diagnosis`, and prints one report per
objective, then what the run's persistent state weighs and would weigh with each lighter storage
setting (`mixloop.doctor.memory.lighter_options`). With --output it also writes, into that directory
(with several objectives, into its subdirectory named for the objective), `report.json`, TensorBoard
histograms of the gradients' log2 magnitudes, and `gradient_histogram.png` (when matplotlib is
installed: `pip install -e '.[plot]'`), after checking before the work that it can
(`cli.check_output`). Any problem with the input is one line on stderr and exit status 2; Ctrl-C or
SIGTERM is one line too (`mixloop.interrupts`).
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import textwrap
from typing import Optional

import numpy as np
import tensorflow as tf
from absl import flags, logging
from tensorboard.plugins.histogram import metadata as histogram_metadata

from mixloop import cli, interrupts
from mixloop.config import DEFAULT_INITIAL_SCALE
from mixloop.engine.compact_optimizer import MIN_QUANTIZED_SIZE
from mixloop.errors import UserError
from mixloop.doctor import memory
from mixloop.runner import auto_precision
from mixloop.doctor.memory import LIGHTER_PARTS, LighterOption, PersistentState, format_bytes
from mixloop.doctor.float8_column import FLUSH_TOLERANCE, Float8Advice, Float8Report
from mixloop.doctor.diagnosis import NOISE_SCALE, diagnose_objectives
from mixloop.doctor.report import (COMPARISON_MARGIN_BITS, MARGIN_BITS, DtypeRange, PrecisionReport,
                                   VariableReport, write_json)
from mixloop.runner.workdir import error_reason, making_room, nearest_existing
from mixloop.runner.run import Run

_STEPS = flags.DEFINE_integer("steps", 4, "Train batches to diagnose.", lower_bound=1)
_OUTPUT = flags.DEFINE_string(
    "output", None, "Directory for report.json, TensorBoard histograms and gradient_histogram.png."
)
_LOSS_SCALE = flags.DEFINE_float(
    "loss_scale", None, "Loss scale to examine the gradients at; defaults to the run's current scale."
)
_OBJECTIVE = flags.DEFINE_string(
    "objective", None, "The objective to diagnose; by default every objective, one report each."
)
flags.register_validator(
    "loss_scale", lambda value: value is None or 0 < value < math.inf, "must be positive and finite"
)


def diagnose_experiment(config, workdir: str, num_batches: int, loss_scale: Optional[float] = None,
                        objective: Optional[str] = None) -> list[PrecisionReport]:
    """Diagnoses `objective` (by default every objective, in turn) of `restored_run(config,
    workdir)` on the same `num_batches` train batches; one report per objective. Writes nothing.

    Raises:
      UserError: for a bad config, a checkpoint that does not fit, an unknown objective, or what
        `diagnose` refuses.
    """
    return diagnose_run(restored_run(config, workdir), num_batches, loss_scale, objective)


def restored_run(config, workdir: str) -> Run:
    """Validates `config`, builds its Trainer's run, and restores `workdir`'s latest checkpoint if
    any (and the layer placement its config.json records, as a resumed run does). Writes nothing.

    Raises:
      UserError: for a bad config or a checkpoint that does not fit.
    """
    run = cli.build_trainer(config, workdir).run
    checkpoint = run.restore()
    auto_precision.apply_recorded(run)  # The run's placement, when `auto` or a heal chose it.
    logging.info("Diagnosing %s", checkpoint or f"the initial weights (no checkpoint in {workdir})")
    return run


def diagnose_run(run: Run, num_batches: int, loss_scale: Optional[float] = None,
                 objective: Optional[str] = None) -> list[PrecisionReport]:
    """`diagnose_experiment` on a built run."""
    names = list(run.objectives) if objective is None else [objective]
    return diagnose_objectives(run, names, num_batches, loss_scale)


# ----- The console table. -----


def format_report(report: PrecisionReport) -> str:
    """The report as console text: a header, the layer and variable tables, problems and advice."""
    scale, comparison = _scale_text(report.loss_scale), _scale_text(report.comparison_scale)
    lines = [
        f"Precision report: {report.trainer}{_objective_text(report)} at step {report.step}, "
        f"policy {report.policy}",
        f"{report.num_batches} batches ({report.num_micro_batches} micro-batches), loss scale {scale}, "
        f"mixed pass at loss scale {comparison}",
        "",
        "Layers, in call order. max|x|, max|y|: largest input and output magnitudes in float32.",
        "headroom: doublings left below the compute dtype's largest value. inf: outputs that were inf",
        "or NaN in the mixed pass. max|dy|: largest output gradient (unscaled). dy zero: output",
        f"gradients times {scale} that flush to zero in the compute dtype.",
        *_float8_legend(report),
    ]
    lines += _table(
        ("layer", "dtype", "max|x|", "max|y|", "headroom", "inf", "max|dy|", "dy zero", "FP8"),
        [(l.path, l.compute_dtype, "-" if l.max_abs_input is None else _number(l.max_abs_input),
          _number(l.max_abs_output), _bits(l.headroom_bits), str(l.non_finite_outputs),
          _number(l.max_abs_output_grad), _percent(l.output_grad_zero_fraction), _float8_cell(l.float8))
         for l in report.layers],
    )
    lines += [
        "",
        "Gradients, as fractions of each variable's nonzero float32 values. zero, subnormal, inf: the",
        f"float32 gradient times {scale}, cast to the dtype it is computed in.",
        *_comparison_legend(report),
        *_overwritten_legend(report),
    ]
    lines += _table(
        ("variable", "dtype", "max|g|", "min|g|", "zero", "subnormal", "inf", "mixed zero", "abs.err",
         "rel.err"),
        [_variable_row(v) for v in report.variables],
    )
    lines += [
        "",
        f"In 16 bits at loss scale {scale}: {_percent(report.gradient_zero_fraction)} of gradient "
        f"values flush to zero, {_percent(report.gradient_subnormal_fraction)} are subnormal, "
        f"{_percent(report.gradient_overflow_fraction)} overflow.",
        "",
        "Problems:",
    ]
    lines += [f"  - {problem}" for problem in report.advice.problems] or ["  none: every value fits."]
    return "\n".join(lines + ["", "Advice:"] + _advice_lines(report))


def _float8_legend(report: PrecisionReport) -> list[str]:
    if not any(layer.float8 for layer in report.layers):
        return []
    return textwrap.wrap(
        "FP8 (Dense and EinsumDense): of the mixed pass's nonzero values, the share float8 flushes "
        "to zero / saturates, forward (inputs or kernel in E4M3, the worse) and backward (output "
        "gradients in E5M2, at the loss scale); at a float8 layer's own scales, marked *, else at the "
        "scales Keras's delayed scaling sets from these values.", width=100)


def _float8_cell(float8: Optional[Float8Report]) -> str:
    if float8 is None:
        return "-"
    own = "*" if float8.own_scales else ""
    return (f"{own}fwd {_percent(float8.forward_flushed)}/{_percent(float8.forward_saturated)} "
            f"bwd {_percent(float8.backward_flushed)}/{_percent(float8.backward_saturated)}")


def _variable_row(v: VariableReport) -> tuple[str, ...]:
    if v.overwritten:
        return (v.path, v.dtype, "overwritten", "-", "-", "-", _percent(v.overflow_fraction), "-", "-",
                "-")
    return (v.path, v.dtype, _number(v.max_abs), _number(v.min_abs), _percent(v.zero_fraction),
            _percent(v.subnormal_fraction), _percent(v.overflow_fraction),
            _percent(v.mixed_zero_fraction), _number(v.absolute_error),
            "-" if v.relative_error is None else _number(v.relative_error))


def _overwritten_legend(report: PrecisionReport) -> list[str]:
    if not any(v.overwritten for v in report.variables):
        return []
    return ["overwritten: its \"gradient\" is its new value (Keras's overwrite_with_gradient, e.g. float8",
            "scales and amax histories): no gradient statistics; inf: its new values inf or NaN."]


def _objective_text(report: PrecisionReport) -> str:
    """", objective 'NAME'" when the trainer has several objectives, else nothing."""
    return f", objective {report.objective!r}" if len(report.objectives) > 1 else ""


def _comparison_legend(report: PrecisionReport) -> list[str]:
    """What the mixed-pass columns compare, at which loss scale and why that one, wrapped."""
    comparison, dtype = _scale_text(report.comparison_scale), report.compute_dtype
    if report.comparison_scale < report.loss_scale:
        why = (f"the largest power of two below {_scale_text(report.loss_scale)} at which {dtype} holds "
               f"every 16-bit gradient with {COMPARISON_MARGIN_BITS} doubling to spare")
    else:
        why = "the loss scale examined"
    eps = DtypeRange.of(dtype).eps
    return textwrap.wrap(
        f"mixed zero, abs.err, rel.err: the mixed pass at loss scale {comparison}, {why}. mixed zero: "
        "zero in the mixed pass. abs.err: ||mixed gradient - float32 gradient||, over the variable's "
        "values in every micro-batch; inf where the mixed gradient was inf or NaN. rel.err: abs.err / "
        "||float32 gradient||, or - where the float32 gradient is zero or its own rounding noise: "
        f"recomputed at loss scale {NOISE_SCALE:g} it moves by at least {dtype}'s eps, "
        f"2^{math.log2(eps):.0f}, of its norm.", width=100)


def _advice_lines(report: PrecisionReport) -> list[str]:
    advice = report.advice
    if advice.float32_layers:
        keep = f"{', '.join(advice.float32_layers)} (added to precision.float32_layers)"
    else:
        keep = "nothing more"
    if advice.initial_scale is None:
        scale = _no_scale_text(report)
    else:
        whose = f" of objective {report.objective!r}" if len(report.objectives) > 1 else ""
        scale = (f"{_scale_text(advice.initial_scale)}: the largest gradient{whose} left in float16, "
                 f"{_number(advice.largest_gradient)}, stays {MARGIN_BITS} or more doublings below "
                 f"{DtypeRange.of('float16').max_finite:g} (above {DEFAULT_INITIAL_SCALE:g} only "
                 "where the gradients underflow there), and "
                 f"{_percent(advice.initial_scale_zero_fraction)} of gradients flush to zero")
    bfloat16 = (f"{'safe' if advice.bfloat16_safe else 'not safe'}: its largest 16-bit value keeps "
                f"{_bits(advice.bfloat16_headroom_bits)} doublings of headroom and "
                f"{_percent(advice.bfloat16_zero_fraction)} of gradients flush to zero without a loss "
                "scale (but it keeps 8 significant bits to float16's 11)")
    lines = [f"  keep in float32:  {keep}", f"  initial scale:    {scale}",
             f"  mixed_bfloat16:   {bfloat16}"]
    if advice.float8:
        lines += _float8_advice_lines(advice.float8)
    if advice.overrides:
        lines.append("  to apply:         " + " ".join(
            shlex.quote(f"--config.{key}={value}") for key, value in advice.overrides.items()))
    if advice.initial_scale is not None and len(report.objectives) > 1:
        lines += _shared_scale_note(report)
    return lines


def _no_scale_text(report: PrecisionReport) -> str:
    """Why no initial scale is advised: bfloat16 needs none; in float16 the probed gradients left in
    float16 were all zero, which measures no scale (it never means float16 needs none)."""
    if report.compute_dtype != "float16":
        return f"not needed: {report.compute_dtype} has float32's exponent range"
    return ("none measured: no gradient left in float16 is nonzero in the probed batches, so no "
            "scale can be read from them; keep the dynamic loss scale's default start")


def _float8_advice_lines(advice: Float8Advice) -> list[str]:
    """Which layers stay in 16 bits and why, and the setting that trains the rest in FP8 (it takes
    the layers to quantize, so its regex names those that fit)."""
    if advice.unfit:
        text = (f"{', '.join(advice.unfit)} (backward flushes more than {_percent(FLUSH_TOLERANCE)} "
                "or forward saturates); ")
    else:
        text = "none; "
    if advice.regex:
        text += (f"to train the layers that fit in FP8: "
                 f"--config.precision.float8_layers={shlex.quote(advice.regex)}")
    else:
        text += "no layer fits FP8" if advice.unfit else "every layer training in FP8 fits"
    return textwrap.wrap(text, width=100, break_long_words=False, break_on_hyphens=False,
                         initial_indent="  FP8, keep 16-bit: ", subsequent_indent=" " * 20)


def _shared_scale_note(report: PrecisionReport) -> list[str]:
    """Why the advised initial scale, one objective's, is not simply applied with several objectives:
    config.precision starts every objective's loss scale; the note says how to give it its own."""
    own = {key.partition(".")[2]: value for key, value in report.advice.overrides.items()
           if key in ("precision.initial_scale", "precision.max_scale", "precision.min_scale")}
    arguments = ", ".join(f"{key}={value!r}" for key, value in own.items())
    return textwrap.wrap(
        f"config.precision starts the loss scale of every objective ({', '.join(report.objectives)}) "
        f"that build_objectives gives none of its own, so this scale, advised for {report.objective!r} "
        "alone, would start the others too: apply the smallest the reports advise, or give "
        f"{report.objective!r} a loss scale of its own, mixloop.Objective(..., "
        f"loss_scale=mixloop.DynamicLossScale({arguments})).", width=100,
        initial_indent="  shared scale:     ", subsequent_indent=" " * 20)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
        return "  ".join(cells).rstrip()

    return [line(header)] + [line(row) for row in rows]


def _number(value: float) -> str:
    return "0" if value == 0 else f"{value:.2e}"


def _bits(value: float) -> str:
    return f"{value:.1f}"


def _percent(fraction: float) -> str:
    if 0 < fraction < 0.001:
        return "<0.1%"
    return f"{fraction:.1%}"


def _scale_text(scale: float) -> str:
    exponent = math.log2(scale)
    return f"2^{exponent:.0f} = {scale:g}" if exponent.is_integer() else f"{scale:g}"


# ----- The memory section. -----


def format_memory(current: PersistentState, options: list[LighterOption]) -> str:
    """The run's persistent state (its start line) and what each lighter storage setting would make
    it, as console text: one line a setting, then all of them together and the flags to apply."""
    lines = ["Memory: the persistent state, and what each lighter storage setting would make it.",
             *textwrap.wrap(
                 "Bytes counted from the variables' shapes, not accuracy measured: the doctor does not "
                 f"train with these settings. int8 moments keep float32 for tensors under "
                 f"{MIN_QUANTIZED_SIZE:,} values and for embedding tables. What each costs and how it "
                 "keeps float32's results: docs/memory.md.", width=100),
             f"  {current.describe()}"]
    single = [option for option in options if len(option.settings) == 1]
    together = [option for option in options if len(option.settings) > 1]
    width = max([len(_flags(option.settings)) + 1 for option in single], default=0)
    lines += [f"  {_flags(option.settings) + ':':<{width}} {_saving_text(current, option)}"
              for option in single]
    for option in together:
        lines += [f"  {'all together:':<{width}} {_total_text(current, option.state)}",
                  f"  {'to apply:':<{width}} {_flags(option.settings)}"]
    if not options:
        lines.append("  nothing lighter: every storage setting this run can take is on")
    return "\n".join(lines)


def _saving_text(current: PersistentState, option: LighterOption) -> str:
    """'optimizer state 8.00 -> 2.05 B/param (saves 5.95); 10.05 B/param in all = 1.23 MB', and
    the settings it needs first."""
    [key] = option.settings
    part = LIGHTER_PARTS[key]
    before, after = current.per_parameter()[part], option.state.per_parameter()[part]
    text = (f"{part} {before:.2f} -> {after:.2f} B/param (saves {before - after:.2f}); "
            f"{_per_parameter(option.state):.2f} B/param in all = {format_bytes(option.state.total_bytes)}")
    if option.needs:
        text += f"; needs {_flags(option.needs)}"
    return text


def _total_text(current: PersistentState, state: PersistentState) -> str:
    """'16.00 -> 6.05 B/param (saves 9.95) = 1.23 MB'."""
    before, after = _per_parameter(current), _per_parameter(state)
    return (f"{before:.2f} -> {after:.2f} B/param (saves {before - after:.2f}) = "
            f"{format_bytes(state.total_bytes)}")


def _per_parameter(state: PersistentState) -> float:
    return sum(state.per_parameter().values())


def _flags(settings: dict[str, str]) -> str:
    return " ".join(shlex.quote(f"--config.{key}={value}") for key, value in settings.items())


# ----- Files: JSON, TensorBoard, PNG. -----


def write_outputs(report: PrecisionReport, directory: str) -> list[str]:
    """Writes report.json, TensorBoard histograms and (with matplotlib) gradient_histogram.png into
    `directory`; returns the paths written."""
    os.makedirs(directory, exist_ok=True)
    paths = [write_json(report, os.path.join(directory, "report.json")),
             write_tensorboard(report, directory)]
    png = os.path.join(directory, "gradient_histogram.png")
    if write_histogram_png(report, png):
        paths.append(png)
    return paths


def write_tensorboard(report: PrecisionReport, directory: str) -> str:
    """Histograms at the report's step: `log2_gradient/<variable>` for each variable, and the 16-bit
    variables together before and after loss scaling (`log2_gradient_16bit/unscaled`, `.../scaled`)."""
    writer = tf.summary.create_file_writer(directory)
    with writer.as_default():
        for variable in report.variables:
            _write_log2_histogram(f"log2_gradient/{variable.path}", variable.histogram, report.step)
        histogram = report.gradient_histogram()
        _write_log2_histogram("log2_gradient_16bit/unscaled", histogram, report.step)
        _write_log2_histogram("log2_gradient_16bit/scaled", histogram, report.step,
                              shift=math.log2(report.loss_scale))
    writer.close()
    return directory


def _write_log2_histogram(tag: str, histogram: dict[int, int], step: int, shift: float = 0.0) -> None:
    """A TensorBoard histogram whose buckets are exactly the log2 bins [k, k + 1), moved by `shift`.

    Written as the histogram plugin's (left edge, right edge, count) rows: `tf.summary.histogram`
    spreads a bucket count evenly over the data's range, so its edges would miss the powers of two.
    """
    if not histogram:
        return
    rows = [[k + shift, k + 1 + shift, histogram.get(k, 0)]
            for k in range(min(histogram), max(histogram) + 1)]
    tf.summary.write(tag, tf.constant(rows, tf.float64), step=step,
                     metadata=histogram_metadata.create_summary_metadata(tag, "log2 |gradient| bins"))


def write_histogram_png(report: PrecisionReport, path: str) -> bool:
    """Plots the 16-bit gradients' log2 histogram before and after loss scaling, with float16's and
    bfloat16's subnormal and normal ranges. Without matplotlib: a one-line warning, and False."""
    try:
        from matplotlib.figure import Figure  # The object API needs no GUI backend.
    except ImportError:
        print("warning: matplotlib is not installed, so no gradient_histogram.png "
              "(pip install -e '.[plot]')", file=sys.stderr)
        return False
    histogram = report.gradient_histogram()
    exponents, counts = np.array(list(histogram), float), list(histogram.values())
    figure = Figure(figsize=(10, 6), layout="constrained")
    axes = figure.subplots(2, 1, sharex=True)
    panels = ((0.0, "before loss scaling"),
              (math.log2(report.loss_scale), f"after loss scaling by {_scale_text(report.loss_scale)}"))
    float16, bfloat16 = DtypeRange.of("float16"), DtypeRange.of("bfloat16")
    for ax, (shift, title) in zip(axes, panels):
        ax.axvspan(math.log2(float16.min_subnormal), math.log2(float16.min_normal), color="tab:orange",
                   alpha=0.12, label="float16 subnormal [2^-24, 2^-14)")
        ax.axvspan(math.log2(float16.min_normal), math.log2(float16.max_finite), color="tab:orange",
                   alpha=0.3, label="float16 normal [2^-14, 65504]")
        ax.axvline(math.log2(bfloat16.min_subnormal), color="tab:blue", linestyle=":",
                   label="bfloat16 smallest subnormal 2^-133")
        ax.axvline(math.log2(bfloat16.min_normal), color="tab:blue", linestyle="--",
                   label="bfloat16 normal [2^-126, 3.39e38]")
        ax.axvline(math.log2(bfloat16.max_finite), color="tab:blue", linestyle="--")
        ax.bar(exponents + shift, counts, width=1.0, align="edge", color="black",
               label="gradient values")
        ax.set(yscale="log", xlim=(-140, 132), ylabel="values per bin",
               title=f"{report.trainer}{_objective_text(report)}, step {report.step}: 16-bit "
                     f"gradients {title}")
    axes[-1].set_xlabel("log2 |gradient|")
    axes[0].legend(loc="upper left", fontsize="small")
    figure.savefig(path, dpi=120)
    return True


# ----- The command. -----


def output_directory(report: PrecisionReport, output: str) -> str:
    """Where --output=`output` puts the report's files: `output`, or with several objectives its
    subdirectory named for the report's objective."""
    return output if len(report.objectives) == 1 else os.path.join(output, report.objective)


def main() -> None:
    config, workdir = cli.experiment_from_flags()
    if _OUTPUT.value:
        cli.check_output(_OUTPUT.value, folder=True)  # Before the work, not after it.
    run = restored_run(config, workdir)
    interrupts.unwind_from_here()  # Built, imports done: the work's cleanup runs on a signal.
    reports = diagnose_run(run, _STEPS.value, _LOSS_SCALE.value, _OBJECTIVE.value)
    memory_text = format_memory(memory.persistent_state(run), memory.lighter_options(run))
    print("\n\n".join([*(format_report(report) for report in reports), memory_text]))
    if _OUTPUT.value:
        for report in reports:
            try:
                written = write_outputs(report, output_directory(report, _OUTPUT.value))
            except (OSError, tf.errors.ResourceExhaustedError) as error:  # The disk filled since.
                raise UserError(f"cannot write --output={_OUTPUT.value}: {error_reason(error)}; "
                                f"{making_room(nearest_existing(_OUTPUT.value), '--output')}"
                                ) from None
            logging.info("Wrote %s", ", ".join(written))

