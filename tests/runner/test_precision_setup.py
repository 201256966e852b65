"""config.precision as the engine's objects (runner/precision_setup.py): the policy, `auto` resolved,
and the loss scale each setting makes."""

import pytest
import tensorflow as tf

from mixloop.config import base_config
from mixloop.engine.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale
from mixloop.engine.policy import Policy
from mixloop.runner import precision_setup


def test_auto_is_float32_on_a_cpu_and_says_why():
    policy, reason = precision_setup.make_policy("auto")
    assert str(policy) == "params=float32,compute=float32,output=float32"
    assert reason == ("precision.policy=auto chose float32: no accelerator: on a CPU 16-bit math is "
                      "no faster than float32")
    assert precision_setup.make_policy("mixed_bfloat16")[0].compute_dtype == tf.bfloat16


@pytest.mark.parametrize("policy, loss_scale, expected", [
    ("mixed_float16", "dynamic", DynamicLossScale), ("mixed_bfloat16", "dynamic", NoLossScale),
    ("float32", "dynamic", NoLossScale), ("mixed_float16", 128.0, StaticLossScale),
    ("mixed_float16", "none", NoLossScale)])
def test_a_dynamic_scale_only_where_float16_needs_it(policy, loss_scale, expected):
    precision = base_config().precision
    with precision.ignore_type():  # A number, or a string.
        precision.loss_scale = loss_scale
    scale = precision_setup.make_loss_scale(precision, Policy.from_string(policy))
    assert type(scale) is expected
    if expected is DynamicLossScale:  # `auto` starts where the probe has not moved it yet.
        assert float(scale.scale.numpy()) == 2.0**15
    if expected is StaticLossScale:
        assert float(scale.scale.numpy()) == 128.0
