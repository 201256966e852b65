"""The precision doctor's diagnosis: the passes over a run's batches, tallied and advised.

`diagnose(run, num_batches)` runs the same micro-batches forward and backward from the same
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

A model with several objectives (a GAN's generator and discriminator) is diagnosed one objective at
a time, each on the same batches (`diagnose_objectives`): gradients are those of that objective's
loss by its own variables, examined at its own loss scale, and the layers' output gradients are those
of its loss; the layers' values come from the one forward pass all objectives share. The advised
initial scale is that objective's, while `config.precision` starts every objective's loss scale (unless
`build_objectives` gives it its own).

Gradients are those of one micro-batch's loss per weight (its mean), which is what the train step
scales and differentiates; a variable the loss does not reach has a zero gradient. While a pass is
traced, `run.model` and `run.policy` are the pass's (the twin and float32 in the float32
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

import itertools
import math
from typing import Any, Callable, Iterable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from mixloop import interrupts
from mixloop.doctor import advice, passes, tallies
from mixloop.doctor.report import (COMPARISON_MARGIN_BITS, DtypeRange, LayerReport, PrecisionReport, VariableReport)
from mixloop.engine import float8_layers
from mixloop.engine.layer_precision import build_model, named_layers
from mixloop.engine.micro_batches import split_micro_batches
from mixloop.engine.policy import Policy
from mixloop.errors import UserError


NOISE_SCALE = 3.0  # Not a power of two, so the repeated float32 pass rounds every product anew.


def diagnose(run, num_batches: int = 4, loss_scale: Optional[float] = None,
             objective: Optional[str] = None) -> PrecisionReport:
    """Compares one objective of the trainer's model in its policy with float32 on the trainer's next
    `num_batches` train batches.

    The objective's loss is its entry in what `compute_loss` returns, its gradients are those of its
    variables, and its loss scale is its own. Every pass starts from the trainer's current weights
    (call `run.restore()` first to diagnose a checkpoint) and sees the same micro-batches, split as
    the train step splits them; the mixed pass runs at the comparison scale of the module docstring.
    The model's variables are left bit-identical and the optimizers and loss scales untouched, but
    `run.train_iterator` advances by `num_batches`.

    Args:
      run: a constructed `mixloop.Trainer`.
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
        if len(run.objectives) > 1:
            raise UserError(f"the trainer has several objectives, {list(run.objectives)}; name "
                            "the one to diagnose")
        objective = next(iter(run.objectives))
    return diagnose_objectives(run, [objective], num_batches, loss_scale)[0]


def diagnose_objectives(run, objectives: Sequence[str], num_batches: int = 4,
                        loss_scale: Optional[float] = None) -> list[PrecisionReport]:
    """`diagnose` for each of the named `objectives` in turn, all on the same `num_batches` batches
    (the train iterator advances once); one report per objective, in the order given.

    Raises:
      UserError, ValueError: as `diagnose`.
    """
    _check_diagnosable(run, objectives, num_batches, loss_scale)
    return diagnose_batches(run, objectives, itertools.islice(run.train_iterator, num_batches),
                            loss_scale)


def diagnose_batches(run, objectives: Sequence[str], batches: Iterable[Any],
                     loss_scale: Optional[float] = None, relative_errors: bool = True,
                     float8: bool = True, stop_requested: Callable[[], bool] = lambda: False
                     ) -> list[PrecisionReport]:
    """`diagnose_objectives` on the given train `batches` (global batches, as the train data yields
    them) instead of the run's next ones: the automatic placement reads its own iterator. Without
    `relative_errors` the float32 pass is not repeated at NOISE_SCALE, a third less work, and every
    rel.err is None; without `float8` no layer's FP8 column is measured (every `LayerReport.float8`
    and `Advice.float8` is None), so the Dense layers' inputs and output gradients are not held
    (every value of them). The advice on float32 layers and the initial scale reads neither. The
    diagnosis gives up once `stop_requested()` (a stop of the run), which it asks after building
    the twin, before each pass and, while a pass is traced, at each layer call and backward step
    and each layer's statistics: at most the first call of a traced pass apart.

    Raises:
      UserError, ValueError: as `diagnose`, and UserError when `batches` is empty.
      interrupts.ProbeStopped: once `stop_requested()`, the model's variables put back.
    """
    _check_diagnosable(run, objectives, 1, loss_scale)
    batches = list(batches)
    if not batches:
        raise UserError("the train data has no batches left to diagnose")
    micro_batches = [micro_batch for batch in batches
                     for micro_batch in _micro_batches(batch, run.train_step.accumulation_steps)]
    twin = build_model(run.build_model, Policy.from_string("float32"))
    interrupts.check_stop(stop_requested)
    # As the trainer quantized its model, so that the twin's variables pair with the model's.
    float8_layers.quantize(twin, run.float8_paths)
    _freeze_as(twin, run.model)
    return [_diagnose_objective(run, name, twin, micro_batches, len(batches), loss_scale,
                                relative_errors, float8, stop_requested) for name in objectives]


def _freeze_as(twin: keras.Model, model: keras.Model) -> None:
    """Sets each of `twin`'s layers trainable as its counterpart in `model` is (paired in order:
    both come from one `build_model`), so that their trainable and non-trainable variables pair: a
    layer `build_objectives` froze after `build_model` (a momentum target network) is frozen in the
    model only."""
    for twin_layer, layer in zip(named_layers(twin).values(), named_layers(model).values()):
        twin_layer.trainable = layer.trainable  # Parents come first: a sublayer's own flag wins.


def _check_diagnosable(run, objectives: Sequence[str], num_batches: int,
                       loss_scale: Optional[float]) -> None:
    """Raises `diagnose`'s errors for what it refuses before reading any data."""
    if run.policy.compute_dtype == tf.float32:
        raise UserError(
            f"precision.policy={run.config.precision.policy!r} computes in float32: there is "
            "nothing to compare; diagnose a 16-bit policy, e.g. --config.precision.policy=mixed_float16"
        )
    if run.strategy.num_replicas_in_sync > 1:
        raise UserError(
            f"the diagnosis runs on one device, but config.distribution="
            f"{run.config.distribution!r} gives {run.strategy.num_replicas_in_sync} replicas; "
            "add --config.distribution=one_device"
        )
    unknown = [name for name in objectives if name not in run.objectives]
    if unknown:
        raise UserError(f"unknown objective {unknown[0]!r}; the trainer's objectives are "
                        f"{list(run.objectives)}")
    if num_batches < 1:
        raise ValueError(f"num_batches must be at least 1, got {num_batches!r}")
    if loss_scale is not None and not 0 < loss_scale < math.inf:
        raise ValueError(f"loss_scale must be positive and finite, got {loss_scale!r}")


def _diagnose_objective(run, objective: str, twin: keras.Model, micro_batches: list,
                        num_batches: int, loss_scale: Optional[float], relative_errors: bool,
                        float8: bool, stop_requested: Callable[[], bool]) -> PrecisionReport:
    """The report on `objective`, from passes over `micro_batches` (read from `num_batches`
    batches), given up once `stop_requested()`."""
    policy, model = run.policy, run.model
    scale = float(run.objectives[objective].loss_scale.scale.numpy() if loss_scale is None
                  else loss_scale)
    saved = [variable.numpy() for variable in model.variables]
    # All variables, not get_weights(), which leaves out seed generators' states.
    passes.assign(twin.variables, saved)
    try:
        layers, variables, comparison_scale = _measure(run, objective, twin, micro_batches, scale,
                                                       relative_errors, float8, stop_requested)
    finally:
        # The forward passes ran in training mode, which moves e.g. BatchNorm statistics.
        passes.assign(model.variables, saved)

    # Pooled over every gradient value computed in 16 bits; an overwritten variable's new values
    # count only where they are not finite (the update cannot use them either).
    low_variables = [v for v in variables if v.dtype != "float32"]
    gradients = [v for v in low_variables if not v.overwritten]
    fractions = [tallies.pooled(gradients, "zero_fraction"), tallies.pooled(gradients, "subnormal_fraction"),
                 tallies.pooled(low_variables, "overflow_fraction")]
    # With several objectives, each gradient problem says whose loss it is about.
    whose = f"objective {objective!r}: " if len(run.objectives) > 1 else ""
    return PrecisionReport(
        trainer=run.config.trainer, objective=objective, objectives=list(run.objectives),
        policy=str(policy), compute_dtype=policy.compute_dtype.name,
        step=int(run.global_step.numpy()), num_batches=num_batches,
        num_micro_batches=len(micro_batches), loss_scale=scale, comparison_scale=comparison_scale,
        gradient_zero_fraction=fractions[0], gradient_subnormal_fraction=fractions[1],
        gradient_overflow_fraction=fractions[2], layers=layers, variables=variables,
        advice=advice.advise(layers, variables, fractions, scale, policy, run.config.precision, whose,
                       float8_layers.float8_paths(model), float8_layers.auto_paths(model, policy)),
    )


def _measure(run, objective: str, twin: keras.Model, micro_batches: list, scale: float,
             relative_errors: bool, float8: bool, stop_requested: Callable[[], bool]
             ) -> tuple[list[LayerReport], list[VariableReport], float]:
    """Runs the float32 passes over every micro-batch, then the mixed pass at the comparison scale
    their gradients give (each pass given up once `stop_requested()`); returns the layer reports,
    the variable reports of `objective` and that scale."""
    model, policy = run.model, run.policy
    model_layers = list(named_layers(model).items())
    layer_tallies = {index: tallies.LayerTally(path, layer, float8)
                     for index, (path, layer) in enumerate(model_layers)
                     if tf.as_dtype(layer.compute_dtype).is_floating}
    # Both passes examine each layer's values in its compute dtype in the trainer's model.
    layer_dtypes = {index: tally.compute_dtype for index, tally in layer_tallies.items()}
    variables = run.objectives[objective].variables
    dtypes = _gradient_dtypes(model_layers, variables, policy)
    variable_tallies = [tallies.VariableTally(v.path, dtype, getattr(v, "overwrite_with_gradient", False))
                        for v, dtype in zip(variables, dtypes)]
    float32_net = passes.Net(twin, Policy.from_string("float32"), list(named_layers(twin).values()),
                       _twin_variables(model, twin, variables), strays=model.trainable_variables)
    order, float32_grads, states = _measure_float32(
        twin, passes.traced_pass(run, objective, float32_net, layer_dtypes, stop_requested),
        micro_batches, scale, layer_tallies, variable_tallies, relative_errors)
    layers = [layer_tallies[i] for i in order]
    comparison_scale = _comparison_scale(scale, layers, variable_tallies, policy.compute_dtype)
    mixed_pass = passes.traced_pass(
        run, objective, passes.Net(model, policy, [layer for _, layer in model_layers], variables),
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
        raise passes.unmeasurable(objective, "its gradients are all zero in the float32 pass but not in "
                            "the mixed one, so the loss does not run the same model in both")


def _twin_variables(model: keras.Model, twin: keras.Model, variables: list) -> list:
    """The twin's counterparts of `variables`, trainable variables of `model`: those in the same
    places of the twin's `trainable_variables` (both models come from one `build_model`)."""
    places = {id(variable): index for index, variable in enumerate(model.trainable_variables)}
    return [twin.trainable_variables[places[id(variable)]] for variable in variables]


def _measure_float32(twin: keras.Model, float32_pass: Callable[..., passes.Pass],
                     micro_batches: list, scale: float, layer_tallies: dict[int, tallies.LayerTally],
                     variable_tallies: list[tallies.VariableTally], relative_errors: bool
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
    largest = advice.largest_gradient(low_layers, low_variables)
    if not 0 < largest < math.inf:  # No 16-bit gradient, or float32's own overflowed: nothing fits.
        return scale
    log2_scale = DtypeRange.of(compute_dtype).safe_log2_scale(largest, COMPARISON_MARGIN_BITS)
    return min(scale, 2.0**log2_scale)


def _micro_batches(batch: Any, num_micro_batches: int) -> list:
    if num_micro_batches == 1:
        return [batch]
    split = split_micro_batches(batch, num_micro_batches)
    return [tf.nest.map_structure(lambda t, i=i: t[i], split) for i in range(num_micro_batches)]


def _gradient_dtypes(layers: list[tuple[str, Any]], variables: list, policy: Policy) -> list[str]:
    """The dtype each variable's gradient is computed in: the compute dtype of the layer, among the
    (path, layer) pairs `layers`, that owns it."""
    compute_dtypes = {path: layer.compute_dtype for path, layer in layers}
    default = policy.compute_dtype.name
    return [compute_dtypes.get(v.path.rpartition("/")[0], default) for v in variables]

