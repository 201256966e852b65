"""What the precision doctor reports: per layer, per variable, its advice, and the report as JSON.

The figures and rules behind each field are in doctor/diagnosis.py (the measurement) and
doctor/advice.py (what to change); `MARGIN_BITS` and `UNDERFLOW_TOLERANCE` are the advice's margins.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import ml_dtypes
import tensorflow as tf

from mixloop.doctor.float8_column import Float8Advice, Float8Report
from mixloop import files
from mixloop.errors import UserError


MARGIN_BITS = 3  # Doublings of headroom kept free for batches and updates the diagnosis did not see.


UNDERFLOW_TOLERANCE = 0.01  # The fraction of nonzero gradient values allowed to flush to zero.


# The comparison needs no room for unseen batches, only one doubling for 16-bit results that round
# above the float32 values the comparison scale is chosen from.
COMPARISON_MARGIN_BITS = 1


class UnmeasurableLoss(UserError):
    """The float32 pass cannot take the gradients an objective's loss makes (it runs the trainer's
    model other than through `self.model`): no figure or advice is given for it."""


@dataclasses.dataclass(frozen=True)
class DtypeRange:
    """The magnitudes a floating dtype holds: inf above `max_finite`, subnormal (fewer significant
    bits) below `min_normal`, and zero at or below half of `min_subnormal`; `eps` is its resolution,
    the gap between 1 and the next larger value."""

    name: str
    max_finite: float
    min_normal: float
    min_subnormal: float
    eps: float

    @classmethod
    def of(cls, dtype: Any) -> "DtypeRange":
        dtype = tf.as_dtype(dtype)
        info = ml_dtypes.finfo(dtype.as_numpy_dtype)
        return cls(dtype.name, float(info.max), float(info.smallest_normal),
                   float(info.smallest_subnormal), float(info.eps))

    def headroom_bits(self, max_abs: float) -> float:
        """log2(max_finite / max_abs): the doublings `max_abs` can take before it overflows."""
        if max_abs == 0:
            return math.inf
        return math.log2(self.max_finite / max_abs) if math.isfinite(max_abs) else -math.inf

    def safe_log2_scale(self, max_abs: float, margin_bits: float) -> int:
        """The largest k with max_abs * 2**k at most max_finite / 2**margin_bits: the loss scale
        exponent that leaves the largest gradient, `max_abs` (positive), `margin_bits` doublings."""
        return math.floor(math.log2(self.max_finite) - margin_bits - math.log2(max_abs))

    def zero_fraction(self, histogram: dict[int, int], log2_scale: int = 0) -> float:
        """The fraction of the magnitudes counted in a log2 `histogram` that flush to zero in this dtype
        once multiplied by 2**log2_scale (exact up to ties at half the smallest subnormal)."""
        total = sum(histogram.values())
        # Bin k times 2**s lies in [2**(k+s), 2**(k+s+1)), which rounds to zero when its top is at most
        # half the smallest subnormal.
        last_flushed = round(math.log2(self.min_subnormal)) - 2 - log2_scale
        flushed = sum(count for k, count in histogram.items() if k <= last_flushed)
        return flushed / total if total else 0.0


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One layer, over every call in every micro-batch."""

    path: str  # Its Keras path (its name for sublayers Keras gives no path), as float32_layers matches.
    compute_dtype: str  # In the trainer's model.
    max_abs_input: Optional[float]  # Largest floating input magnitude, float32 pass; None without any.
    max_abs_output: float  # Largest output magnitude, float32 pass.
    headroom_bits: float  # log2(largest finite compute_dtype / max of the two above).
    non_finite_outputs: int  # Output elements that were inf or NaN in the mixed pass.
    creates_non_finite: bool  # Mixed pass: some call turned all-finite inputs into inf or NaN.
    float32_non_finite_outputs: int  # Output elements that were inf or NaN even in float32.
    max_abs_output_grad: float  # Largest gradient of the (unscaled) loss by the output, float32 pass.
    output_grad_zero_fraction: float  # Of its nonzero values, those zero once scaled and cast.
    # Dense and EinsumDense layers Keras can train in FP8: the policy model's values in float8
    # (float8_report); None for other layers.
    float8: Optional[Float8Report] = None

    @property
    def max_abs(self) -> float:
        """The largest magnitude the layer reads or writes, float32 pass."""
        return max(self.max_abs_input or 0.0, self.max_abs_output)


@dataclasses.dataclass(frozen=True)
class VariableReport:
    """One variable's gradient over every micro-batch; fractions are of its nonzero float32 values."""

    path: str
    dtype: str  # The dtype its gradient is computed in: the compute dtype of the layer that owns it.
    num_values: int  # Nonzero float32 gradient values seen.
    max_abs: float  # Largest float32 gradient magnitude (unscaled).
    min_abs: float  # Smallest nonzero one.
    zero_fraction: float  # Float32 gradient times the loss scale, cast to dtype: flushed to zero...
    subnormal_fraction: float  # ...became subnormal...
    overflow_fraction: float  # ...or became inf.
    mixed_zero_fraction: float  # Mixed pass: the gradient was zero where float32's was not.
    absolute_error: float  # ||mixed gradient - float32 gradient||, as the module docstring's abs.err.
    relative_error: Optional[float]  # The module docstring's rel.err; None when float32's is noise.
    histogram: dict[int, int]  # {k: number of float32 magnitudes in [2**k, 2**(k+1))}.
    # Keras's `overwrite_with_gradient` (float8 scales and amax histories): its "gradient" is its
    # new value, so it has no gradient statistics (zeros, an empty histogram, rel.err None), and
    # its overflow_fraction is of all its new values, those inf or NaN in either pass.
    overwritten: bool = False


@dataclasses.dataclass(frozen=True)
class Advice:
    """What to change, and why."""

    problems: list[str]  # One sentence each; empty when every value fits.
    float32_layers: list[str]  # Paths of the 16-bit layers to compute in float32.
    float32_layers_regex: str  # For precision.float32_layers: those paths and the configured pattern.
    largest_gradient: float  # The largest unscaled gradient of a variable or layer left in 16 bits.
    initial_scale: Optional[float]  # The advised precision.initial_scale (float16 policies only).
    initial_scale_zero_fraction: Optional[float]  # Gradients left in float16 that flush to zero at it.
    bfloat16_headroom_bits: float  # Least headroom of any 16-bit value in bfloat16.
    bfloat16_zero_fraction: float  # 16-bit gradients that flush to zero in bfloat16 without a scale.
    bfloat16_safe: bool  # Whether mixed_bfloat16 avoids every range problem found.
    overrides: dict[str, Any]  # Config overrides applying it, e.g. {"precision.initial_scale": 1024.0}.
    float8: Optional[Float8Advice] = None  # Which layers can train in FP8; None without any measured.


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """The diagnosis of one objective of one model at one step; `diagnose` makes it."""

    trainer: str  # config.trainer.
    objective: str  # The objective diagnosed: whose loss, variables and loss scale.
    objectives: list[str]  # Every objective of the trainer (one report each).
    policy: str  # The trainer's policy, "params=..,compute=..,output=..".
    compute_dtype: str
    step: int  # The trainer's global step: which weights were diagnosed.
    num_batches: int  # Train batches read: fewer than asked for when the data ran out.
    num_micro_batches: int  # Micro-batches seen: num_batches times train.accumulation_steps.
    loss_scale: float  # The scale gradients were examined at.
    comparison_scale: float  # The scale of the mixed pass: loss_scale, or less where that overflows.
    gradient_zero_fraction: float  # Over every gradient computed in 16 bits, at the loss scale.
    gradient_subnormal_fraction: float
    gradient_overflow_fraction: float
    layers: list[LayerReport]  # In the order they were first called.
    variables: list[VariableReport]  # The objective's, in the order of its variables.
    advice: Advice

    def gradient_histogram(self) -> dict[int, int]:
        """The log2 histogram of the unscaled gradients of every variable computed in 16 bits."""
        return dict(sorted(sum_histograms([v for v in self.variables if v.dtype != "float32"]).items()))

    def as_dict(self) -> dict[str, Any]:
        """The report as plain Python values (JSON-ready apart from non-finite floats)."""
        return dataclasses.asdict(self)


def write_json(report: PrecisionReport, path: str) -> str:
    """The report as strict JSON (`files.write_json`: non-finite numbers become "inf", "-inf" and "nan")."""
    return files.write_json(path, report.as_dict())


def sum_histograms(variables: list[VariableReport]) -> dict[int, int]:
    total: dict[int, int] = {}
    for variable in variables:
        for k, count in variable.histogram.items():
            total[k] = total.get(k, 0) + count
    return total

