"""Builds the Keras optimizer and learning-rate schedule named by `config.optimizer` (public as
`mixloop.build_optimizer`): Keras's own, or its compact version when the optimizer state or the
weights are stored in fewer bits.

Schedules count optimizer iterations, which the train step advances once per *applied* update, so a
skipped (non-finite) update neither moves the learning rate nor applies weight decay.
"""

from __future__ import annotations

import keras
import ml_collections

from mixloop.engine import compact_optimizer


def learning_rate_schedule(config: ml_collections.ConfigDict, num_steps: int):
    """A float or Keras schedule: `config.schedule` decay over `num_steps` after `config.warmup_steps`."""
    peak, warmup = config.learning_rate, config.warmup_steps
    if config.schedule == "constant" and warmup == 0:
        return peak
    if config.schedule == "cosine":
        return keras.optimizers.schedules.CosineDecay(
            initial_learning_rate=0.0 if warmup else peak,
            decay_steps=max(num_steps - warmup, 1),
            warmup_target=peak if warmup else None,
            warmup_steps=warmup,
        )
    decay_to = 0.0 if config.schedule == "linear" else peak
    return _WarmupThenLinear(peak, warmup, max(num_steps - warmup, 1), decay_to)


class _WarmupThenLinear(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0 to `peak`, then linear change to `end` over `decay_steps`."""

    def __init__(self, peak: float, warmup_steps: int, decay_steps: int, end: float):
        self.peak, self.warmup_steps, self.decay_steps, self.end = peak, warmup_steps, decay_steps, end

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warm = self.peak * step / max(self.warmup_steps, 1)
        progress = keras.ops.clip((step - self.warmup_steps) / self.decay_steps, 0.0, 1.0)
        decayed = self.peak + (self.end - self.peak) * progress
        return keras.ops.where(step < self.warmup_steps, warm, decayed)

    def get_config(self):
        return dict(peak=self.peak, warmup_steps=self.warmup_steps, decay_steps=self.decay_steps,
                    end=self.end)


# optimizer.name: (Keras's class, its compact version).
_CLASSES = {
    "sgd": (keras.optimizers.SGD, compact_optimizer.CompactSGD),
    "momentum": (keras.optimizers.SGD, compact_optimizer.CompactSGD),
    "adam": (keras.optimizers.Adam, compact_optimizer.CompactAdam),
    "adamw": (keras.optimizers.AdamW, compact_optimizer.CompactAdamW),
}


def build_optimizer(config: ml_collections.ConfigDict, *, every_steps: int = 1
                    ) -> keras.optimizers.Optimizer:
    """The optimizer the run's `config.optimizer` names (`mixloop.build_optimizer`), with its
    learning-rate schedule and weight decay: what `Trainer.build_optimizer` returns, and what an
    objective of `Trainer.build_objectives` should get to follow the config.

    Keras's own SGD, Adam or AdamW; their compact versions (`engine.compact_optimizer`: the same
    update in float32, stored in fewer bits) when `optimizer.state_dtype` keeps Adam(W)'s moments
    in bfloat16 or int8, or `precision.master_weights` is bfloat16 (bfloat16 weights updated by
    stochastic rounding).

    The schedule runs over the updates the optimizer will apply: `config.train.num_steps` for an
    objective updated on every step, `num_steps // every_steps` for one updated every
    `every_steps` steps (`mixloop.Objective(..., every_steps=N)`), whose iterations advance only
    then; pass the same `every_steps` to both.

    Raises:
      TypeError: when `config` is not the run's whole config (`self.config`; its `optimizer`
        section alone, or None).
      ValueError: when `config.optimizer.name` is not one of `_CLASSES`, or `every_steps` is not a
        positive integer.
    """
    _check_arguments(config, every_steps)
    learning_rate = learning_rate_schedule(config.optimizer, max(config.train.num_steps // every_steps, 1))
    compact = config.optimizer.state_dtype != "float32" or config.precision.master_weights == "bfloat16"
    config = config.optimizer
    optimizer_class = _CLASSES[config.name][compact]
    decay = config.weight_decay or None
    if config.name in ("sgd", "momentum"):
        return optimizer_class(learning_rate, momentum=config.momentum if config.name == "momentum" else 0.0,
                               weight_decay=decay)
    if config.name == "adamw":
        decay = config.weight_decay  # Keras's AdamW requires a number.
    state = dict(state_dtype=config.state_dtype) if compact else {}
    return optimizer_class(learning_rate, weight_decay=decay, beta_1=config.beta_1, beta_2=config.beta_2,
                           epsilon=config.epsilon, **state)


def _check_arguments(config: object, every_steps: object) -> None:
    """Refuses what `build_optimizer` cannot read, in one line naming the argument and the fix."""
    if not (isinstance(config, ml_collections.ConfigDict) and "optimizer" in config
            and "train" in config):
        given = ("the config.optimizer section" if isinstance(config, ml_collections.ConfigDict)
                 and "learning_rate" in config else f"a {type(config).__name__}")
        raise TypeError(f"mixloop.build_optimizer: config is {given}; pass the run's whole config "
                        "(self.config), whose optimizer section it reads with train.num_steps")
    if config.optimizer.get("name") not in _CLASSES:
        raise ValueError(f"mixloop.build_optimizer: config.optimizer.name="
                         f"{config.optimizer.get('name')!r} is not one it builds: "
                         f"{', '.join(map(repr, _CLASSES))}")
    if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
        raise ValueError(f"mixloop.build_optimizer: every_steps={every_steps!r} is not allowed: a "
                         "positive integer, the every_steps of the objective it updates (1: every step)")
