"""The divergence guard (runner/guard.py): the reason codes the inner loop stops on, and the one line
each becomes."""

import tensorflow as tf

import mixloop
from mixloop.runner import guard


def report(loss=1.0, finite=True, scale=1.0):
    return {"loss": tf.constant(loss), "grads_finite": tf.constant(finite), "loss_scale": tf.constant(scale)}


def test_the_reasons_in_their_order_of_precedence():
    skips = tf.constant(5, tf.int64)
    assert int(guard.stop_reason(report(), tf.constant(0, tf.int64), 5, 1.0)) == guard.CONTINUE
    assert int(guard.stop_reason(report(finite=False), skips, 5, None)) == guard.TOO_MANY_SKIPS
    assert int(guard.stop_reason(report(finite=False, scale=1.0), skips, 0, 1.0)) == guard.OVERFLOW_AT_MIN_SCALE
    assert int(guard.stop_reason(report(loss=float("nan")), skips, 5, 1.0)) == guard.NONFINITE_LOSS
    assert bool(guard.any_stopping([tf.constant(guard.CONTINUE), tf.constant(guard.TOO_MANY_SKIPS)]))
    assert guard.min_scale(mixloop.DynamicLossScale(min_scale=2.0)) == 2.0
    assert guard.min_scale(mixloop.StaticLossScale(8.0)) is None


def test_each_reason_is_one_line_naming_the_step_scale_and_variables():
    line = guard.describe(guard.NONFINITE_LOSS, step=12, objective=None, loss=float("nan"),
                          inputs_finite=False, grads_finite=False, xla=False, scale=1024.0,
                          consecutive_skips=0, max_consecutive_skips=10, nonfinite_paths=["a/kernel"])
    assert line == ("training diverged at step 12: the float32 loss is nan and the batch's floating "
                    "inputs contain inf or NaN (bad data); loss scale 1024; non-finite gradients first "
                    "in a/kernel in layer(s) a")
    skips = guard.describe(guard.TOO_MANY_SKIPS, step=3, objective="critic", loss=1.0, inputs_finite=True,
                           grads_finite=False, xla=True, scale=1.0, consecutive_skips=10,
                           max_consecutive_skips=10, nonfinite_paths=[])
    assert "in objective 'critic'" in skips and "10 updates in a row" in skips
    assert skips.endswith("no variable (the gradients were finite)")
    many = guard.describe_variables([f"layer{i}/kernel" for i in range(8)], limit=2)
    assert many.startswith("layer0/kernel, layer1/kernel (+6 more) in layer(s) layer0, layer1")
