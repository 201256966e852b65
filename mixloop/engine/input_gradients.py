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

from typing import Callable

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
    """
    inputs = tf.convert_to_tensor(inputs)
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        total = tf.reduce_sum(tf.cast(fn(inputs), tf.float32)) * scale
    return tf.cast(tape.gradient(total, inputs), tf.float32) / scale
