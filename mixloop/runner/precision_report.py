"""The precision doctor's analysis: which layer's values leave a 16-bit range, and what to change.

`diagnose(trainer, num_batches)` runs the same micro-batches forward and backward from the same
weights: through a float32 twin of the model, and through the trainer's model in its policy (the
mixed pass). The float32 pass gives the true range of every layer's inputs, outputs and output
gradients and of every variable's gradient, examined at the loss scale (what flushes to zero or
overflows once scaled); the mixed pass shows where values became inf or NaN and how far each gradient
drifts from float32's. The mixed pass runs at a comparison scale its gradients survive, so that an
overflow at the loss scale, reported as a problem of its own, does not turn every drift into inf. The
float32 pass runs a second time at loss scale NOISE_SCALE to measure its own rounding noise. With
s(dtype, g, m) = 2 ** floor(log2(dtype's largest finite value) - m - log2(g)), the largest power of
two at which a 16-bit dtype holds a gradient g with m doublings to spare::

    comparison scale  = min(loss scale, s(compute dtype, largest float32 gradient of a variable or
                                          layer output computed in 16 bits, COMPARISON_MARGIN_BITS))
    abs.err           = ||g16 - g32||, the norm over all of a variable's values in every micro-batch
                        (g16: the mixed pass's unscaled gradient, g32: the float32 pass's)
    rel.err           = abs.err / ||g32||, or None when g32 is zero or lost in its own rounding noise:
                        when ||g32' - g32|| >= eps(compute dtype) * ||g32||, g32' being the float32
                        gradient recomputed at NOISE_SCALE (a gradient that is zero in exact
                        arithmetic, like an attention key's bias, comes out as float32 rounding
                        noise, and its 16-bit counterpart as noise thousands of times larger)

The advice keeps `MARGIN_BITS` doublings free for batches and updates the diagnosis did not see::

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

A model with several objectives (a GAN's generator and discriminator) is diagnosed one objective at
a time, each on the same batches (`diagnose_objectives`): gradients are those of that objective's
loss by its own variables, examined at its own loss scale, and the layers' output gradients are those
of its loss; the layers' values come from the one forward pass all objectives share. The advised
initial scale is that objective's, while `config.precision` starts every objective's loss scale (unless
`build_objectives` gives it its own).

Gradients are those of one micro-batch's loss per weight (its mean), which is what the train step
scales and differentiates; a variable the loss does not reach has a zero gradient. While a pass is
traced, `trainer.model` and `trainer.policy` are the pass's (the twin and float32 in the float32
pass), so a `compute_loss` that runs `self.model` itself (a MAML inner step, a gradient penalty
through `self.model.discriminator`) runs the model measured. A loss that reaches the trainer's model
another way (a layer kept in an attribute) makes the float32 pass reach the trainer's variables, or
leaves it all zero gradients where the mixed pass has some: `UnmeasurableLoss`, one line, and no
figure or advice. Each pass runs traced, as the train step does, so a layer's custom gradient
(`tf.custom_gradient`, Keras's float8 layers) is taken as training takes it. A variable Keras
overwrites with its "gradient" (`overwrite_with_gradient`: float8 scales and amax histories) has no
gradient to measure: it is left out of every gradient statistic, and its new values count only where they are inf or NaN, as
overflows. Layers are observed by wrapping each layer's call while the diagnosis runs, which works
alike for functional, sequential and subclassed models and reaches sublayers (attention
projections). Limits: values made
between layers by plain ops (a residual add) appear only as the next layer's input; Keras's dropout
and noise layers run in inference mode in every pass so that their masks cannot differ; every pass
over a micro-batch starts from the same non-trainable state, so other draws from a Keras
`SeedGenerator` of the model (a GAN's noise) repeat too, but draws from outside the model's variables
differ in each pass, so the float32 gradients they reach disagree with their repeat and get no
rel.err; a variable read by several layers (tied embeddings) is counted in the
compute dtype of the layer that owns it. Memory: a pass reduces each layer call's values to a few
numbers inside its traced function (`_CallStats`), so it weighs about one micro-step of the train
step; every micro-batch's float32 gradients are held until the mixed pass, so memory grows with
num_batches; so do the mixed pass's inputs and output gradients of each Dense and EinsumDense
layer, from which `float8_report` tells what float8 would flush or saturate at the scale they set
(the FP8 column, and `Advice.float8`; the automatic probe leaves it out).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import re
from typing import Any, Callable, Collection, Iterable, Iterator, Optional, Sequence

import keras
import ml_collections
import ml_dtypes
import numpy as np
import tensorflow as tf

from mixloop.config import DEFAULT_INITIAL_SCALE, parse_loss_scale, split_auto
from mixloop.engine import float8_layers, tracing
from mixloop.engine.layer_precision import build_model, named_layers
from mixloop.engine.loss import as_losses
from mixloop.engine.policy import Policy
from mixloop.engine.loss import per_weight
from mixloop.engine.step import forward, split_micro_batches
from mixloop.errors import UserError, described
from mixloop import interrupts
from mixloop.runner import float8_report
from mixloop.runner.float8_report import Float8Advice, Float8Report

MARGIN_BITS = 3  # Doublings of headroom kept free for batches and updates the diagnosis did not see.
UNDERFLOW_TOLERANCE = 0.01  # The fraction of nonzero gradient values allowed to flush to zero.
# The comparison needs no room for unseen batches, only one doubling for 16-bit results that round
# above the float32 values the comparison scale is chosen from.
COMPARISON_MARGIN_BITS = 1
NOISE_SCALE = 3.0  # Not a power of two, so the repeated float32 pass rounds every product anew.

# Layers that draw random numbers; every pass runs them in inference mode so the draws cannot differ.
_NOISE_LAYERS = (keras.layers.Dropout, keras.layers.GaussianDropout, keras.layers.GaussianNoise,
                 keras.layers.AlphaDropout)
# Histogram bin k counts magnitudes in [2**k, 2**(k+1)); these bounds hold every nonzero float32.
_MIN_EXPONENT, _MAX_EXPONENT = -149, 127


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
        return dict(sorted(_sum_histograms([v for v in self.variables if v.dtype != "float32"]).items()))

    def as_dict(self) -> dict[str, Any]:
        """The report as plain Python values (JSON-ready apart from non-finite floats)."""
        return dataclasses.asdict(self)


def diagnose(trainer, num_batches: int = 4, loss_scale: Optional[float] = None,
             objective: Optional[str] = None) -> PrecisionReport:
    """Compares one objective of the trainer's model in its policy with float32 on the trainer's next
    `num_batches` train batches.

    The objective's loss is its entry in what `compute_loss` returns, its gradients are those of its
    variables, and its loss scale is its own. Every pass starts from the trainer's current weights
    (call `trainer.restore()` first to diagnose a checkpoint) and sees the same micro-batches, split as
    the train step splits them; the mixed pass runs at the comparison scale of the module docstring.
    The model's variables are left bit-identical and the optimizers and loss scales untouched, but
    `trainer.train_iterator` advances by `num_batches`.

    Args:
      trainer: a constructed `mixloop.Trainer`.
      num_batches: train batches to read, at least 1.
      loss_scale: the loss scale to examine gradients at; by default the objective's current scale.
      objective: the name of the objective to diagnose; None for a trainer's only objective.

    Raises:
      UserError: when the policy computes in float32, so there is nothing to compare, when the
        trainer's strategy has several replicas (the passes run eagerly on one device), when the
        train data has no batch left, or when `objective` names none of the trainer's objectives (or
        is None while there are several); `UnmeasurableLoss`, one, when the float32 pass cannot
        take the loss's gradients (its `compute_loss` runs the trainer's model other than through
        `self.model`).
      ValueError: when `num_batches` is below 1 or `loss_scale` is not positive and finite.
    """
    if objective is None:
        if len(trainer.objectives) > 1:
            raise UserError(f"the trainer has several objectives, {list(trainer.objectives)}; name "
                            "the one to diagnose")
        objective = next(iter(trainer.objectives))
    return diagnose_objectives(trainer, [objective], num_batches, loss_scale)[0]


def diagnose_objectives(trainer, objectives: Sequence[str], num_batches: int = 4,
                        loss_scale: Optional[float] = None) -> list[PrecisionReport]:
    """`diagnose` for each of the named `objectives` in turn, all on the same `num_batches` batches
    (the train iterator advances once); one report per objective, in the order given.

    Raises:
      UserError, ValueError: as `diagnose`.
    """
    _check_diagnosable(trainer, objectives, num_batches, loss_scale)
    return diagnose_batches(trainer, objectives, itertools.islice(trainer.train_iterator, num_batches),
                            loss_scale)


def diagnose_batches(trainer, objectives: Sequence[str], batches: Iterable[Any],
                     loss_scale: Optional[float] = None, relative_errors: bool = True,
                     float8: bool = True, stop_requested: Callable[[], bool] = lambda: False
                     ) -> list[PrecisionReport]:
    """`diagnose_objectives` on the given train `batches` (global batches, as the train data yields
    them) instead of the run's next ones: the automatic placement reads its own iterator. Without
    `relative_errors` the float32 pass is not repeated at NOISE_SCALE, a third less work, and every
    rel.err is None; without `float8` no layer's FP8 column is measured (every `LayerReport.float8`
    and `Advice.float8` is None), so the Dense layers' inputs and output gradients are not held
    (1.2 GB for charlm at width 512). The advice on float32 layers and the initial scale reads
    neither. The diagnosis gives up once `stop_requested()` (a stop of the run), which it asks
    after building the twin, before each pass and, while a pass is traced, at each layer call and
    backward step and each layer's statistics: on charlm no more than 1.4 s apart (the first call
    of a traced pass, optimized and run by TensorFlow).

    Raises:
      UserError, ValueError: as `diagnose`, and UserError when `batches` is empty.
      interrupts.ProbeStopped: once `stop_requested()`, the model's variables put back.
    """
    _check_diagnosable(trainer, objectives, 1, loss_scale)
    batches = list(batches)
    if not batches:
        raise UserError("the train data has no batches left to diagnose")
    micro_batches = [micro_batch for batch in batches
                     for micro_batch in _micro_batches(batch, trainer.train_step.accumulation_steps)]
    twin = build_model(trainer.build_model, Policy.from_string("float32"))
    interrupts.check_stop(stop_requested)
    # As the trainer quantized its model, so that the twin's variables pair with the model's.
    float8_layers.quantize(twin, trainer.float8_paths)
    _freeze_as(twin, trainer.model)
    return [_diagnose_objective(trainer, name, twin, micro_batches, len(batches), loss_scale,
                                relative_errors, float8, stop_requested) for name in objectives]


def _freeze_as(twin: keras.Model, model: keras.Model) -> None:
    """Sets each of `twin`'s layers trainable as its counterpart in `model` is (paired in order:
    both come from one `build_model`), so that their trainable and non-trainable variables pair: a
    layer `build_objectives` froze after `build_model` (a momentum target network) is frozen in the
    model only."""
    for twin_layer, layer in zip(named_layers(twin).values(), named_layers(model).values()):
        twin_layer.trainable = layer.trainable  # Parents come first: a sublayer's own flag wins.


def _check_diagnosable(trainer, objectives: Sequence[str], num_batches: int,
                       loss_scale: Optional[float]) -> None:
    """Raises `diagnose`'s errors for what it refuses before reading any data."""
    if trainer.policy.compute_dtype == tf.float32:
        raise UserError(
            f"precision.policy={trainer.config.precision.policy!r} computes in float32: there is "
            "nothing to compare; diagnose a 16-bit policy, e.g. --config.precision.policy=mixed_float16"
        )
    if trainer.strategy.num_replicas_in_sync > 1:
        raise UserError(
            f"the diagnosis runs on one device, but config.distribution="
            f"{trainer.config.distribution!r} gives {trainer.strategy.num_replicas_in_sync} replicas; "
            "add --config.distribution=one_device"
        )
    unknown = [name for name in objectives if name not in trainer.objectives]
    if unknown:
        raise UserError(f"unknown objective {unknown[0]!r}; the trainer's objectives are "
                        f"{list(trainer.objectives)}")
    if num_batches < 1:
        raise ValueError(f"num_batches must be at least 1, got {num_batches!r}")
    if loss_scale is not None and not 0 < loss_scale < math.inf:
        raise ValueError(f"loss_scale must be positive and finite, got {loss_scale!r}")


def _diagnose_objective(trainer, objective: str, twin: keras.Model, micro_batches: list,
                        num_batches: int, loss_scale: Optional[float], relative_errors: bool,
                        float8: bool, stop_requested: Callable[[], bool]) -> PrecisionReport:
    """The report on `objective`, from passes over `micro_batches` (read from `num_batches`
    batches), given up once `stop_requested()`."""
    policy, model = trainer.policy, trainer.model
    scale = float(trainer.objectives[objective].loss_scale.scale.numpy() if loss_scale is None
                  else loss_scale)
    saved = [variable.numpy() for variable in model.variables]
    # All variables, not get_weights(), which leaves out seed generators' states.
    _assign(twin.variables, saved)
    try:
        layers, variables, comparison_scale = _measure(trainer, objective, twin, micro_batches, scale,
                                                       relative_errors, float8, stop_requested)
    finally:
        # The forward passes ran in training mode, which moves e.g. BatchNorm statistics.
        _assign(model.variables, saved)

    # Pooled over every gradient value computed in 16 bits; an overwritten variable's new values
    # count only where they are not finite (the update cannot use them either).
    low_variables = [v for v in variables if v.dtype != "float32"]
    gradients = [v for v in low_variables if not v.overwritten]
    fractions = [_pooled(gradients, "zero_fraction"), _pooled(gradients, "subnormal_fraction"),
                 _pooled(low_variables, "overflow_fraction")]
    # With several objectives, each gradient problem says whose loss it is about.
    whose = f"objective {objective!r}: " if len(trainer.objectives) > 1 else ""
    return PrecisionReport(
        trainer=trainer.config.trainer, objective=objective, objectives=list(trainer.objectives),
        policy=str(policy), compute_dtype=policy.compute_dtype.name,
        step=int(trainer.global_step.numpy()), num_batches=num_batches,
        num_micro_batches=len(micro_batches), loss_scale=scale, comparison_scale=comparison_scale,
        gradient_zero_fraction=fractions[0], gradient_subnormal_fraction=fractions[1],
        gradient_overflow_fraction=fractions[2], layers=layers, variables=variables,
        advice=_advise(layers, variables, fractions, scale, policy, trainer.config.precision, whose,
                       float8_layers.float8_paths(model), float8_layers.auto_paths(model, policy)),
    )


def write_json(report: PrecisionReport, path: str) -> str:
    """The report as strict JSON; non-finite numbers become the strings "inf", "-inf" and "nan"."""
    with open(path, "w") as f:
        json.dump(_strict_json(report.as_dict()), f, indent=2, allow_nan=False)
        f.write("\n")
    return path


def _strict_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(key): _strict_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_strict_json(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


# ----- Measuring: two passes per micro-batch, summed into tallies. -----


@dataclasses.dataclass
class _Call:
    """One layer call inside the traced pass."""

    inputs: list[tf.Tensor]  # The floating inputs, after the layer's own autocast.
    outputs: list[tf.Tensor]  # The floating outputs.


@dataclasses.dataclass(frozen=True)
class _CallStats:
    """What the layer tallies read of one call, reduced inside the traced pass: a pass returns these
    numbers, not every layer's tensors (which held 1.3 GB per pass for charlm at width 512, and
    TensorFlow's CPU allocator keeps its peak for the rest of the process)."""

    num_inputs: int  # Its floating inputs.
    max_abs_input: float  # The largest finite magnitude among them (0.0 without any)...
    non_finite_inputs: int  # ...and how many of their values are inf or NaN.
    max_abs_output: float
    non_finite_outputs: int
    max_abs_output_grad: float  # Of its outputs' gradients, at the pass's scale.
    output_grad_counts: np.ndarray  # `_cast_counts` of those gradients at the examined scale.


@dataclasses.dataclass
class _Pass:
    calls: dict[int, list[_CallStats]]  # Layer index -> its calls, in order of the layers' first calls.
    grads: list[np.ndarray]  # Unscaled float32 gradients of the objective's variables.
    # Layer index -> per call, (its floating inputs, its outputs' gradients) as float32 copies: the
    # layers whose FP8 column is measured.
    float8_values: dict[int, list[tuple[list[np.ndarray], list[np.ndarray]]]]


@dataclasses.dataclass(frozen=True)
class _Net:
    """What a pass runs: `model` in `policy`, recording `layers` (all of the model's, by index) and
    differentiating the objective's loss by `variables` (the objective's, in this model); `strays`:
    the objective's variables in the trainer's own model when `model` is the float32 twin, which
    the pass's loss must not reach (it would take gradients the twin does not see)."""

    model: keras.Model
    policy: Policy
    layers: list
    variables: list
    strays: list = dataclasses.field(default_factory=list)


def _measure(trainer, objective: str, twin: keras.Model, micro_batches: list, scale: float,
             relative_errors: bool, float8: bool, stop_requested: Callable[[], bool]
             ) -> tuple[list[LayerReport], list[VariableReport], float]:
    """Runs the float32 passes over every micro-batch, then the mixed pass at the comparison scale
    their gradients give (each pass given up once `stop_requested()`); returns the layer reports,
    the variable reports of `objective` and that scale."""
    model, policy = trainer.model, trainer.policy
    model_layers = list(named_layers(model).items())
    layer_tallies = {index: _LayerTally(path, layer, float8)
                     for index, (path, layer) in enumerate(model_layers)
                     if tf.as_dtype(layer.compute_dtype).is_floating}
    # Both passes examine each layer's values in its compute dtype in the trainer's model.
    layer_dtypes = {index: tally.compute_dtype for index, tally in layer_tallies.items()}
    variables = trainer.objectives[objective].variables
    dtypes = _gradient_dtypes(model_layers, variables, policy)
    variable_tallies = [_VariableTally(v.path, dtype, getattr(v, "overwrite_with_gradient", False))
                        for v, dtype in zip(variables, dtypes)]
    float32_net = _Net(twin, Policy.from_string("float32"), list(named_layers(twin).values()),
                       _twin_variables(model, twin, variables), strays=model.trainable_variables)
    order, float32_grads, states = _measure_float32(
        twin, _traced_pass(trainer, objective, float32_net, layer_dtypes, stop_requested),
        micro_batches, scale, layer_tallies, variable_tallies, relative_errors)
    layers = [layer_tallies[i] for i in order]
    comparison_scale = _comparison_scale(scale, layers, variable_tallies, policy.compute_dtype)
    mixed_pass = _traced_pass(
        trainer, objective, _Net(model, policy, [layer for _, layer in model_layers], variables),
        layer_dtypes, stop_requested,
        float8=[index for index, tally in layer_tallies.items() if tally.float8])
    float32_reached = _any_nonzero(float32_grads)
    for micro_batch, grads, state in zip(micro_batches, float32_grads, states):
        mixed = mixed_pass(micro_batch, comparison_scale, state)
        _check_reached(objective, float32_reached, mixed.grads)
        for index in order:
            layer_tallies[index].add_mixed(mixed.calls.get(index, []),
                                           mixed.float8_values.get(index, []),
                                           scale / comparison_scale)
        for tally, float32_grad, mixed_grad in zip(variable_tallies, grads, mixed.grads):
            tally.add_mixed(float32_grad, mixed_grad)
    eps = DtypeRange.of(policy.compute_dtype).eps
    return ([layer.report() for layer in layers], [tally.report(eps) for tally in variable_tallies],
            comparison_scale)


def _any_nonzero(grads: list[list[np.ndarray]]) -> bool:
    """Whether any micro-batch's gradient (lists of arrays, per micro-batch) has a nonzero value
    (inf and NaN count)."""
    return any(np.any(grad != 0) for micro_batch in grads for grad in micro_batch)


def _check_reached(objective: str, float32_reached: bool, mixed_grads: list[np.ndarray]) -> None:
    """Raises when the float32 pass found no nonzero gradient (`float32_reached` False) but the
    mixed pass does: the loss runs something other than the twin in the float32 pass, and zero
    gradients would read as gradients with nothing to scale.

    Raises:
      UnmeasurableLoss: saying so.
    """
    if not float32_reached and _any_nonzero([mixed_grads]):
        raise _unmeasurable(objective, "its gradients are all zero in the float32 pass but not in "
                            "the mixed one, so the loss does not run the same model in both")


def _unmeasurable(objective: str, why: str) -> UnmeasurableLoss:
    """The one line the doctor and the probe give, instead of any figure or advice, for a loss
    whose gradients the float32 pass cannot take."""
    return UnmeasurableLoss(f"the precision probe cannot measure objective {objective!r}'s loss: "
                            f"{why}")


@contextlib.contextmanager
def _running(trainer, net: _Net) -> Iterator[None]:
    """`trainer.model` and `trainer.policy` are the pass's own for the `with` block (the float32
    twin and float32 in the float32 pass), put back on exit, errors included: a `compute_loss`
    that runs `self.model` itself (a MAML inner loop, a gradient penalty through
    `self.model.discriminator` and `self.policy`) then runs the model the pass measures."""
    saved = trainer.model, trainer.policy
    trainer.model, trainer.policy = net.model, net.policy
    try:
        yield
    finally:
        trainer.model, trainer.policy = saved


def _stray_paths(net: _Net, stray_grads: list) -> list[str]:
    """The paths of `net.strays` the pass's loss reached (their gradients are not None)."""
    return [variable.path for variable, grad in zip(net.strays, stray_grads) if grad is not None]


def _refuse_strays(objective: str, strays: list[str]) -> None:
    """Raises when the float32 pass's loss reached the trainer's own variables at `strays` (paths):
    their gradients would be missing from the twin's, so every figure would be partial.

    Raises:
      UnmeasurableLoss: naming the variables and how to reach them so the pass can swap them.
    """
    if strays:
        raise _unmeasurable(
            objective, f"compute_loss reaches the trainer's model ({', '.join(strays[:3])}) other "
            "than through self.model, so its float32 pass cannot run on the float32 twin; reach "
            "the model's layers through self.model inside compute_loss (e.g. "
            "self.model.get_layer(NAME), not a layer kept in an attribute)")


def _twin_variables(model: keras.Model, twin: keras.Model, variables: list) -> list:
    """The twin's counterparts of `variables`, trainable variables of `model`: those in the same
    places of the twin's `trainable_variables` (both models come from one `build_model`)."""
    places = {id(variable): index for index, variable in enumerate(model.trainable_variables)}
    return [twin.trainable_variables[places[id(variable)]] for variable in variables]


def _measure_float32(twin: keras.Model, float32_pass: Callable[..., _Pass],
                     micro_batches: list, scale: float, layer_tallies: dict[int, _LayerTally],
                     variable_tallies: list[_VariableTally], relative_errors: bool
                     ) -> tuple[list[int], list[list[np.ndarray]], list[list[np.ndarray]]]:
    """Runs `float32_pass` (through `twin`) over every micro-batch and (for `relative_errors`)
    repeats it at NOISE_SCALE, adding both to the tallies; returns the indices of the layers called,
    in the order of their first calls, every micro-batch's float32 gradients, and the non-trainable
    state each micro-batch started from."""
    order: dict[int, None] = {}
    float32_grads, states = [], []
    for micro_batch in micro_batches:
        states.append([variable.numpy() for variable in twin.non_trainable_variables])
        reference = float32_pass(micro_batch, 1.0, states[-1], examined_scale=scale)
        repeated = (float32_pass(micro_batch, NOISE_SCALE, states[-1]).grads if relative_errors
                    else [None] * len(reference.grads))
        order.update(dict.fromkeys(i for i in reference.calls if i in layer_tallies))
        for index in order:
            layer_tallies[index].add_float32(reference.calls.get(index, []))
        for tally, grad, repeated_grad in zip(variable_tallies, reference.grads, repeated):
            tally.add_float32(grad, repeated_grad, scale)
        float32_grads.append(reference.grads)
    return list(order), float32_grads, states


def _comparison_scale(scale: float, layers: list, variables: list, compute_dtype: tf.DType) -> float:
    """The module docstring's comparison scale, from the float32 gradients of `layers` and `variables`
    (reports or tallies)."""
    low_layers = [layer for layer in layers if layer.compute_dtype != "float32"]
    low_variables = [variable for variable in variables if variable.dtype != "float32"]
    largest = _largest_gradient(low_layers, low_variables)
    if not 0 < largest < math.inf:  # No 16-bit gradient, or float32's own overflowed: nothing fits.
        return scale
    log2_scale = DtypeRange.of(compute_dtype).safe_log2_scale(largest, COMPARISON_MARGIN_BITS)
    return min(scale, 2.0**log2_scale)


def _micro_batches(batch: Any, num_micro_batches: int) -> list:
    if num_micro_batches == 1:
        return [batch]
    split = split_micro_batches(batch, num_micro_batches)
    return [tf.nest.map_structure(lambda t, i=i: t[i], split) for i in range(num_micro_batches)]


def _traced_pass(trainer, objective: str, net: _Net, dtypes: dict[int, str],
                 stop_requested: Callable[[], bool], float8: Collection[int] = ()
                 ) -> Callable[..., _Pass]:
    """The train step's micro-step for `objective` through `net`, recording every layer call, as a
    function of (micro-batch, loss scale, non-trainable state, examined_scale=1.0); its gradients
    are unscaled. Each pass starts from the non-trainable `state` (seed generators' states,
    BatchNorm statistics), so that every pass over a micro-batch draws the same random numbers.
    Each call of a layer in `dtypes` (index -> dtype) comes back as its `_CallStats`, its output
    gradients times `examined_scale` counted as cast to that dtype; the layers in `float8` (indices)
    also come back with their inputs and output gradients (the FP8 column needs every value).
    A pass raises `interrupts.ProbeStopped` once `stop_requested()`, asked as it starts and,
    while it is traced, at each layer call, backward step and layer's statistics.

    The passes run inside a `tf.function`, as the train step does, not eagerly: eager
    `tf.custom_gradient` treats a Keras variable passed as an argument as a captured variable
    (it compares the wrapper with the `tf.Variable` read inside) and calls the gradient with
    `variables=`, which Keras's float8 layers (`model.quantize("float8")`) do not answer; traced,
    the arguments are read first and the gradient is the one the train step takes."""

    failures: list[tuple[int, str, Exception]] = []  # (layer index, stage, error), finest first.
    strays: list[str] = []  # The paths of `net.strays` the loss reached, found while tracing.

    def traced(batch, scale, examined_scale):
        with (tf.GradientTape() as tape,
              _recording_calls(net.layers, tape.watch, failures, stop_requested) as calls,
              _running(trainer, net)):
            outputs = forward(net.model, net.policy, tracing.hook(trainer.model_inputs)(batch),
                              training=True)
            loss = as_losses(tracing.hook(trainer.compute_loss)(outputs, batch),
                             trainer.objectives)[objective]
            scaled_loss = per_weight(loss.value, tf.stop_gradient(loss.weight)) * scale  # As the step.
        layer_outputs = {index: [call.outputs for call in records] for index, records in calls.items()}
        try:
            grads, output_grads, stray_grads = tape.gradient(
                scaled_loss, (net.variables, layer_outputs, net.strays))
        except Exception as error:  # A layer's own custom gradient: whatever it raises.
            if calls.in_backward:
                calls.failures.append((calls.in_backward[-1], "backward", error))
            raise
        strays[:] = _stray_paths(net, stray_grads)
        grads = [tf.zeros(v.shape) if g is None else g for g, v in zip(grads, net.variables)]
        output_grads = tf.nest.map_structure(
            lambda g, t: tf.zeros_like(t) if g is None else g, output_grads, layer_outputs)
        # A function returns tensors in sorted structures: the calls' order goes out as a tensor.
        order = tf.constant(list(calls), tf.int32, shape=[len(calls)])
        stats = {}
        for index, records in calls.items():
            if index in dtypes:
                calls.check_stop()
                stats[index] = [_call_stats(call, call_grads, examined_scale, dtypes[index])
                                for call, call_grads in zip(records, output_grads[index])]
        float8_values = {index: [(call.inputs, call_grads)
                                 for call, call_grads in zip(records, output_grads[index])]
                         for index, records in calls.items() if index in float8}
        return order, stats, grads, float8_values

    traced = tracing.function(traced)

    def run(batch: Any, scale: float, state: list[np.ndarray], examined_scale: float = 1.0) -> _Pass:
        interrupts.check_stop(stop_requested)
        _assign(net.model.non_trainable_variables, state)
        try:
            order, stats, grads, float8_values = traced(
                batch, tf.constant(scale, tf.float32), tf.constant(examined_scale, tf.float32))
        except interrupts.ProbeStopped:  # Not the layer's failure, where it was raised.
            raise
        except Exception:
            if not failures:
                raise
            index, stage, error = failures[0]
            path = list(named_layers(net.model))[index]
            raise UserError(f"layer {path!r} ({type(net.layers[index]).__name__}) cannot be "
                            f"measured: its {stage} pass, traced as the train step traces it, "
                            f"raised {described(error)}") from None
        _refuse_strays(objective, strays)
        return _Pass(
            calls={index: [_CallStats(**{name: value.numpy() for name, value in call.items()})
                           for call in stats[index]]
                   for index in order.numpy().tolist() if index in stats},
            grads=[_as_float32(g) / np.float32(scale) for g in grads],
            float8_values=tf.nest.map_structure(_as_float32, float8_values),
        )

    return run


def _call_stats(call: _Call, output_grads: list[tf.Tensor], examined_scale: tf.Tensor,
                dtype: str) -> dict[str, tf.Tensor]:
    """`call`'s `_CallStats` as tensors, inside the traced pass; `output_grads`: its outputs'."""
    return {"num_inputs": tf.constant(len(call.inputs)), "max_abs_input": _max_abs(call.inputs),
            "non_finite_inputs": _num_non_finite(call.inputs),
            "max_abs_output": _max_abs(call.outputs),
            "non_finite_outputs": _num_non_finite(call.outputs),
            "max_abs_output_grad": _max_abs(output_grads),
            "output_grad_counts": sum((_cast_counts(grad, examined_scale, dtype)
                                       for grad in output_grads), tf.zeros([4], tf.int64))}


class _Calls(dict):
    """Layer index -> its calls; `in_backward`: the layers the backward pass has entered at an output
    and not yet left at every input, innermost last (a failing custom gradient is in the last);
    `failures`: where to add (layer index, "forward" or "backward", the error) when one fails;
    `stop_requested`: asked at each step of the tracing, to give the pass up."""

    def __init__(self, failures: list[tuple[int, str, Exception]],
                 stop_requested: Callable[[], bool]):
        super().__init__()
        self.in_backward: list[int] = []
        self.failures = failures
        self.stop_requested = stop_requested

    def check_stop(self) -> None:
        interrupts.check_stop(self.stop_requested)

    def enter(self, index: int) -> None:
        self.check_stop()
        self.in_backward.append(index)

    def leave(self, index: int) -> None:
        self.check_stop()
        if index in self.in_backward:  # Its other inputs left it already.
            self.in_backward.remove(index)


def _on_backward(tensor: tf.Tensor, note: Callable[[], None]) -> tf.Tensor:
    """`tensor`, whose gradient calls `note` when the backward pass reaches it."""

    @tf.custom_gradient
    def identity(x):
        def grad(dy):
            note()
            return dy

        return tf.identity(x), grad

    return identity(tensor)


@contextlib.contextmanager
def _recording_calls(layers: list, watch, failures: list,
                     stop_requested: Callable[[], bool]) -> Iterator[_Calls]:
    """Wraps each layer's call to record its floating inputs and outputs (and `watch` the outputs,
    so the tape can differentiate by them), and where the backward pass is (`_Calls`); a layer
    that raises is added to `failures`; each call and backward step raises
    `interrupts.ProbeStopped` once `stop_requested()`. Unwraps on exit."""
    calls = _Calls(failures, stop_requested)

    def recording(index, layer, call):
        def recorded_call(*args, **kwargs):
            calls.check_stop()
            records = calls.setdefault(index, [])  # On entry, so a block comes before its sublayers.
            if isinstance(layer, _NOISE_LAYERS):
                kwargs["training"] = False
            # The backward pass leaves the layer at its inputs and enters it at its outputs.
            args, kwargs = tf.nest.map_structure(
                lambda t: _on_backward(t, lambda: calls.leave(index))
                if isinstance(t, tf.Tensor) and t.dtype.is_floating else t, (args, kwargs))
            floating_inputs = _floating((args, kwargs))
            try:
                outputs = call(*args, **kwargs)
            except Exception as error:
                calls.failures.append((index, "forward", error))  # A sublayer's comes first.
                raise
            outputs = tf.nest.map_structure(
                lambda t: _on_backward(t, lambda: calls.enter(index))
                if isinstance(t, tf.Tensor) and t.dtype.is_floating else t, outputs)
            floating_outputs = _floating((outputs,))
            for tensor in floating_outputs:
                watch(tensor)
            records.append(_Call(floating_inputs, floating_outputs))
            return outputs

        return recorded_call

    names = [_call_name(layer) for layer in layers]
    # An instance's own call (layer_precision's cast back to the compute dtype) is put back on exit.
    own_calls = [vars(layer).get(name) for layer, name in zip(layers, names)]
    # object.__setattr__ bypasses Keras's attribute tracking, which would track the wrapper.
    for index, (layer, name) in enumerate(zip(layers, names)):
        object.__setattr__(layer, name, recording(index, layer, getattr(layer, name)))
    try:
        yield calls
    finally:
        for layer, name, own_call in zip(layers, names, own_calls):
            if own_call is None:
                object.__delattr__(layer, name)
            else:
                object.__setattr__(layer, name, own_call)


def _call_name(layer: keras.layers.Layer) -> str:
    """The method Keras's `__call__` runs: `quantized_call` for a quantized layer (a float8 Dense)."""
    return "call" if layer.quantization_mode is None else "quantized_call"


def _assign(variables: list, values: list[np.ndarray]) -> None:
    for variable, value in zip(variables, values):
        variable.assign(value)


def _floating(structure: Any) -> list[tf.Tensor]:
    return [t for t in tf.nest.flatten(structure) if tf.is_tensor(t) and t.dtype.is_floating]


def _as_float32(tensor: Any) -> np.ndarray:
    """A float32 NumPy copy of a tensor (IndexedSlices gradients become dense)."""
    return tf.cast(tf.convert_to_tensor(tensor), tf.float32).numpy()


def _gradient_dtypes(layers: list[tuple[str, Any]], variables: list, policy: Policy) -> list[str]:
    """The dtype each variable's gradient is computed in: the compute dtype of the layer, among the
    (path, layer) pairs `layers`, that owns it."""
    compute_dtypes = {path: layer.compute_dtype for path, layer in layers}
    default = policy.compute_dtype.name
    return [compute_dtypes.get(v.path.rpartition("/")[0], default) for v in variables]


def _cast_counts(values: Any, scale: Any, dtype: str) -> tf.Tensor:
    """[nonzero, zero, subnormal, inf] (int64): of the nonzero `values` (a tensor or an array, as
    float32), how many become zero, subnormal or inf once multiplied by `scale` (in float32) and
    cast to `dtype`."""
    values = tf.cast(values, tf.float32)
    nonzero = tf.not_equal(values, 0.0)
    cast = tf.abs(tf.cast(tf.cast(values * scale, dtype), tf.float32))
    min_normal = DtypeRange.of(dtype).min_normal

    def count(where: tf.Tensor) -> tf.Tensor:
        return tf.math.count_nonzero(tf.logical_and(nonzero, where))

    return tf.stack([tf.math.count_nonzero(nonzero), count(tf.equal(cast, 0.0)),
                     count(tf.logical_and(cast > 0.0, cast < min_normal)), count(tf.math.is_inf(cast))])


def _log2_histogram(values: np.ndarray) -> np.ndarray:
    """Counts of the finite nonzero magnitudes, at index k - _MIN_EXPONENT for [2**k, 2**(k+1))."""
    magnitudes = np.abs(values[np.isfinite(values) & (values != 0)])
    _, exponents = np.frexp(magnitudes)  # magnitude = mantissa * 2**exponent, mantissa in [0.5, 1).
    return np.bincount(exponents - 1 - _MIN_EXPONENT, minlength=_MAX_EXPONENT - _MIN_EXPONENT + 1)


def _max_abs(tensors: list[tf.Tensor]) -> tf.Tensor:
    """The largest finite magnitude in `tensors` (a float32 scalar; 0.0 without any)."""
    largest = [tf.reduce_max(tf.where(tf.math.is_finite(t), tf.abs(t), 0.0))
               for t in (tf.cast(t, tf.float32) for t in tensors)]
    # The 0.0 also stands for an empty tensor, whose reduce_max is float32's lowest value.
    return tf.reduce_max(tf.stack(largest + [tf.constant(0.0)]))


def _num_non_finite(tensors: list[tf.Tensor]) -> tf.Tensor:
    """How many values of `tensors` are inf or NaN (an int64 scalar)."""
    return sum((tf.math.count_nonzero(tf.logical_not(tf.math.is_finite(t))) for t in tensors),
               tf.constant(0, tf.int64))


def _squared_norm(values: np.ndarray) -> float:
    """The sum of squares in float64; inf when any value is inf or NaN."""
    return float(np.sum(np.square(values, dtype=np.float64))) if np.isfinite(values).all() else math.inf


def _fraction(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _pooled(variables: list[VariableReport], name: str) -> float:
    """The fraction `name` of every value of `variables` together."""
    return _fraction(sum(getattr(v, name) * v.num_values for v in variables),
                     sum(v.num_values for v in variables))


class _LayerTally:
    """One layer's values summed over micro-batches."""

    def __init__(self, path: str, layer: keras.layers.Layer, float8: bool):
        self.path, self.compute_dtype = path, layer.compute_dtype
        # The FP8 column, when measured (`float8`), for the layers Keras can train in FP8.
        self.float8 = (float8_report.Float8Tally(layer)
                       if float8 and float8_layers.can_train_in_float8(layer) else None)
        self.max_abs_input: Optional[float] = None  # Stays None for layers that read only ids.
        self.max_abs_output = self.max_abs_output_grad = 0.0
        self.non_finite_outputs = self.float32_non_finite_outputs = 0
        self.creates_non_finite = False
        self.grad_counts = np.zeros(4, np.int64)

    def add_float32(self, float32_calls: list[_CallStats]) -> None:
        """One micro-batch's float32 pass (unscaled, its output gradients counted at the loss scale)."""
        for call in float32_calls:
            if call.num_inputs:
                self.max_abs_input = max(self.max_abs_input or 0.0, float(call.max_abs_input))
            self.max_abs_output = max(self.max_abs_output, float(call.max_abs_output))
            self.float32_non_finite_outputs += int(call.non_finite_outputs)
            self.max_abs_output_grad = max(self.max_abs_output_grad, float(call.max_abs_output_grad))
            self.grad_counts += call.output_grad_counts

    def add_mixed(self, mixed_calls: list[_CallStats], float8_values: list,
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


class _VariableTally:
    """One variable's gradients summed over micro-batches."""

    def __init__(self, path: str, dtype: str, overwritten: bool):
        self.path, self.dtype, self.overwritten = path, dtype, overwritten
        self.counts = np.zeros(4, np.int64)  # As _cast_counts.
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
        self.counts += _cast_counts(grad, scale, self.dtype).numpy()
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


# ----- Advising. -----


def _advise(layers: list[LayerReport], variables: list[VariableReport], fractions: list[float],
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
    kept_layers = [layer for layer in low_layers if not _is_under(layer.path, hot_paths)]
    kept_variables = [v for v in low_variables if not _is_under(v.path, hot_paths)]
    largest_grad = _largest_gradient(kept_layers, kept_variables)
    initial_scale = zero_fraction = None
    if policy.compute_dtype == tf.float16:
        initial_scale, zero_fraction = _float16_initial_scale(kept_layers, kept_variables)

    bfloat16 = DtypeRange.of(tf.bfloat16)
    largest_value = max([layer.max_abs for layer in low_layers]
                        + [_largest_gradient(low_layers, low_variables)], default=0.0)
    bfloat16_headroom = bfloat16.headroom_bits(largest_value)
    bfloat16_zero_fraction = bfloat16.zero_fraction(_sum_histograms(low_variables))
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
        float8=float8_report.advise([(layer.path, layer.float8) for layer in layers if layer.float8],
                                    in_float8, float8_candidates),
    )


def initial_scale_keeping(report: PrecisionReport, float32_paths: Sequence[str]) -> Optional[float]:
    """The advised float16 initial scale once the layers at `float32_paths` (with their sublayers)
    compute in float32 too: the module docstring's rule over the gradients left in float16; None
    when none is left. `report.advice.initial_scale` is this for the advised layers."""
    kept_layers = [layer for layer in report.layers
                   if layer.compute_dtype == "float16" and not _is_under(layer.path, float32_paths)]
    kept_variables = [v for v in report.variables
                      if v.dtype == "float16" and not _is_under(v.path, float32_paths)]
    return _float16_initial_scale(kept_layers, kept_variables)[0]


def _float16_initial_scale(layers: list, variables: list) -> tuple[Optional[float], Optional[float]]:
    """The initial scale the float16 gradients of `layers` and `variables` (left in 16 bits) advise,
    and the fraction of those variables' gradients that flush to zero at it; Nones without any."""
    largest_grad = _largest_gradient(layers, variables)
    if not largest_grad > 0:
        return None, None
    float16, histogram = DtypeRange.of(tf.float16), _sum_histograms(variables)
    log2_scale = float16.safe_log2_scale(largest_grad, MARGIN_BITS)
    log2_default = round(math.log2(DEFAULT_INITIAL_SCALE))
    if log2_scale > log2_default and float16.zero_fraction(histogram, log2_default) <= UNDERFLOW_TOLERANCE:
        log2_scale = log2_default
    return 2.0**log2_scale, float16.zero_fraction(histogram, log2_scale)


def _largest_gradient(layers: list, variables: list) -> float:
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
            if not any(_is_under(other.path, [layer.path]) and other.path != layer.path
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


def _is_under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)


def _sum_histograms(variables: list[VariableReport]) -> dict[int, int]:
    total: dict[int, int] = {}
    for variable in variables:
        for k, count in variable.histogram.items():
            total[k] = total.get(k, 0) + count
    return total
