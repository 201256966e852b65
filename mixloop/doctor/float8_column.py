"""The doctor's FP8 column: the share of each Dense and EinsumDense layer's values that float8 would
flush to zero or saturate, and which layers should therefore stay in 16 bits.

Keras trains a layer in FP8 (`model.quantize("float8")`, `precision.float8_layers`) by
quantize-dequantize with a per-tensor scale: q(x) = cast(clip(x / scale, -max, max)) * scale, in
float8_e4m3fn for the inputs and the kernel, float8_e5m2 for the output gradient. Its delayed
scaling sets scale = amax / max, amax the largest magnitude in the tensor's amax history. Of a
tensor's nonzero values x, with top = scale * max (the magnitude that maps to the format's max)::

    flushed   = |x| / scale <= smallest subnormal / 2, i.e. |x| <= top * smallest subnormal / (2 max)
                (rounds to zero: a tie rounds to the even neighbour, zero)
    saturated = |x| / scale >  max, i.e. |x| > top  (clipped to +-max)

E4M3 holds max 448 and smallest subnormal 2^-9, E5M2 57344 and 2^-16. A float8 layer whose amax
history holds a value is measured at its own scales, which its next step uses. Any other layer is
measured at the scales delayed scaling sets from a fresh history and the values measured: top =
amax over every micro-batch, at which nothing saturates. That includes a float8 layer not trained
yet, whose Keras initial scale, 1, serves only its first two steps: the advice is about the steps
after those.

    forward  = the larger share of its inputs' and of its kernel's (each touches every output)
    backward = its output gradient's, at the loss scale (what the train step differentiates)

A layer should stay in 16 bits when its backward flushes more than FLUSH_TOLERANCE of its nonzero
values, or when its forward saturates any (see the constants for why). A forward flush does not
count: an input or weight below 2^-19 of the tensor's largest adds that little to each output sum,
while a flushed output gradient zeroes its weights' whole gradient, and Adam would have made a
full-size update of a tiny one.

Limits: Keras quantizes the gradient of the matmul's result, before the bias and the activation;
the doctor measures the layer's output gradient, which is the same without an activation, holds
the same nonzero values and more for relu, and is scaled by a smooth activation's derivative.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from mixloop.engine.float8_layers import FLOAT8

# E5M2 spans 2^32 from its smallest subnormal to its max, so at a fresh history's scale a gradient
# flushes only below amax * 2^-33, where healthy layers flush a small fraction of their values
# (docs/fp8.md), so more than 1% means a real share of the signal lies that far below the largest
# value. A 16-bit run's gradients are allowed the same share (doctor/report.UNDERFLOW_TOLERANCE).
FLUSH_TOLERANCE = 0.01
# Any saturated forward value is clipped by up to all of its excess: under delayed scaling it means
# the values outgrew the history, which a fresh history (the measure of an unquantized layer) never
# shows, so a float8 layer that saturates here does so at its own, trained scales.
SATURATION_TOLERANCE = 0.0

FORWARD_DTYPE, BACKWARD_DTYPE = "float8_e4m3fn", "float8_e5m2"


@dataclasses.dataclass(frozen=True)
class Float8Report:
    """One Dense or EinsumDense layer in float8, as fractions of its nonzero values."""

    own_scales: bool  # Measured at the float8 layer's own scales; else those of a fresh history.
    forward_flushed: float  # The larger of its inputs' and its kernel's share flushed in E4M3...
    forward_saturated: float  # ...or saturated.
    backward_flushed: float  # Its output gradients' share flushed in E5M2...
    backward_saturated: float  # ...or saturated.

    @property
    def fits(self) -> bool:
        """Whether the layer can train in FP8: the module docstring's rule."""
        return (self.backward_flushed <= FLUSH_TOLERANCE
                and self.forward_saturated <= SATURATION_TOLERANCE)


def shares(values: Sequence[np.ndarray], top: float, dtype: str) -> tuple[float, float]:
    """(flushed, saturated): the fractions of the nonzero `values` that the float8 `dtype` flushes to
    zero or saturates at the scale whose `top` (scale * max) maps to its max; (0, 0) without any."""
    magnitudes = np.concatenate([np.abs(v[v != 0]).ravel() for v in values] or [np.zeros(0)])
    if not magnitudes.size:
        return 0.0, 0.0
    info = ml_dtypes.finfo(dtype)
    flush_below = top * float(info.smallest_subnormal) / 2 / float(info.max)
    return (float(np.mean(magnitudes <= flush_below)), float(np.mean(magnitudes > top)))


class Float8Tally:
    """One layer's inputs and output gradients from the policy model's passes, and its kernel."""

    def __init__(self, layer):
        self.layer = layer
        self.inputs: list[np.ndarray] = []
        self.output_grads: list[np.ndarray] = []

    def add(self, inputs: list[np.ndarray], output_grads: list[np.ndarray]) -> None:
        """One call's floating inputs and its outputs' gradients at the loss scale (float32 copies)."""
        self.inputs += inputs
        self.output_grads += output_grads

    def report(self) -> Float8Report:
        kernel = np.asarray(self.layer.kernel, np.float32)
        own = self.layer.quantization_mode == FLOAT8 and bool(
            np.any(np.asarray(self.layer.outputs_grad_amax_history)))
        inputs = shares(self.inputs, self._top("inputs", self.inputs, FORWARD_DTYPE, own), FORWARD_DTYPE)
        weights = shares([kernel], self._top("kernel", [kernel], FORWARD_DTYPE, own), FORWARD_DTYPE)
        backward = shares(self.output_grads,
                          self._top("outputs_grad", self.output_grads, BACKWARD_DTYPE, own),
                          BACKWARD_DTYPE)
        return Float8Report(own_scales=own, forward_flushed=max(inputs[0], weights[0]),
                            forward_saturated=max(inputs[1], weights[1]),
                            backward_flushed=backward[0], backward_saturated=backward[1])

    def _top(self, name: str, values: list[np.ndarray], dtype: str, own: bool) -> float:
        """The magnitude `dtype`'s max stands for: the layer's `<name>_scale` times it, or (a fresh
        history) the largest finite magnitude of `values`, as Keras's compute_float8_scale."""
        dtype_max = float(ml_dtypes.finfo(dtype).max)
        if own:
            return float(np.asarray(getattr(self.layer, f"{name}_scale"))) * dtype_max
        finite = [np.abs(v[np.isfinite(v)]) for v in values]
        amax = max((float(v.max()) for v in finite if v.size), default=0.0)
        # Keras keeps its initial scale, 1, while the history holds no positive amax.
        return amax if amax > 0 else dtype_max


@dataclasses.dataclass(frozen=True)
class Float8Advice:
    """Which measured layers can train in FP8 and which should stay in 16 bits."""

    unfit: list[str]  # Paths of the layers that should stay in 16 bits.
    fit: list[str]  # Paths of the candidate layers that can train in FP8.
    # For precision.float8_layers, which takes the layers to train in FP8: `fit`; None when no
    # candidate fits, or when the run trains in FP8 already and every layer fits (nothing to change).
    regex: Optional[str]


def advise(reports: Sequence[tuple[str, Float8Report]], in_float8: Sequence[str],
           candidates: Sequence[str]) -> Optional[Float8Advice]:
    """The advice over the (path, report) pairs of the measured layers, among the layers
    `in_float8` (those the run trains in FP8) when there are any, else among `candidates` (what
    `precision.float8_layers=auto` would take: not the outputs, not the float32 placement). None
    when no such layer was measured."""
    considered = set(in_float8 or candidates)
    reports = [(path, report) for path, report in reports if path in considered]
    if not reports:
        return None
    unfit = [path for path, report in reports if not report.fits]
    fit = [path for path, report in reports if report.fits]
    change = unfit or not in_float8
    return Float8Advice(unfit=unfit, fit=fit,
                        regex="|".join(re.escape(path) for path in fit) if change and fit else None)
