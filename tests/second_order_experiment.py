"""tiny_experiment with a second-order loss that runs the model itself, as MAML does: `compute_loss`
takes one inner step of gradient descent on the micro-batch (an inner `tf.GradientTape` over
`self.model`) and returns the adapted model's loss, so the update differentiates through the inner
gradient. For the precision probe and the doctor, which must run such a loss on their float32 twin.

    python -m mixloop.diagnose --config=tests/second_order_experiment.py          # tests/ on PYTHONPATH
    python -m mixloop.diagnose --config=tests/second_order_experiment.py:stray

Expect: nonzero gradients for every variable and an advised initial scale. The "stray" variant runs
the model through a handle kept from `build_objectives` (`self.network`), not `self.model`, which
the doctor cannot swap for its twin: one line saying it cannot measure this loss, and why.
"""

import keras
import tensorflow as tf

import tiny_experiment

INNER_LEARNING_RATE = 0.1  # The inner step's size.


class SecondOrderTrainer(tiny_experiment.TinyTrainer):
    """The tiny classifier trained on its loss after one inner gradient step (first-order terms and
    the second-order ones through the inner gradient)."""

    def build_objectives(self):
        self.network = self.model  # A handle the "stray" variant runs instead of self.model.
        return super().build_objectives()

    def compute_loss(self, outputs, batch):
        features, labels = batch
        model = self.network if self.config.model.stray else self.model
        with tf.GradientTape() as inner:
            inner_loss = _cross_entropy(labels, model(features, training=True))
        weights = model.trainable_variables
        grads = inner.gradient(inner_loss, weights)
        adapted = [weight - INNER_LEARNING_RATE * grad for weight, grad in zip(weights, grads)]
        state = [variable.value for variable in model.non_trainable_variables]
        logits, _ = model.stateless_call(adapted, state, features, training=True)
        return _cross_entropy(labels, logits)


def _cross_entropy(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """The mean cross-entropy of float32 logits (the model's own call returns 16-bit ones)."""
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        labels, tf.cast(logits, tf.float32), from_logits=True))


def get_config(arg=None):
    config = tiny_experiment.get_config()
    config.trainer = "second_order_experiment.SecondOrderTrainer"
    config.model.dropout = 0.0  # No dropout: the inner and the adapted pass see the same network.
    config.model.stray = arg == "stray"  # Run the model through self.network, not self.model.
    if arg not in (None, "stray"):
        raise ValueError(f"unknown second_order_experiment variant {arg!r}; expected 'stray' or none")
    return config
