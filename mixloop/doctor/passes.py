"""The doctor's passes: one micro-step through a model in a policy, every layer call recorded.

A pass is the engine's micro-step (`micro_step.scaled_losses`) under a tape of its own, run traced
as the train step runs, with each layer's call wrapped to record its floating inputs and outputs
and where the backward pass is; each call's values are reduced to a few numbers (`CallStats`)
inside the traced function. While a pass is traced, the run's `model` and `policy` are the pass's
(the float32 twin and float32 in the float32 pass), so a `compute_loss` that runs `self.model`
itself runs the model measured; one that reaches the run's model another way is refused in one
line (`UnmeasurableLoss`). Keras's dropout and noise layers run in inference mode in every pass, so
that their masks cannot differ between passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Collection, Iterator

import keras
import numpy as np
import tensorflow as tf

from mixloop import interrupts
from mixloop.doctor.report import (DtypeRange, UnmeasurableLoss)
from mixloop.engine import micro_step, tracing
from mixloop.engine.layer_precision import named_layers
from mixloop.engine.policy import Policy, floating_leaves, is_floating
from mixloop.errors import UserError, described


# Layers that draw random numbers; every pass runs them in inference mode so the draws cannot differ.
_NOISE_LAYERS = (keras.layers.Dropout, keras.layers.GaussianDropout, keras.layers.GaussianNoise,
                 keras.layers.AlphaDropout)


@dataclasses.dataclass
class _Call:
    """One layer call inside the traced pass."""

    inputs: list[tf.Tensor]  # The floating inputs, after the layer's own autocast.
    outputs: list[tf.Tensor]  # The floating outputs.


@dataclasses.dataclass(frozen=True)
class CallStats:
    """What the layer tallies read of one call, reduced inside the traced pass: a pass returns these
    numbers, not every layer's tensors (which would hold every activation of a pass, and
    TensorFlow's CPU allocator keeps its peak for the rest of the process)."""

    num_inputs: int  # Its floating inputs.
    max_abs_input: float  # The largest finite magnitude among them (0.0 without any)...
    non_finite_inputs: int  # ...and how many of their values are inf or NaN.
    max_abs_output: float
    non_finite_outputs: int
    max_abs_output_grad: float  # Of its outputs' gradients, at the pass's scale.
    output_grad_counts: np.ndarray  # `cast_counts` of those gradients at the examined scale.


@dataclasses.dataclass
class Pass:
    calls: dict[int, list[CallStats]]  # Layer index -> its calls, in order of the layers' first calls.
    grads: list[np.ndarray]  # Unscaled float32 gradients of the objective's variables.
    # Layer index -> per call, (its floating inputs, its outputs' gradients) as float32 copies: the
    # layers whose FP8 column is measured.
    float8_values: dict[int, list[tuple[list[np.ndarray], list[np.ndarray]]]]


@dataclasses.dataclass(frozen=True)
class Net:
    """What a pass runs: `model` in `policy`, recording `layers` (all of the model's, by index) and
    differentiating the objective's loss by `variables` (the objective's, in this model); `strays`:
    the objective's variables in the trainer's own model when `model` is the float32 twin, which
    the pass's loss must not reach (it would take gradients the twin does not see)."""

    model: keras.Model
    policy: Policy
    layers: list
    variables: list
    strays: list = dataclasses.field(default_factory=list)


def traced_pass(run, objective: str, net: Net, dtypes: dict[int, str],
                stop_requested: Callable[[], bool], float8: Collection[int] = ()) -> Callable[..., Pass]:
    """The train step's micro-step for `objective` through `net`, recording every layer call, as a
    function of (micro-batch, loss scale, non-trainable state, examined_scale=1.0); its gradients
    are unscaled. Each pass starts from the non-trainable `state` (seed generators' states,
    BatchNorm statistics), so that every pass over a micro-batch draws the same random numbers.
    Each call of a layer in `dtypes` (index -> dtype) comes back as its `CallStats`, its output
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
              _running(run, net)):
            _, scaled = micro_step.scaled_losses(
                net.model, net.policy, tracing.hook(run.input_fn),
                tracing.hook(run.loss_fn), batch, list(run.objectives), {objective: scale})
        layer_outputs = {index: [call.outputs for call in records] for index, records in calls.items()}
        try:
            grads, output_grads, stray_grads = tape.gradient(
                scaled[objective], (net.variables, layer_outputs, net.strays))
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

    def one_pass(batch: Any, scale: float, state: list[np.ndarray], examined_scale: float = 1.0) -> Pass:
        interrupts.check_stop(stop_requested)
        assign(net.model.non_trainable_variables, state)
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
        return Pass(
            calls={index: [CallStats(**{name: value.numpy() for name, value in call.items()})
                           for call in stats[index]]
                   for index in order.numpy().tolist() if index in stats},
            grads=[_as_float32(g) / np.float32(scale) for g in grads],
            float8_values=tf.nest.map_structure(_as_float32, float8_values),
        )

    return one_pass


def _call_stats(call: _Call, output_grads: list[tf.Tensor], examined_scale: tf.Tensor,
                dtype: str) -> dict[str, tf.Tensor]:
    """`call`'s `CallStats` as tensors, inside the traced pass; `output_grads`: its outputs'."""
    return {"num_inputs": tf.constant(len(call.inputs)), "max_abs_input": _max_abs(call.inputs),
            "non_finite_inputs": _num_non_finite(call.inputs),
            "max_abs_output": _max_abs(call.outputs),
            "non_finite_outputs": _num_non_finite(call.outputs),
            "max_abs_output_grad": _max_abs(output_grads),
            "output_grad_counts": sum((cast_counts(grad, examined_scale, dtype)
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
                if is_floating(t) else t, (args, kwargs))
            floating_inputs = floating_leaves((args, kwargs))
            try:
                outputs = call(*args, **kwargs)
            except Exception as error:
                calls.failures.append((index, "forward", error))  # A sublayer's comes first.
                raise
            outputs = tf.nest.map_structure(
                lambda t: _on_backward(t, lambda: calls.enter(index))
                if is_floating(t) else t, outputs)
            floating_outputs = floating_leaves((outputs,))
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


@contextlib.contextmanager
def _running(run, net: Net) -> Iterator[None]:
    """`run.model` and `run.policy` are the pass's own for the `with` block (the float32
    twin and float32 in the float32 pass), put back on exit, errors included: a `compute_loss`
    that runs `self.model` itself (a MAML inner loop, a gradient penalty through
    `self.model.discriminator` and `self.policy`) then runs the model the pass measures."""
    saved = run.model, run.policy
    run.model, run.policy = net.model, net.policy
    try:
        yield
    finally:
        run.model, run.policy = saved


def _stray_paths(net: Net, stray_grads: list) -> list[str]:
    """The paths of `net.strays` the pass's loss reached (their gradients are not None)."""
    return [variable.path for variable, grad in zip(net.strays, stray_grads) if grad is not None]


def _refuse_strays(objective: str, strays: list[str]) -> None:
    """Raises when the float32 pass's loss reached the trainer's own variables at `strays` (paths):
    their gradients would be missing from the twin's, so every figure would be partial.

    Raises:
      UnmeasurableLoss: naming the variables and how to reach them so the pass can swap them.
    """
    if strays:
        raise unmeasurable(
            objective, f"compute_loss reaches the trainer's model ({', '.join(strays[:3])}) other "
            "than through self.model, so its float32 pass cannot run on the float32 twin; reach "
            "the model's layers through self.model inside compute_loss (e.g. "
            "self.model.get_layer(NAME), not a layer kept in an attribute)")


def unmeasurable(objective: str, why: str) -> UnmeasurableLoss:
    """The one line the doctor and the probe give, instead of any figure or advice, for a loss
    whose gradients the float32 pass cannot take."""
    return UnmeasurableLoss(f"the precision probe cannot measure objective {objective!r}'s loss: "
                            f"{why}")


def assign(variables: list, values: list[np.ndarray]) -> None:
    for variable, value in zip(variables, values):
        variable.assign(value)


def _as_float32(tensor: Any) -> np.ndarray:
    """A float32 NumPy copy of a tensor (IndexedSlices gradients become dense)."""
    return tf.cast(tf.convert_to_tensor(tensor), tf.float32).numpy()


def cast_counts(values: Any, scale: Any, dtype: str) -> tf.Tensor:
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

