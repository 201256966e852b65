"""The divergence guard: when a run must stop instead of burning compute, and what to tell the user.

Overflow is normal in float16 and skipped; endless overflow is not. The inner loop asks
`stop_reason` after every update (a few scalar ops in the graph) and breaks out on a reason; the
outer loop turns the reason into one message with the step, the scale and the offending variables.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from mixloop.engine.loss_scale import DynamicLossScale
from mixloop.errors import UserError

CONTINUE = 0
END_OF_DATA = 1
NONFINITE_LOSS = 2
TOO_MANY_SKIPS = 3
OVERFLOW_AT_MIN_SCALE = 4


class TrainingDiverged(UserError):
    """Training stopped because updates kept failing; the last good checkpoint is kept."""

    exit_code = 3


def stop_reason(
    metrics: dict[str, tf.Tensor],
    consecutive_skips: tf.Tensor,
    max_consecutive_skips: int,
    min_scale: Optional[float],
) -> tf.Tensor:
    """An int32 reason code for the update just made (`CONTINUE` when all is well).

    Args:
      metrics: one objective's report from the train step (loss, grads_finite, loss_scale).
      consecutive_skips: skipped updates in a row, this one included.
      max_consecutive_skips: that many in a row stop the run; 0 never does.
      min_scale: the dynamic scale's floor, or None for scales that do not move.
    """
    reason = tf.constant(CONTINUE)
    if max_consecutive_skips:
        reason = tf.where(consecutive_skips >= max_consecutive_skips, TOO_MANY_SKIPS, reason)
    if min_scale is not None:
        stuck = tf.logical_and(tf.logical_not(metrics["grads_finite"]),
                               metrics["loss_scale"] <= min_scale)
        reason = tf.where(stuck, OVERFLOW_AT_MIN_SCALE, reason)
    return tf.where(tf.math.is_finite(metrics["loss"]), reason, NONFINITE_LOSS)


def any_stopping(reasons: Sequence[tf.Tensor]) -> tf.Tensor:
    """Whether any of the objectives' reason codes says stop."""
    return tf.reduce_any(tf.not_equal(tf.stack(reasons), CONTINUE))


def min_scale(loss_scale: Any) -> Optional[float]:
    """The floor of a dynamic loss scale, or None for scales that do not move."""
    return loss_scale.min_scale if isinstance(loss_scale, DynamicLossScale) else None


def describe_variables(paths: Sequence[str], limit: int = 6) -> str:
    """'a/kernel, b/bias (+3 more) in layers a, b' for log lines and messages."""
    if not paths:
        return "no variable (the gradients were finite)"
    shown = ", ".join(paths[:limit]) + (f" (+{len(paths) - limit} more)" if len(paths) > limit else "")
    layers = sorted({path.rpartition("/")[0] or path for path in paths})
    return f"{shown} in layer(s) {', '.join(layers[:limit])}"


def describe(
    reason: int,
    *,
    step: int,
    objective: Optional[str],
    loss: float,
    inputs_finite: bool,
    grads_finite: bool,
    xla: bool,
    scale: float,
    consecutive_skips: int,
    max_consecutive_skips: int,
    nonfinite_paths: Sequence[str],
) -> str:
    """The one-line explanation of why training stopped at `step` (naming the objective when
    there are several)."""
    if reason == NONFINITE_LOSS:
        cause = f"the float32 loss is {loss}"
        if not inputs_finite:
            cause += " and the batch's floating inputs contain inf or NaN (bad data)"
        elif grads_finite and xla:
            cause += (" with finite gradients, as XLA gives for an integer input out of range, such "
                      "as a label (--config.jit_compile=False names the failing op instead)")
    elif reason == TOO_MANY_SKIPS:
        cause = (f"{consecutive_skips} updates in a row were skipped for non-finite gradients "
                 f"(train.max_consecutive_skips={max_consecutive_skips})")
    else:
        cause = "the gradients still overflow at the minimum loss scale (precision.min_scale)"
    where = f" in objective {objective!r}" if objective else ""
    return (f"training diverged at step {step}{where}: {cause}; loss scale {scale:g}; "
            f"non-finite gradients first in {describe_variables(nonfinite_paths)}")
