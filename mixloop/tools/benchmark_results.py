"""The benchmark's results: the ratios between variants, the JSON, the Markdown table and the chart."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from typing import Any, Optional

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mixloop import machine
from mixloop.doctor import memory
from mixloop.runner import compile_mode
from mixloop.tools.benchmark_variants import (FLOAT8_NAME, LIGHTER, NO_RETRIES, POLICIES, Variant,
                                              float16_policy, mixloop_configs, settings_of)


# The headline ratios, each a median over repeats of (numerator's examples/s / denominator's); a
# policy's ratio to float32 compares each in its fastest compile mode, at the configured accumulation.
POLICY_RATIOS = ("mixed_bfloat16/float32", "mixed_float16/float32")


RATIOS = (*POLICY_RATIOS, "mixloop/keras-fit", "mixloop/keras-fit-tuned", "mixloop/bare",
          "dynamic/none", "k8/k1",
          *(f"k2/k1 {compile_mode.describe(mode)}" for mode in compile_mode.MODES),
          "ema/no-ema", "metric/no-metric", "retries/no-retries", "float8/bfloat16")


# With train.batch_loss, also: the two passes' examples/s over plain accumulation's (their cost's inverse).
BATCH_LOSS_RATIO = "two-passes/plain"


# The peak-memory ratios: each 16-bit policy's, and the lighter settings', over float32's.
MEMORY_RATIOS = (*POLICY_RATIOS, "lighter/float32")


SIDE_VARIANTS = ("mixloop ema_decay", "mixloop +metric", "mixloop batch_loss", NO_RETRIES, LIGHTER)


def floor_of(variant: Variant, variants: list[Variant]) -> Optional[Variant]:
    """The bare loop compiled as `variant` is (its compile mode); None without bare variants."""
    return next((v for v in variants if v.name.startswith("bare") and v.xla == variant.xla), None)


def like_for_like_bare(variants: list[Variant], config: ml_collections.ConfigDict
                       ) -> tuple[Variant, Optional[Variant]]:
    """(mixloop at one micro-batch in the configured policy, loss scale and compile mode, the bare
    loop in that mode): the bare loop takes the whole batch at once, so the configured run's
    micro-batches would count accumulation against mixloop."""
    policy, _, scale, xla, _, _ = settings_of(config)
    one_micro_batch = _find(variants, policy=policy, accumulation_steps=1, loss_scale=scale, xla=xla)
    return one_micro_batch, floor_of(one_micro_batch, variants)


def fastest_mode(variants: list[Variant], **wanted: Any) -> Variant:
    """Of the mixloop variants with the `wanted` fields, in each compile mode, the fastest (by median
    seconds)."""
    matching = [v for v in variants if v.name.startswith("mixloop")
                and not v.name.startswith(SIDE_VARIANTS)
                and all(getattr(v, key) == value for key, value in wanted.items())]
    return min(matching, key=lambda v: statistics.median(v.seconds))


def pairwise_ratio(numerator: Optional[Variant], denominator: Optional[Variant]) -> Optional[float]:
    """Median over repeats of numerator's examples/s over denominator's, both from the same repeat
    (None when either was not timed)."""
    if numerator is None or denominator is None:
        return None
    return _median_ratio(numerator.seconds, denominator.seconds)


def _median_ratio(numerator_seconds: list[float], denominator_seconds: list[float]) -> float:
    """Median over repeats of the speed ratio, from each repeat's seconds (a speed is 1 / seconds)."""
    return statistics.median(d / n for n, d in zip(numerator_seconds, denominator_seconds))


def _find(variants: list[Variant], **wanted: Any) -> Variant:
    """The mixloop variant whose fields equal `wanted`."""
    return next(v for v in variants if v.name.startswith("mixloop")
                and all(getattr(v, key) == value for key, value in wanted.items()))


def _starting(variants: list[Variant], prefix: str) -> Variant:
    return next(v for v in variants if v.name.startswith(prefix))


def _ordered(a: Variant, b: Variant, *, first_is_on: bool) -> tuple[Variant, Variant]:
    """(the variant with the feature on, the one without it)."""
    return (a, b) if first_is_on else (b, a)


def policy_rows(configs: dict[str, ml_collections.ConfigDict]) -> dict[str, str]:
    """Per policy of POLICIES, the mixloop variant of `configs` (`mixloop_configs`) that differs
    from the configured run ("mixloop") in its policy alone, float16 under its dynamic scale: what
    the memory ratios compare, and the variants --quick measures the memory of."""
    configured = settings_of(configs["mixloop"])
    rows: dict[str, str] = {}
    for name, variant_config in configs.items():
        policy, k, scale, xla, batch_loss, float8 = settings_of(variant_config)
        if ((k, xla, batch_loss, float8) == (configured[1], *configured[3:])
                and (policy != "mixed_float16" or scale == "dynamic")):
            rows.setdefault(policy, name)
    return rows


def memory_ratios(variants: list[Variant], config: ml_collections.ConfigDict
                  ) -> dict[str, Optional[float]]:
    """For each ratio of MEMORY_RATIOS, the policy's (or the lighter settings') peak memory over
    float32's, all in the configured run's compile mode and accumulation (`policy_rows`); None
    where a peak was not measured, or the experiment has no lighter variant."""
    peaks = {v.name: v.peak_bytes for v in variants}
    rows = {**policy_rows(mixloop_configs(config)), "lighter": LIGHTER}
    ratios = {}
    for ratio in MEMORY_RATIOS:
        numerator, denominator = (peaks.get(rows[policy]) for policy in ratio.split("/"))
        ratios[ratio] = numerator / denominator if numerator and denominator else None
    return ratios


def headline_ratios(variants: list[Variant], config: ml_collections.ConfigDict) -> dict[str, float]:
    """The ratios of RATIOS (and BATCH_LOSS_RATIO with train.batch_loss), keyed by name."""
    by_name = {v.name: v for v in variants}
    policy, k, scale, xla, _, float8 = settings_of(config)
    float16 = float16_policy(config)
    every_variant = variants
    # Every ratio but float8's compares variants that train in FP8 as the configured run does.
    variants = [v for v in variants if v.float8 == float8]
    best = {name: fastest_mode(variants, policy=name, accumulation_steps=k,
                               **({"loss_scale": "dynamic"} if name == "mixed_float16" else {}))
            for name in POLICIES}
    pairs = {
        **{ratio: (best[ratio.split("/")[0]], best["float32"]) for ratio in POLICY_RATIOS},
        "mixloop/keras-fit": (by_name["mixloop"], by_name.get("keras-fit")),
        "mixloop/keras-fit-tuned": (by_name["mixloop"], by_name.get("keras-fit-tuned")),
        "mixloop/bare": like_for_like_bare(variants, config),
        "dynamic/none": (
            _find(variants, policy=float16, accumulation_steps=k, loss_scale="dynamic", xla=xla),
            _find(variants, policy=float16, accumulation_steps=k, loss_scale="none", xla=xla)),
        "k8/k1": (_find(variants, policy=policy, accumulation_steps=8, loss_scale=scale, xla=xla),
                  _find(variants, policy=policy, accumulation_steps=1, loss_scale=scale, xla=xla)),
        **{f"k2/k1 {compile_mode.describe(mode)}": tuple(
            _find(variants, policy=policy, accumulation_steps=steps, loss_scale=scale, xla=mode)
            for steps in (2, 1)) for mode in compile_mode.MODES},
        "ema/no-ema": _ordered(by_name["mixloop"], _starting(variants, "mixloop ema_decay="),
                               first_is_on=bool(config.train.ema_decay)),
        "metric/no-metric": (by_name["mixloop +metric"], by_name["mixloop"]),
        "retries/no-retries": (_find(variants, policy=float16, accumulation_steps=k,
                                     loss_scale="dynamic", xla=xla), by_name[NO_RETRIES]),
        "float8/bfloat16": tuple(_find(every_variant, policy="mixed_bfloat16", accumulation_steps=k,
                                       xla=xla, float8=on) for on in (True, False)),
        BATCH_LOSS_RATIO: (by_name["mixloop"], by_name.get("mixloop batch_loss=False")),
    }
    names = RATIOS + ((BATCH_LOSS_RATIO,) if config.train.batch_loss else ())
    return {name: pairwise_ratio(*pairs[name]) for name in names}


def results(variants: list[Variant], config: ml_collections.ConfigDict, *, repeats: int,
            quick: bool, auto: Any = None) -> dict[str, Any]:
    """Everything the table shows, as a JSON-ready dict; `auto`: what jit_compile=auto's probe
    measured and picked (None when the config fixed the mode)."""
    batch_size, steps_per_loop = config.train.batch_size, config.train.steps_per_loop
    by_name = {v.name: v for v in variants}
    rows = []
    for v in variants:
        speeds = [steps_per_loop * batch_size / seconds for seconds in v.seconds]
        rows.append(dict(
            name=v.name, policy=v.policy, accumulation_steps=v.accumulation_steps,
            loss_scale=v.loss_scale, xla=v.xla, seconds=[round(s, 4) for s in v.seconds],
            examples_per_sec=dict(median=round(statistics.median(speeds), 1),
                                  min=round(min(speeds), 1), max=round(max(speeds), 1)),
            vs_keras_fit=_rounded(pairwise_ratio(v, by_name.get("keras-fit"))),
            vs_bare=_rounded(pairwise_ratio(v, floor_of(v, variants))),
            peak_bytes=v.peak_bytes,
        ))
    return dict(
        command=" ".join(["python -m mixloop.benchmark", *sys.argv[1:]]),
        trainer=config.trainer,
        machine=_machine(),
        updates_per_repeat=steps_per_loop,
        examples_per_repeat=steps_per_loop * batch_size,
        batch_size=batch_size,
        repeats=repeats,
        quick=quick,
        variants=rows,
        auto_compile_mode=auto,
        ratios={name: _rounded(value) for name, value in headline_ratios(variants, config).items()},
        memory_ratios={name: _rounded(value)
                       for name, value in memory_ratios(variants, config).items()},
    )


def _machine() -> dict[str, Any]:
    """The CPU, core count, load and library versions: what the numbers depend on."""
    return dict(processor=machine.cpu()["model"] or platform.processor(), cpu_count=os.cpu_count(),
                gpus=len(tf.config.list_physical_devices("GPU")),
                load_average=[round(x, 2) for x in os.getloadavg()], python=platform.python_version(),
                tensorflow=tf.__version__, keras=keras.__version__)


def format_table(report: dict[str, Any]) -> str:
    """The results as a Markdown table, with a line saying what was measured and the ratios."""
    machine = report["machine"]
    summary = (f"{report['trainer']}: {report['updates_per_repeat']} updates of {report['batch_size']} "
               f"examples per repeat, {report['repeats']} repeats interleaved, medians; peak "
               f"memory of each variant in a process of its own (its warm-up and one repeat); "
               f"{machine['processor']}, {machine['cpu_count']} cores, TensorFlow "
               f"{machine['tensorflow']}, Keras {machine['keras']}")
    lines = [
        summary,
        "",
        "| variant | policy | accumulation | loss scale | XLA | examples/s | min–max | × keras-fit "
        "| × bare (same mode) | peak memory |",
        "|---|---|--:|---|---|--:|--:|--:|--:|--:|",
    ]
    for row in report["variants"]:
        speed = row["examples_per_sec"]
        xla = {True: "yes", False: "no"}.get(row["xla"], row["xla"])
        lines.append(f"| {row['name']} | {row['policy']} | {row['accumulation_steps']} | "
                     f"{row['loss_scale']} | {xla} | {speed['median']:.0f} | "
                     f"{speed['min']:.0f}–{speed['max']:.0f} | {_shown(row['vs_keras_fit'])} | "
                     f"{_shown(row['vs_bare'])} | {_shown_bytes(row['peak_bytes'])} |")
    ratios, memory_ratio = report["ratios"], report["memory_ratios"]
    headline = ("16-bit vs float32, each in its fastest compile mode: " + ", ".join(
        f"{name.split('/')[0]} {ratios[name]:.2f}x" for name in POLICY_RATIOS)) + (
        "; peak memory vs float32's, all in the configured compile mode: " + ", ".join(
            f"{name.split('/')[0]} {_times(memory_ratio[name])}" for name in MEMORY_RATIOS))
    auto = report.get("auto_compile_mode")
    if auto:
        speeds = ", ".join(f"{speed:.0f} {compile_mode.describe(compile_mode.mode_of_key(key))}"
                           for key, speed in auto["examples_per_sec"].items())
        headline += (f"; jit_compile=auto picks {compile_mode.describe(auto['mode'])} (its probe, "
                     f"examples/s: {speeds}; {auto['probe_seconds']} s)")
    others = ", ".join(f"{name} {_shown(value)}" for name, value in ratios.items()
                       if name not in POLICY_RATIOS)
    return "\n".join(lines + ["", headline, "",
                              f"Ratios (median over repeats of per-repeat ratios): {others}"])


def _rounded(ratio: Optional[float]) -> Optional[float]:
    return None if ratio is None else round(ratio, 3)


def _shown(ratio: Optional[float]) -> str:
    """A ratio as the table prints it: two decimals, or n/a for one that was not timed."""
    return "n/a" if ratio is None else f"{ratio:.2f}"


def _times(ratio: Optional[float]) -> str:
    """A ratio as the headline prints it ('0.83x'), or n/a for one that was not measured."""
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _shown_bytes(num_bytes: Optional[int]) -> str:
    """A peak as the table prints it ('1.92 GB'), or n/a for one that was not measured."""
    return "n/a" if num_bytes is None else memory.format_bytes(num_bytes)


FLOAT8_LABEL = " + float8"  # Added to a policy's label for its float8_layers=auto row.


_COLORS = {"float32": "tab:gray", "mixed_float16": "tab:orange", "mixed_bfloat16": "tab:blue"}


def policy_speeds(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{compile mode: {policy: speed}} from a report's mixloop rows at the configured accumulation
    (float16 under its dynamic scale), a speed being the median over repeats of the row's examples/s
    over float32's in float32's fastest mode (1.0 there). The float8 rows are policies of their own,
    "mixed_bfloat16 + float8", timed in the configured mode only."""
    rows = [row for row in report["variants"]
            if row["name"].startswith("mixloop") and not row["name"].startswith(SIDE_VARIANTS)]
    accumulation = next(row for row in rows if row["name"] == "mixloop")["accumulation_steps"]
    seconds: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        if row["accumulation_steps"] == accumulation and (
                row["policy"] != "mixed_float16" or row["loss_scale"] == "dynamic"):
            policy = row["policy"] + (FLOAT8_LABEL if FLOAT8_NAME in row["name"] else "")
            seconds.setdefault((compile_mode.NAMES[row["xla"]].label, policy), row["seconds"])
    float32 = min((s for (_, policy), s in seconds.items() if policy == "float32"),
                  key=statistics.median)
    speeds: dict[str, dict[str, float]] = {names.label: {} for names in compile_mode.NAMES.values()}
    for policy in [*POLICIES, *(p + FLOAT8_LABEL for p in POLICIES)]:
        for mode in speeds:
            if (mode, policy) in seconds:
                speeds[mode][policy] = _median_ratio(seconds[mode, policy], float32)
    return {mode: by_policy for mode, by_policy in speeds.items() if by_policy}


def plot(report: dict[str, Any], path: str) -> Optional[dict[str, dict[str, float]]]:
    """Draws `policy_speeds(report)` as grouped bars (a group per compile mode, a bar per policy, a
    dashed line at float32's 1.0) into the PNG `path`, from the JSON report alone:
    `plot(json.load(open("speed.json")), "speed.png")`. Returns the bar heights; without matplotlib,
    one warning line naming the install command, and None."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logging.warning("matplotlib is not installed, so no %s (pip install -e '.[plot]')", path)
        return None
    speeds = policy_speeds(report)
    figure = Figure(figsize=(9, 5), layout="constrained")
    FigureCanvasAgg(figure)  # Agg: a PNG without a display.
    ax = figure.subplots()
    width = 0.8 / max(len(by_policy) for by_policy in speeds.values())
    labelled = set()
    for group, by_policy in enumerate(speeds.values()):
        for index, (policy, speed) in enumerate(by_policy.items()):
            x = group + (index - (len(by_policy) - 1) / 2) * width
            float8 = policy.endswith(FLOAT8_LABEL)
            bar = ax.bar(x, speed, width * 0.9, color=_COLORS[policy.removesuffix(FLOAT8_LABEL)],
                         alpha=0.45 if float8 else 1.0, hatch="//" if float8 else None,
                         edgecolor="black", linewidth=0.5,
                         label=None if policy in labelled else policy)
            labelled.add(policy)
            ax.bar_label(bar, [f"{speed:.2f}"], fontsize="small", padding=2)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, zorder=0)
    ax.set_xticks(range(len(speeds)), [_group_label(report, mode) for mode in speeds])
    ax.set_ylabel("examples/s ÷ float32's in its fastest mode")
    ax.margins(y=0.12)
    figure.legend(loc="outside lower center", ncols=len(labelled), fontsize="small", frameon=False)
    ax.set_title(_chart_title(report), fontsize="medium")
    figure.savefig(path, dpi=120)
    return speeds


def _group_label(report: dict[str, Any], mode: str) -> str:
    """The compile mode, and whether jit_compile=auto picked it for the configured policy."""
    auto = report.get("auto_compile_mode")
    if not auto or compile_mode.NAMES[auto["mode"]].label != mode:
        return mode
    policy = next(row for row in report["variants"] if row["name"] == "mixloop")["policy"]
    return f"{mode}\n(jit_compile=auto's pick for {policy})"


def _chart_title(report: dict[str, Any]) -> str:
    """The experiment, the batch, the repeats and the CPU."""
    experiment = report["trainer"].rsplit(".", 1)[0].rsplit(".", 1)[-1]
    machine = report["machine"]
    return (f"{experiment}: training speed per policy and compile mode (batch "
            f"{report['batch_size']}, median of {report['repeats']} repeats)\n"
            f"{machine['processor']}, {machine['cpu_count']} cores")

