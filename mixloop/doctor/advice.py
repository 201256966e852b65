"""What the doctor advises, and why: the layers to keep in float32, the initial loss scale, bfloat16.

The advice keeps `MARGIN_BITS` doublings free for batches and updates the diagnosis did not see, with
s(dtype, g, m) = 2 ** floor(log2(dtype's largest finite value) - m - log2(g)) the largest power of
two at which a 16-bit dtype holds a gradient g with m doublings to spare::

    keep in float32   = the finest 16-bit layers whose float32 inputs or outputs come within
                        MARGIN_BITS doublings of their compute dtype's largest finite value, or that
                        turn finite inputs into inf or NaN: a block that does so only because a
                        sublayer does is not listed, the sublayer is
    initial scale     = s(float16, largest gradient left in float16 by that advice, MARGIN_BITS),
                        but no higher than DEFAULT_INITIAL_SCALE unless more than
                        UNDERFLOW_TOLERANCE of those gradients flush to zero at it: a start above
                        the default only changes a run that needs it (the dynamic scale grows by
                        itself), while one below it saves the skipped updates of backing off
    bfloat16 is safe  = every 16-bit value stays MARGIN_BITS doublings inside bfloat16's range, and at
                        most UNDERFLOW_TOLERANCE of the gradients flush to zero without a loss scale
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional, Sequence

import ml_collections
import tensorflow as tf

from mixloop.config import DEFAULT_INITIAL_SCALE, parse_loss_scale, split_auto
from mixloop.doctor import float8_column, report
from mixloop.doctor.report import (MARGIN_BITS, UNDERFLOW_TOLERANCE, Advice,
                                   DtypeRange, LayerReport, PrecisionReport, VariableReport)
from mixloop.engine.policy import Policy


def advise(layers: list[LayerReport], variables: list[VariableReport], fractions: list[float],
            scale: float, policy: Policy, precision: ml_collections.ConfigDict, whose: str,
            in_float8: list[str], float8_candidates: list[str]) -> Advice:
    """The advice of the module docstring, with the problems that motivate it; `whose` begins each
    problem of the objective's gradients ("" with a single objective); `in_float8`: the paths of
    the layers the run trains in FP8; `float8_candidates`: those `float8_layers=auto` would take."""
    low_layers = [layer for layer in layers if layer.compute_dtype != "float32"]
    low_variables = [variable for variable in variables if variable.dtype != "float32"]
    hot = finest(layer for layer in low_layers if not layer.float32_non_finite_outputs
                 and (layer.headroom_bits < MARGIN_BITS or layer.creates_non_finite))
    hot_paths = [layer.path for layer in hot]
    explicit = split_auto(precision.float32_layers)[1]  # "auto|" is no pin.
    regex = "|".join(([explicit] if explicit else [])
                     + [re.escape(path) for path in hot_paths])
    # What stays in 16 bits once the hot layers, with their sublayers, compute in float32.
    kept_layers = [layer for layer in low_layers if not is_under(layer.path, hot_paths)]
    kept_variables = [v for v in low_variables if not is_under(v.path, hot_paths)]
    largest_grad = largest_gradient(kept_layers, kept_variables)
    initial_scale = zero_fraction = None
    if policy.compute_dtype == tf.float16:
        initial_scale, zero_fraction = _float16_initial_scale(kept_layers, kept_variables)

    bfloat16 = DtypeRange.of(tf.bfloat16)
    largest_value = max([layer.max_abs for layer in low_layers]
                        + [largest_gradient(low_layers, low_variables)], default=0.0)
    bfloat16_headroom = bfloat16.headroom_bits(largest_value)
    bfloat16_zero_fraction = bfloat16.zero_fraction(report.sum_histograms(low_variables))
    # Only a bfloat16 run shows whether bfloat16 itself turns finite inputs into inf or NaN.
    bfloat16_breaks = policy.compute_dtype == tf.bfloat16 and any(l.creates_non_finite for l in hot)
    return Advice(
        problems=_problems(layers, hot, fractions, scale, policy.compute_dtype.name, whose),
        float32_layers=hot_paths, float32_layers_regex=regex, largest_gradient=largest_grad,
        initial_scale=initial_scale, initial_scale_zero_fraction=zero_fraction,
        bfloat16_headroom_bits=bfloat16_headroom, bfloat16_zero_fraction=bfloat16_zero_fraction,
        bfloat16_safe=(bfloat16_headroom >= MARGIN_BITS and bfloat16_zero_fraction <= UNDERFLOW_TOLERANCE
                       and not bfloat16_breaks),
        overrides=_overrides(regex if hot_paths else None, initial_scale, precision),
        float8=float8_column.advise([(layer.path, layer.float8) for layer in layers if layer.float8],
                                    in_float8, float8_candidates),
    )


def initial_scale_keeping(report: PrecisionReport, float32_paths: Sequence[str]) -> Optional[float]:
    """The advised float16 initial scale once the layers at `float32_paths` (with their sublayers)
    compute in float32 too: the module docstring's rule over the gradients left in float16; None
    when none is left. `report.advice.initial_scale` is this for the advised layers."""
    kept_layers = [layer for layer in report.layers
                   if layer.compute_dtype == "float16" and not is_under(layer.path, float32_paths)]
    kept_variables = [v for v in report.variables
                      if v.dtype == "float16" and not is_under(v.path, float32_paths)]
    return _float16_initial_scale(kept_layers, kept_variables)[0]


def _float16_initial_scale(layers: list, variables: list) -> tuple[Optional[float], Optional[float]]:
    """The initial scale the float16 gradients of `layers` and `variables` (left in 16 bits) advise,
    and the fraction of those variables' gradients that flush to zero at it; Nones without any."""
    largest_grad = largest_gradient(layers, variables)
    if not largest_grad > 0:
        return None, None
    float16, histogram = DtypeRange.of(tf.float16), report.sum_histograms(variables)
    log2_scale = float16.safe_log2_scale(largest_grad, MARGIN_BITS)
    log2_default = round(math.log2(DEFAULT_INITIAL_SCALE))
    if log2_scale > log2_default and float16.zero_fraction(histogram, log2_default) <= UNDERFLOW_TOLERANCE:
        log2_scale = log2_default
    return 2.0**log2_scale, float16.zero_fraction(histogram, log2_scale)


def largest_gradient(layers: list, variables: list) -> float:
    """The largest unscaled float32 gradient of any of `variables` or of the outputs of `layers`
    (reports or tallies, which name these values alike)."""
    return max([v.max_abs for v in variables] + [l.max_abs_output_grad for l in layers], default=0.0)


def _problems(layers: list[LayerReport], hot: list[LayerReport], fractions: list[float], scale: float,
              dtype_name: str, whose: str) -> list[str]:
    problems = [f"{layer.path}: {layer.float32_non_finite_outputs} outputs are inf or NaN even in "
                "float32, which no precision setting fixes" for layer in layers
                if layer.float32_non_finite_outputs]
    problems += [hot_layer_problem(layer, layers) for layer in hot]
    zero_fraction, _, overflow_fraction = fractions
    if zero_fraction > UNDERFLOW_TOLERANCE:
        problems.append(f"{whose}gradients underflow at loss scale {scale:g}: {zero_fraction:.1%} of "
                        f"nonzero values flush to zero in {dtype_name}")
    if overflow_fraction > 0:
        problems.append(f"{whose}gradients overflow at loss scale {scale:g}: {overflow_fraction:.2%} of "
                        f"values become inf in {dtype_name}, which skips the update")
    return problems


def finest(hot: Iterable[LayerReport]) -> list[LayerReport]:
    """The `hot` layers none of whose sublayers is hot: a block or a backbone is hot because a
    layer inside it is, so moving only that one keeps the rest of the block in 16 bits."""
    hot = list(hot)
    return [layer for layer in hot
            if not any(is_under(other.path, [layer.path]) and other.path != layer.path
                       for other in hot)]


def hot_layer_problem(layer: LayerReport, layers: Sequence[LayerReport] = ()) -> str:
    """Why the doctor keeps `layer` in float32: '<path> (<dtype>): values up to ... exceed ...';
    when `layers` (the whole report's) hold sublayers of it, none of which is hot, that the
    culprit is its own code (an op it calls directly), of which it is the smallest layer."""
    largest = DtypeRange.of(layer.compute_dtype).max_finite
    limit = f"{layer.compute_dtype}'s largest finite value, {largest:g}"
    reasons = []
    if layer.headroom_bits < 0:
        reasons.append(f"values up to {layer.max_abs:.3g} exceed {limit}")
    elif layer.headroom_bits < MARGIN_BITS:
        reasons.append(f"values up to {layer.max_abs:.3g} come within {layer.headroom_bits:.1f} "
                       f"doublings of {limit}")
    if layer.creates_non_finite:
        reasons.append(f"it turned finite inputs into {layer.non_finite_outputs} inf or NaN outputs")
    if any(other.path.startswith(layer.path + "/") for other in layers):
        reasons.append("in its own ops, not in a sublayer (the smallest layer that holds them)")
    return f"{layer.path} ({layer.compute_dtype}): " + "; ".join(reasons)


def _overrides(regex: Optional[str], initial_scale: Optional[float],
               precision: ml_collections.ConfigDict) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if regex is not None:
        overrides["precision.float32_layers"] = regex
    if initial_scale is not None:
        if parse_loss_scale(precision.loss_scale) != "dynamic":
            overrides["precision.loss_scale"] = "dynamic"
        overrides["precision.initial_scale"] = initial_scale
        # The dynamic scale must start inside its bounds.
        if initial_scale > precision.max_scale:
            overrides["precision.max_scale"] = initial_scale
        if initial_scale < precision.min_scale:
            overrides["precision.min_scale"] = initial_scale
    return overrides


def is_under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)

