"""The benchmark's variants: the same updates on the same batches done several ways (keras-fit, the
bare loop, mixloop and its variations), each built on demand (tools/benchmark.py times them)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mixloop.config import AUTO, split_auto, validate
from mixloop.engine import float8_layers, kernels, layer_precision
from mixloop.engine.loss import as_loss
from mixloop.engine.loss_scale import DynamicLossScale, NoLossScale
from mixloop.engine.micro_step import forward
from mixloop.errors import UserError
from mixloop.runner import compile_mode, precision_setup


ACCUMULATION_STEPS = (1, 2, 4, 8)


OTHER_MODE_ACCUMULATION_STEPS = (1, 2)  # Also timed in the compile modes the run does not use.


POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


EMA_DECAY = 0.999  # The ema_decay of the EMA variant.


NO_RETRIES = "mixloop overflow_retries=0"  # float16, dynamic scale, no retry loop.


EXTRA_METRIC = "benchmark_output_mean"  # The +metric variant's train metric.


# Variants that change something besides policy, compile mode, accumulation and loss scale: left out
# of the policy comparisons (the headline and the chart).
# mixed_bfloat16 with every lighter setting (docs/memory.md): bfloat16 weights, int8 moments and
# bfloat16 accumulators; for experiments whose optimizer comes from config.optimizer (adam or adamw).
LIGHTER = "mixloop lighter"


LIGHTER_SETTINGS = {"precision.policy": "mixed_bfloat16", "precision.master_weights": "bfloat16",
                    "optimizer.state_dtype": "int8", "train.accumulation_dtype": "bfloat16"}


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


def fixed_batches(trainer, num_batches: int) -> tf.data.Dataset:
    """The first `num_batches` train batches, held in memory: every variant trains on these.

    tf.data's autotuning is off: batches in memory have nothing to tune, and `fit` makes a new
    iterator every epoch (here, every repeat), whose deletion waits for the tuning thread to wake,
    which adds 1 to 5 seconds to an epoch of 50 updates on a 2-core VM.
    """
    iterator = trainer.run.make_train_iterator(0)
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
    @kernels.used  # The floor of mixloop's own step, with mixloop's kernels (engine/kernels.py).
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


def mixloop_variant(name: str, config: ml_collections.ConfigDict, trainer_class: type,
                    data: tf.data.Dataset, workdir: str, train_metrics: Optional[Callable] = None
                    ) -> Variant:
    """`trainer_class` on `data` (no eval data; with `train_metrics` added, the Trainer's seams),
    its compiled inner loop called as the outer loop calls it: one call of steps_per_loop updates,
    then its totals read back to the host."""
    run = trainer_class(config, workdir, datasets=(data, None), train_metrics=train_metrics).run

    def repeat() -> None:
        run.train_loop(config.train.steps_per_loop)  # Totals read back, as the outer loop does.

    return Variant(name, *settings_of(config), repeat)


def settings_of(config: ml_collections.ConfigDict) -> tuple[str, int, str, Any, bool, bool]:
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


def float16_policy(config: ml_collections.ConfigDict) -> str:
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
    float16 = float16_policy(config)
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
    configs, seen = {"mixloop": config}, [settings_of(config)]
    for change in changes:
        changed = changed_config(config, change)
        name = "mixloop " + " ".join(f"{key.split('.')[-1]}={value}" for key, value in change.items()
                                     if _value(changed, key) != _value(config, key))
        try:
            validate(changed)
        except UserError as error:
            raise UserError(f"the benchmark's variant {name!r} does not fit this config: {error}"
                            ) from None
        if settings_of(changed) not in seen:
            configs[name] = changed
            seen.append(settings_of(changed))
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


def changed_config(config: ml_collections.ConfigDict, change: dict[str, Any]) -> ml_collections.ConfigDict:
    """A copy of `config` with the "section.field" keys of `change` set; bfloat16 master weights,
    which need a policy computing in bfloat16, go back to float32 under another policy."""
    changed = config.copy_and_resolve_references()
    with changed.ignore_type():  # jit_compile: True, False or "auto".
        for key, value in change.items():
            holder, field = _holder(changed, key)
            holder[field] = value
    policy, _ = precision_setup.make_policy(changed.precision.policy)
    if changed.precision.master_weights == "bfloat16" and policy.compute_dtype != tf.bfloat16:
        changed.precision.master_weights = "float32"
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
    float16 = changed_config(config, {"precision.policy": float16_policy(config),
                                "precision.loss_scale": "dynamic"})
    mixloop_runs = {
        **{name: (changed, None) for name, changed in mixloop_configs.items()},
        f"mixloop ema_decay={ema_decay:g}": (changed_config(config, {"train.ema_decay": ema_decay}), None),
        "mixloop +metric": (config, extra_metric),
        **({LIGHTER: (changed_config(config, LIGHTER_SETTINGS), None)}
           if lighter_fits(trainer_class, config) else {}),
        NO_RETRIES: (changed_config(float16, {"precision.overflow_retries": 0}), None),
    }
    for name, (variant_config, train_metrics) in mixloop_runs.items():
        builders[name] = functools.partial(mixloop_variant, name, variant_config, trainer_class,
                                           data, workdir, train_metrics)
    return builders


def lighter_fits(trainer_class: type, config: ml_collections.ConfigDict) -> bool:
    """Whether the experiment can take LIGHTER_SETTINGS: its one objective's optimizer comes from
    config.optimizer, and that is adam or adamw (what int8 moments need)."""
    from mixloop.runner.trainer import Trainer  # The benchmark's subject; imported late, as cli does.

    return (config.optimizer.name in ("adam", "adamw")
            and trainer_class.build_objectives is Trainer.build_objectives
            and trainer_class.build_optimizer is Trainer.build_optimizer)


def extra_metric(outputs: Any, batch: Any) -> dict[str, tf.Tensor]:
    """The +metric variant's train metric: the mean of the model's first output (a reduction over
    the logits, weighted and summed like any metric)."""
    del batch
    return {EXTRA_METRIC: tf.reduce_mean(tf.cast(tf.nest.flatten(outputs)[0], tf.float32))}

