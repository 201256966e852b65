"""What the doctor's passes add up over micro-batches: per layer its range, per variable its gradient's.
"""

from __future__ import annotations

import math
from typing import Optional

import keras
import numpy as np

from mixloop.doctor import float8_column, passes
from mixloop.doctor.report import (DtypeRange, LayerReport, VariableReport)
from mixloop.engine import float8_layers


# Histogram bin k counts magnitudes in [2**k, 2**(k+1)); these bounds hold every nonzero float32.
_MIN_EXPONENT, _MAX_EXPONENT = -149, 127


def _log2_histogram(values: np.ndarray) -> np.ndarray:
    """Counts of the finite nonzero magnitudes, at index k - _MIN_EXPONENT for [2**k, 2**(k+1))."""
    magnitudes = np.abs(values[np.isfinite(values) & (values != 0)])
    _, exponents = np.frexp(magnitudes)  # magnitude = mantissa * 2**exponent, mantissa in [0.5, 1).
    return np.bincount(exponents - 1 - _MIN_EXPONENT, minlength=_MAX_EXPONENT - _MIN_EXPONENT + 1)


def _squared_norm(values: np.ndarray) -> float:
    """The sum of squares in float64; inf when any value is inf or NaN."""
    return float(np.sum(np.square(values, dtype=np.float64))) if np.isfinite(values).all() else math.inf


def _fraction(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def pooled(variables: list[VariableReport], name: str) -> float:
    """The fraction `name` of every value of `variables` together."""
    return _fraction(sum(getattr(v, name) * v.num_values for v in variables),
                     sum(v.num_values for v in variables))


class LayerTally:
    """One layer's values summed over micro-batches."""

    def __init__(self, path: str, layer: keras.layers.Layer, float8: bool):
        self.path, self.compute_dtype = path, layer.compute_dtype
        # The FP8 column, when measured (`float8`), for the layers Keras can train in FP8.
        self.float8 = (float8_column.Float8Tally(layer)
                       if float8 and float8_layers.can_train_in_float8(layer) else None)
        self.max_abs_input: Optional[float] = None  # Stays None for layers that read only ids.
        self.max_abs_output = self.max_abs_output_grad = 0.0
        self.non_finite_outputs = self.float32_non_finite_outputs = 0
        self.creates_non_finite = False
        self.grad_counts = np.zeros(4, np.int64)

    def add_float32(self, float32_calls: list[passes.CallStats]) -> None:
        """One micro-batch's float32 pass (unscaled, its output gradients counted at the loss scale)."""
        for call in float32_calls:
            if call.num_inputs:
                self.max_abs_input = max(self.max_abs_input or 0.0, float(call.max_abs_input))
            self.max_abs_output = max(self.max_abs_output, float(call.max_abs_output))
            self.float32_non_finite_outputs += int(call.non_finite_outputs)
            self.max_abs_output_grad = max(self.max_abs_output_grad, float(call.max_abs_output_grad))
            self.grad_counts += call.output_grad_counts

    def add_mixed(self, mixed_calls: list[passes.CallStats], float8_values: list,
                  grad_factor: float) -> None:
        """One micro-batch's mixed pass; `float8_values`, per call (its inputs, its outputs'
        gradients) for the FP8 column, has gradients that times `grad_factor` are at the loss scale."""
        for call in mixed_calls:
            self.non_finite_outputs += int(call.non_finite_outputs)
            if call.non_finite_outputs and not call.non_finite_inputs:
                self.creates_non_finite = True
        for inputs, grads in float8_values if self.float8 else ():
            self.float8.add(inputs, [grad * np.float32(grad_factor) for grad in grads])

    def report(self) -> LayerReport:
        max_abs = max(self.max_abs_input or 0.0, self.max_abs_output)
        return LayerReport(
            path=self.path, compute_dtype=self.compute_dtype, max_abs_input=self.max_abs_input,
            max_abs_output=self.max_abs_output,
            headroom_bits=DtypeRange.of(self.compute_dtype).headroom_bits(max_abs),
            non_finite_outputs=self.non_finite_outputs, creates_non_finite=self.creates_non_finite,
            float32_non_finite_outputs=self.float32_non_finite_outputs,
            max_abs_output_grad=self.max_abs_output_grad,
            output_grad_zero_fraction=_fraction(self.grad_counts[1], self.grad_counts[0]),
            float8=self.float8.report() if self.float8 else None,
        )


class VariableTally:
    """One variable's gradients summed over micro-batches."""

    def __init__(self, path: str, dtype: str, overwritten: bool):
        self.path, self.dtype, self.overwritten = path, dtype, overwritten
        self.counts = np.zeros(4, np.int64)  # As passes.cast_counts.
        self.num_mixed_zero = 0
        self.max_abs, self.min_abs = 0.0, math.inf
        self.error_squared = self.reference_squared = 0.0
        self.noise_squared: Optional[float] = 0.0  # None once a micro-batch came without a repeat.
        self.histogram = np.zeros(_MAX_EXPONENT - _MIN_EXPONENT + 1, np.int64)

    def add_float32(self, grad: np.ndarray, repeated_grad: Optional[np.ndarray], scale: float) -> None:
        """One micro-batch's float32 gradient, examined at `scale`, and its repeat at NOISE_SCALE
        (None when not repeated: no rel.err)."""
        if self.overwritten:  # A new value: only its finiteness means anything (`add_mixed`).
            return
        nonzero = grad != 0
        self.counts += passes.cast_counts(grad, scale, self.dtype).numpy()
        self.histogram += _log2_histogram(grad)
        if nonzero.any():
            magnitudes = np.abs(grad[nonzero])
            self.max_abs = max(self.max_abs, float(magnitudes.max()))
            self.min_abs = min(self.min_abs, float(magnitudes.min()))
        self.reference_squared += _squared_norm(grad)
        if repeated_grad is None or self.noise_squared is None:
            self.noise_squared = None
        else:
            self.noise_squared += _squared_norm(repeated_grad.astype(np.float64) - grad)

    def add_mixed(self, float32_grad: np.ndarray, mixed_grad: np.ndarray) -> None:
        """One micro-batch's mixed gradient, against its float32 gradient."""
        if self.overwritten:
            bad = ~np.isfinite(float32_grad) | ~np.isfinite(mixed_grad)
            self.counts += [bad.size, 0, 0, np.sum(bad)]
            return
        self.num_mixed_zero += int(np.sum((float32_grad != 0) & (mixed_grad == 0)))
        self.error_squared += _squared_norm(mixed_grad.astype(np.float64) - float32_grad)

    def report(self, eps: float) -> VariableReport:
        """The report; `eps` is the compute dtype's, for the module docstring's rel.err."""
        num_values = int(self.counts[0])
        absolute_error = math.sqrt(self.error_squared)
        reference_norm = math.sqrt(self.reference_squared)
        # Also None for a zero reference, whose noise (zero too) is not below eps times it.
        resolved = (self.noise_squared is not None
                    and math.sqrt(self.noise_squared) < eps * reference_norm)
        relative_error = absolute_error / reference_norm if resolved else None
        return VariableReport(
            path=self.path, dtype=self.dtype, num_values=num_values, max_abs=self.max_abs,
            min_abs=self.min_abs if math.isfinite(self.min_abs) else 0.0,  # Inf: none seen.
            zero_fraction=_fraction(self.counts[1], num_values),
            subnormal_fraction=_fraction(self.counts[2], num_values),
            overflow_fraction=_fraction(self.counts[3], num_values),
            mixed_zero_fraction=_fraction(self.num_mixed_zero, num_values),
            absolute_error=absolute_error, relative_error=relative_error,
            histogram={k + _MIN_EXPONENT: int(c) for k, c in enumerate(self.histogram) if c},
            overwritten=self.overwritten,
        )

