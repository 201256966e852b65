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

import dataclasses
import functools
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Optional

import keras
import ml_collections
import tensorflow as tf
from absl import flags, logging

from mixloop import cli, interrupts
from mixloop.config import AUTO, split_auto, validate
from mixloop.engine import float8_layers, layer_precision, tracing
from mixloop.engine.loss import Loss, as_loss, as_losses
from mixloop.engine.loss_scale import DynamicLossScale, NoLossScale
from mixloop.engine.step import forward
from mixloop.errors import UserError
from mixloop.runner import compile_mode, memory, precision_setup

REPEATS, QUICK_REPEATS = 5, 3
QUICK_STEPS_PER_LOOP = 5  # --quick caps train.steps_per_loop (and so the updates per repeat) at this.
ACCUMULATION_STEPS = (1, 2, 4, 8)
OTHER_MODE_ACCUMULATION_STEPS = (1, 2)  # Also timed in the compile modes the run does not use.
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
# The headline ratios, each a median over repeats of (numerator's examples/s / denominator's); a
# policy's ratio to float32 compares each in its fastest compile mode, at the configured accumulation.
POLICY_RATIOS = ("mixed_bfloat16/float32", "mixed_float16/float32")
RATIOS = (*POLICY_RATIOS, "mixloop/keras-fit", "mixloop/keras-fit-tuned", "mixloop/bare",
          "dynamic/none", "k8/k1",
          *(f"k2/k1 {compile_mode.describe(mode)}" for mode in compile_mode.MODES),
          "ema/no-ema", "metric/no-metric", "retries/no-retries", "float8/bfloat16")
# With train.batch_loss, also: the two passes' examples/s over plain accumulation's (their cost's inverse).
BATCH_LOSS_RATIO = "two-passes/plain"
EMA_DECAY = 0.999  # The ema_decay of the EMA variant.
NO_RETRIES = "mixloop overflow_retries=0"  # float16, dynamic scale, no retry loop.
_AUTO_KEYS = {name: mode for mode, name in compile_mode.JSON_NAMES.items()}  # JSON's names.
EXTRA_METRIC = "benchmark_output_mean"  # The +metric variant's train metric.
# Variants that change something besides policy, compile mode, accumulation and loss scale: left out
# of the policy comparisons (the headline and the chart).
# mixed_bfloat16 with every lighter setting (docs/memory.md): bfloat16 weights, int8 moments and
# bfloat16 accumulators; for experiments whose optimizer comes from config.optimizer (adam or adamw).
LIGHTER = "mixloop lighter"
LIGHTER_SETTINGS = {"precision.policy": "mixed_bfloat16", "precision.master_weights": "bfloat16",
                    "optimizer.state_dtype": "int8", "train.accumulation_dtype": "bfloat16"}
# The peak-memory ratios: each 16-bit policy's, and the lighter settings', over float32's.
MEMORY_RATIOS = (*POLICY_RATIOS, "lighter/float32")
SIDE_VARIANTS = ("mixloop ema_decay", "mixloop +metric", "mixloop batch_loss", NO_RETRIES, LIGHTER)
FLOAT8_NAME = "float8_layers=auto"  # In the names of the float8 variants.


@dataclasses.dataclass
class Variant:
    """One way of training, and the seconds each timed repeat of it took."""

    name: str
    policy: str  # Keras policy name.
    accumulation_steps: int
    loss_scale: str  # The scale in effect: "dynamic", "none" or the static value.
    xla: compile_mode.Mode  # How the update is compiled: XLA (True), graph (False), "elementwise".
    batch_loss: bool  # Whether the loss is on the whole batch (train.batch_loss: two passes).
    float8: bool  # Whether some layers train in FP8 (precision.float8_layers).
    run_fn: Callable[[], None] = dataclasses.field(repr=False)  # One repeat, finished on the device.
    seconds: list[float] = dataclasses.field(default_factory=list)
    peak_bytes: Optional[int] = None  # Its peak memory, measured in a process of its own.


# ----- The variants. -----


def fixed_batches(trainer, num_batches: int) -> tf.data.Dataset:
    """The first `num_batches` train batches, held in memory: every variant trains on these.

    tf.data's autotuning is off: batches in memory have nothing to tune, and `fit` makes a new
    iterator every epoch (here, every repeat), whose deletion waits for the tuning thread to wake,
    which adds 1 to 5 seconds to an epoch of 50 updates on a 2-core VM.
    """
    iterator = trainer.make_train_iterator(0)
    batches = [next(iterator) for _ in range(num_batches)]
    options = tf.data.Options()
    options.autotune.enabled = False
    stacked = tf.nest.map_structure(lambda *t: tf.stack(t), *batches)
    return tf.data.Dataset.from_tensor_slices(stacked).with_options(options)


def _with_clipping(optimizer: keras.optimizers.Optimizer, clip_global_norm: float):
    """The optimizer, clipping the gradient's global norm as the train step does (0: not at all)."""
    optimizer.global_clipnorm = clip_global_norm or None
    return optimizer


def _keras_loss(trainer, target_dtype: tf.DType) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """The experiment's `compute_loss` as a Keras loss, for batches of `(inputs, targets)`.

    Keras hands a loss function its targets cast to the outputs' dtype; they go back to the data's
    dtype (integer labels) before `compute_loss` reads them."""

    def loss(targets, outputs):
        batch = (None, tf.cast(targets, target_dtype))
        loss = as_loss(trainer.compute_loss(tf.cast(outputs, tf.float32), batch))
        return loss.value / loss.weight

    return loss


def without_keras(trainer, data: tf.data.Dataset) -> str:
    """Why `model.fit` and the bare loop cannot train this experiment as it is ('' when they can):
    they take one loss of `(inputs, targets)` batches."""
    if len(trainer.objectives) > 1:
        return f"{len(trainer.objectives)} objectives (one loss each)"
    if trainer.config.train.batch_loss:
        return "a loss over the whole batch of all outputs (train.batch_loss), not one per output"
    if not (isinstance(data.element_spec, tuple) and len(data.element_spec) == 2):
        return f"train batches that are not (inputs, targets) pairs ({data.element_spec})"
    return ""


def keras_fit_variant(trainer, data: tf.data.Dataset, *, tuned: bool) -> Variant:
    """`model.fit` as the Keras mixed-precision guide writes it; `tuned` adds XLA and
    steps_per_execution. One repeat is one epoch of `data` (of `(inputs, targets)` batches)."""
    config, policy = trainer.config, trainer.policy
    with layer_precision.building_under(policy):
        model = trainer.build_model()
    optimizer = _with_clipping(trainer.build_optimizer(), config.train.clip_global_norm)
    float16 = policy.compute_dtype == tf.float16
    if float16:
        optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
    tuning = dict(jit_compile=True, steps_per_execution=config.train.steps_per_loop) if tuned else {}
    model.compile(optimizer=optimizer, loss=_keras_loss(trainer, data.element_spec[1].dtype),
                  **tuning)
    epoch = data.prefetch(tf.data.AUTOTUNE)
    return Variant("keras-fit-tuned" if tuned else "keras-fit", policy.keras_name, 1,
                   "dynamic" if float16 else "none", model.jit_compile, False,
                   bool(float8_layers.float8_paths(model)),
                   lambda: model.fit(epoch, verbose=0))


def bare_variant(trainer, data: tf.data.Dataset, jit_compile: compile_mode.Mode,
                 name: str = "bare") -> Variant:
    """The least any framework does: forward, loss, gradient, clipping, update, in a tf.function
    loop, the step compiled in mode `jit_compile`."""
    config, policy = trainer.config, trainer.policy
    model = layer_precision.build_model(trainer.build_model, policy,
                                        split_auto(config.precision.float32_layers)[1])
    optimizer = _with_clipping(trainer.build_optimizer(), config.train.clip_global_norm)

    @tf.function(jit_compile=compile_mode.step_with_xla(jit_compile))
    def step(batch):
        with tf.GradientTape() as tape:
            outputs = forward(model, policy, trainer.model_inputs(batch), training=True)
            loss = as_loss(trainer.compute_loss(outputs, batch))
            loss = loss.value / loss.weight
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    @tf.function
    def loop(iterator, num_steps):
        loss = tf.constant(0.0)
        for _ in tf.range(num_steps):
            loss = step(next(iterator))
        return loss

    iterator = iter(data.repeat().prefetch(tf.data.AUTOTUNE))
    num_steps = tf.constant(config.train.steps_per_loop)

    def run() -> None:
        with compile_mode.calls_in(jit_compile):
            loop(iterator, num_steps).numpy()

    return Variant(name, policy.keras_name, 1, "none", jit_compile, False, False, run)


def _with_data(trainer_class: type, data: tf.data.Dataset) -> type:
    """A subclass of `trainer_class` that trains on `data` and has no eval data."""

    def build_datasets(self):
        return data, None

    return type(f"Benchmark{trainer_class.__name__}", (trainer_class,), {"build_datasets": build_datasets})


def mixloop_variant(name: str, config: ml_collections.ConfigDict, trainer_class: type,
                    data: tf.data.Dataset, workdir: str) -> Variant:
    """`trainer_class` on `data`, its compiled inner loop called as the outer loop calls it: one call
    of steps_per_loop updates, then its totals read back to the host."""
    trainer = _with_data(trainer_class, data)(config, workdir)

    def run() -> None:
        trainer.train_loop(config.train.steps_per_loop)  # Totals read back, as the outer loop does.

    return Variant(name, *_settings(config), run)


def _settings(config: ml_collections.ConfigDict) -> tuple[str, int, str, Any, bool, bool]:
    """(policy, accumulation_steps, loss scale in effect, XLA: True, False or "auto", batch_loss,
    float8) of a one-replica config: what tells two runs apart."""
    policy, _ = precision_setup.make_policy(config.precision.policy)
    scale = precision_setup.make_loss_scale(config.precision, policy)
    if isinstance(scale, (DynamicLossScale, NoLossScale)):
        scale_name = "dynamic" if isinstance(scale, DynamicLossScale) else "none"
    else:
        scale_name = f"{float(scale.scale):g}"
    return (policy.keras_name, config.train.accumulation_steps, scale_name, config.jit_compile,
            config.train.batch_loss, bool(config.precision.float8_layers))


def _float16_policy(config: ml_collections.ConfigDict) -> str:
    """The configured policy if it computes in float16, else mixed_float16: where loss scales matter."""
    policy, _ = precision_setup.make_policy(config.precision.policy)
    return policy.keras_name if policy.compute_dtype == tf.float16 else "mixed_float16"


def mixloop_configs(config: ml_collections.ConfigDict) -> dict[str, ml_collections.ConfigDict]:
    """The configured run as "mixloop", then each variation "mixloop KEY=VALUE ..." that differs
    from every earlier one.

    Raises:
      UserError: naming the variation, when one is not a valid config (e.g. accumulation_steps=8
        does not divide the batch size).
    """
    float16 = _float16_policy(config)
    other_modes = _other_modes(config)
    changes = [{"train.accumulation_steps": k} for k in ACCUMULATION_STEPS]
    changes += [{"train.accumulation_steps": k, "jit_compile": m}
                for m in other_modes for k in OTHER_MODE_ACCUMULATION_STEPS]
    changes += [{"precision.policy": p, "jit_compile": m} for p in POLICIES
                for m in compile_mode.MODES]
    changes += [{"precision.policy": float16, "precision.loss_scale": s} for s in ("dynamic", "none")]
    changes += [{"jit_compile": m} for m in other_modes]
    changes += [{"train.batch_loss": False}]  # Plain accumulation beside the two passes.
    # FP8 in each 16-bit policy, and without it (new only when the configured run has FP8).
    changes += [{"precision.policy": p, "precision.float8_layers": layers}
                for p in POLICIES[1:] for layers in (AUTO, "")]
    configs, seen = {"mixloop": config}, [_settings(config)]
    for change in changes:
        changed = _changed(config, change)
        name = "mixloop " + " ".join(f"{key.split('.')[-1]}={value}" for key, value in change.items()
                                     if _value(changed, key) != _value(config, key))
        try:
            validate(changed)
        except UserError as error:
            raise UserError(f"the benchmark's variant {name!r} does not fit this config: {error}"
                            ) from None
        if _settings(changed) not in seen:
            configs[name] = changed
            seen.append(_settings(changed))
    return configs


def _other_modes(config: ml_collections.ConfigDict) -> list[compile_mode.Mode]:
    """The compile modes other than the configured one (all three for "auto"), XLA first."""
    return [mode for mode in compile_mode.MODES if mode != config.jit_compile]


def _holder(config: ml_collections.ConfigDict, key: str) -> tuple[ml_collections.ConfigDict, str]:
    """(the section of `config` that holds the "section.field" `key`, the field's name)."""
    *section, field = key.split(".")
    return (config[section[0]] if section else config), field


def _value(config: ml_collections.ConfigDict, key: str) -> Any:
    """The value of the "section.field" `key` in `config`."""
    holder, field = _holder(config, key)
    return holder[field]


def _changed(config: ml_collections.ConfigDict, change: dict[str, Any]) -> ml_collections.ConfigDict:
    """A copy of `config` with the "section.field" keys of `change` set."""
    changed = config.copy_and_resolve_references()
    with changed.ignore_type():  # jit_compile: True, False or "auto".
        for key, value in change.items():
            holder, field = _holder(changed, key)
            holder[field] = value
    return changed


def variant_builders(trainer, mixloop_configs: dict[str, ml_collections.ConfigDict],
                     workdir: str) -> dict[str, Callable[[], Variant]]:
    """By name, in the table's order, what builds each variant: keras-fit, keras-fit-tuned, bare in
    each compile mode (the configured one first) and the mixloop variants, all on the same fixed
    batches. Built one by one on demand, so a process measuring one variant's memory builds only
    that one."""
    config, trainer_class = trainer.config, type(trainer)
    data = fixed_batches(trainer, config.train.steps_per_loop)
    reason = without_keras(trainer, data)
    builders: dict[str, Callable[[], Variant]] = {}
    if reason:
        logging.info("No keras-fit and bare variants: this experiment has %s", reason)
    else:
        for tuned in (False, True):
            builders["keras-fit-tuned" if tuned else "keras-fit"] = functools.partial(
                keras_fit_variant, trainer, data, tuned=tuned)
        for mode in [config.jit_compile, *_other_modes(config)]:
            name = "bare" if mode == config.jit_compile else f"bare jit_compile={mode}"
            builders[name] = functools.partial(bare_variant, trainer, data, mode, name=name)
    ema_decay = 0.0 if config.train.ema_decay else EMA_DECAY
    float16 = _changed(config, {"precision.policy": _float16_policy(config),
                                "precision.loss_scale": "dynamic"})
    mixloop_runs = {
        **{name: (changed, trainer_class) for name, changed in mixloop_configs.items()},
        f"mixloop ema_decay={ema_decay:g}": (_changed(config, {"train.ema_decay": ema_decay}),
                                             trainer_class),
        "mixloop +metric": (config, _with_extra_metric(trainer_class)),
        **({LIGHTER: (_changed(config, LIGHTER_SETTINGS), trainer_class)}
           if lighter_fits(trainer_class, config) else {}),
        NO_RETRIES: (_changed(float16, {"precision.overflow_retries": 0}), trainer_class),
    }
    for name, (variant_config, variant_class) in mixloop_runs.items():
        builders[name] = functools.partial(mixloop_variant, name, variant_config, variant_class,
                                           data, workdir)
    return builders


def lighter_fits(trainer_class: type, config: ml_collections.ConfigDict) -> bool:
    """Whether the experiment can take LIGHTER_SETTINGS: its one objective's optimizer comes from
    config.optimizer, and that is adam or adamw (what int8 moments need)."""
    from mixloop.runner.trainer import Trainer  # The benchmark's subject; imported late, as cli does.

    return (config.optimizer.name in ("adam", "adamw")
            and trainer_class.build_objectives is Trainer.build_objectives
            and trainer_class.build_optimizer is Trainer.build_optimizer)


def _with_extra_metric(trainer_class: type) -> type:
    """A subclass of `trainer_class` whose first objective reports one more train metric."""

    def compute_loss(self, outputs, batch):
        losses = as_losses(tracing.hook(trainer_class.compute_loss)(self, outputs, batch),
                           self.objectives)
        first = next(iter(losses))
        extra = tf.reduce_mean(tf.cast(tf.nest.flatten(outputs)[0], tf.float32))
        losses[first] = Loss(losses[first].value, losses[first].weight,
                             {**losses[first].metrics, EXTRA_METRIC: extra})
        return losses if len(losses) > 1 else losses[first]

    return type(f"Metric{trainer_class.__name__}", (trainer_class,), {"compute_loss": compute_loss})


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


def floor_of(variant: Variant, variants: list[Variant]) -> Optional[Variant]:
    """The bare loop compiled as `variant` is (its compile mode); None without bare variants."""
    return next((v for v in variants if v.name.startswith("bare") and v.xla == variant.xla), None)


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
    configured = _settings(configs["mixloop"])
    rows: dict[str, str] = {}
    for name, variant_config in configs.items():
        policy, k, scale, xla, batch_loss, float8 = _settings(variant_config)
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
    policy, k, scale, xla, _, float8 = _settings(config)
    float16 = _float16_policy(config)
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
        "mixloop/bare": (by_name["mixloop"], floor_of(by_name["mixloop"], variants)),
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


# ----- Results: JSON and the table. -----


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
    processor = platform.processor()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            processor = next(line.split(":", 1)[1].strip() for line in cpuinfo
                             if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(processor=processor, cpu_count=os.cpu_count(),
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
        speeds = ", ".join(f"{speed:.0f} {compile_mode.describe(_AUTO_KEYS[key])}"
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


def write_json(report: dict[str, Any], path: str) -> None:
    """Writes `report` to `path` as JSON, making its folder if need be."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, allow_nan=False)
        f.write("\n")


# ----- The chart. -----

MODE_LABELS = {True: "XLA", False: "graph", compile_mode.ELEMENTWISE: "elementwise"}  # Its groups.
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
            seconds.setdefault((MODE_LABELS[row["xla"]], policy), row["seconds"])
    float32 = min((s for (_, policy), s in seconds.items() if policy == "float32"),
                  key=statistics.median)
    speeds: dict[str, dict[str, float]] = {label: {} for label in MODE_LABELS.values()}
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
    if not auto or MODE_LABELS[auto["mode"]] != mode:
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
        if trainer.strategy.num_replicas_in_sync != 1:
            raise UserError(f"the benchmark times one device, but config.distribution="
                            f"{config.distribution!r} gives {trainer.strategy.num_replicas_in_sync} "
                            "replicas; set --config.distribution=one_device")
        auto = None
        if config.jit_compile == AUTO:
            logging.info("Timing the compile modes as a run's jit_compile=auto does...")
            probe = compile_mode.measure(trainer)
            auto = dict(mode=compile_mode.fastest(probe.speeds), probe_seconds=round(probe.seconds, 1),
                        examples_per_sec={key: round(probe.speeds[mode], 1)
                                          for key, mode in _AUTO_KEYS.items()})
            config = _changed(config, {"jit_compile": auto["mode"]})
            trainer.config = config
            trainer.set_jit_compile(auto["mode"])
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
        write_json(report, options.output)
        written = [options.output]
        if plot(report, chart_path(options.output)):
            written.append(chart_path(options.output))
        logging.info("Wrote %s", ", ".join(written))
    # Python's last garbage collection, at exit, would spend longer deleting the traced functions
    # than --quick spends timing them (20 s for charlm); the process is ending anyway.
    gc.freeze()

