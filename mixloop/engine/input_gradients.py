"""The gradient of a model's outputs with respect to its inputs inside a loss (a gradient penalty), and
how its backward is scaled in mixed precision.

WGAN-GP's penalty, R1 regularization and input-gradient norms differentiate the model once inside
the loss (an inner backward) and the step differentiates the loss again (the outer backward,
through the inner one). The step's loss scale multiplies the loss, so the outer backward, second
order terms included, runs scaled; the inner backward does not: it starts from the model's outputs
at 1 and runs in the compute dtype. In float16 that is usually safe, as it differentiates each
example's own output, not a batch mean: its values have an example's magnitudes, not 1/batch of
them. `scale` lifts them further from float16's flush-to-zero range where they are small.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import tensorflow as tf


def input_gradients(fn: Callable[[tf.Tensor], tf.Tensor], inputs: tf.Tensor, *,
                    scale: float = 1.0) -> tf.Tensor:
    """d sum(fn(inputs)) / d inputs, in float32 and differentiable again (`mixloop.input_gradients`).

    Call it inside `compute_loss`, e.g. with `fn = lambda x: mixloop.forward(critic, self.policy, x,
    training=True)`: `fn` then runs in the compute dtype, and so does this inner backward through
    it. The step's loss scale does not reach it; `scale` multiplies `sum(fn(inputs))` before the
    backward and the gradient is divided by it after, in float32, so the 16-bit backward sees values
    `scale` times larger (keep `scale * max |d fn / d activation|` well below float16's 65504: an
    inf here makes the loss inf, which stops the run rather than skipping an update).

    Args:
      fn: the model (or the part of it) to differentiate; summed over all its outputs, so each
        example's gradient is that of its own output.
      inputs: a floating tensor; float32 (what the step hands `compute_loss`) keeps the result float32.
      scale: the inner backward's loss scale; 1 (none) by default.

    Raises:
      TypeError: for integer inputs (no gradient) or an `fn` that returns something other than
        one floating tensor (a dict of outputs: pick the one to differentiate).
      ValueError: for a `scale` that is not a positive finite number, or an `fn` whose output
        does not depend on `inputs` (it ran the model on something else).
    """
    _check_scale(scale)
    inputs = tf.convert_to_tensor(inputs)
    if not inputs.dtype.is_floating:
        raise TypeError(f"mixloop.input_gradients: inputs of dtype {inputs.dtype.name} have no "
                        "gradient; pass floating inputs (for integer ids, differentiate with "
                        "respect to their embeddings)")
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        total = tf.reduce_sum(tf.cast(_one_tensor(fn(inputs)), tf.float32)) * scale
    grads = tape.gradient(total, inputs)
    if grads is None:
        raise ValueError("mixloop.input_gradients: fn's output does not depend on inputs; fn must "
                         "run the model on the tensor it is given (lambda x: mixloop.forward(model, "
                         "self.policy, x, training=True)), not on another")
    return tf.cast(grads, tf.float32) / scale


def _check_scale(scale: Any) -> None:
    """Refuses a `scale` known to be zero, negative, inf or NaN: dividing by it afterwards would
    make the gradient inf or NaN, and the run diverge for a reason float16 has no part in. A
    `tf.Variable` is checked at its value when the loss is traced."""
    value = tf.get_static_value(scale)
    if value is None and isinstance(scale, tf.Variable):
        with tf.init_scope():  # Its value now, outside the trace.
            value = scale.numpy()
    if value is not None and not (np.ndim(value) == 0 and np.isfinite(value) and value > 0):
        value = value.item() if isinstance(value, np.generic) else value
        raise ValueError(f"mixloop.input_gradients: scale={value!r} is not allowed: a positive "
                         "finite number (the inner backward's loss scale; 1 for none)")


def _one_tensor(output: Any) -> tf.Tensor:
    """`output` as the one floating tensor to differentiate."""
    if isinstance(output, Mapping):
        raise TypeError(f"mixloop.input_gradients: fn returned a dict (keys {sorted(output)}); "
                        "return the one output to differentiate (lambda x: model(x)['score'])")
    if not tf.is_tensor(output) and not isinstance(output, (float, np.ndarray)):
        raise TypeError(f"mixloop.input_gradients: fn returned a {type(output).__name__}; return "
                        "the one output tensor to differentiate")
    return output
