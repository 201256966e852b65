"""Turns `config.precision` into the engine's objects: the policy (resolving `auto`) and the loss scale."""

from __future__ import annotations

import ml_collections
import tensorflow as tf

from mixloop.config import AUTO, DEFAULT_INITIAL_SCALE, ConfigError, parse_loss_scale
from mixloop.engine.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale, LossScale
from mixloop.engine.policy import Policy


def auto_policy_name() -> tuple[str, str]:
    """The fastest safe policy for the local accelerator, and why it was chosen."""
    if tf.config.list_logical_devices("TPU"):
        return "mixed_bfloat16", "a TPU has native bfloat16"
    capabilities = [
        tf.config.experimental.get_device_details(gpu).get("compute_capability", (0, 0))
        for gpu in tf.config.list_physical_devices("GPU")
    ]
    if capabilities and min(capabilities) >= (8, 0):
        return "mixed_bfloat16", f"GPU compute capability {min(capabilities)} has fast bfloat16"
    if capabilities and min(capabilities) >= (7, 0):
        return "mixed_float16", f"GPU compute capability {min(capabilities)} has float16 Tensor Cores"
    if capabilities:
        return "float32", f"GPU compute capability {min(capabilities)} has no fast 16-bit math"
    return "float32", "no accelerator: on a CPU 16-bit math is no faster than float32"


def make_policy(name: str) -> tuple[Policy, str]:
    """The `Policy` for `precision.policy`, and a sentence saying how it was chosen."""
    if name == "auto":
        chosen, reason = auto_policy_name()
        return Policy.from_string(chosen), f"precision.policy=auto chose {chosen}: {reason}"
    return Policy.from_string(name), f"precision.policy={name}"


def make_loss_scale(config: ml_collections.ConfigDict, policy: Policy) -> LossScale:
    """The loss scale for `config.precision.loss_scale`.

    `dynamic` is a no-op scale for policies that do not compute in float16: float32 and bfloat16 share
    float32's exponent range, so their gradients neither underflow nor overflow earlier.
    """
    kind = parse_loss_scale(config.loss_scale)
    # "auto" starts at the default, inside the bounds, until the probe sets it (auto_precision).
    initial_scale = (min(max(DEFAULT_INITIAL_SCALE, config.min_scale), config.max_scale)
                     if config.initial_scale == AUTO else config.initial_scale)
    if kind == "none" or (kind == "dynamic" and policy.compute_dtype != tf.float16):
        return NoLossScale()
    if kind != "dynamic":
        return StaticLossScale(kind)
    try:
        return DynamicLossScale(
            initial_scale=initial_scale,
            growth_interval=config.growth_interval,
            growth_factor=config.growth_factor,
            backoff_factor=config.backoff_factor,
            hysteresis=config.hysteresis,
            min_scale=config.min_scale,
            max_scale=config.max_scale,
        )
    except ValueError as error:
        raise ConfigError(f"config.precision: {error}") from None
