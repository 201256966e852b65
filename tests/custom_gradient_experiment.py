"""tiny_experiment with a layer of the user's own `tf.custom_gradient` after its hidden layer: the
precision tools' custom-gradient tests.

Variants: "clip" clips the gradient flowing back through it to [-bound, bound]; "keras_variable"
scales by a Keras weight passed to the custom gradient as an argument (Keras's float8 pattern),
which eager `tf.custom_gradient` cannot take (it calls the gradient with `variables=`) and a traced
one can; "raising" has a gradient that raises, traced or not.

Run it as `python -m mixloop.train --config=tests/custom_gradient_experiment.py:clip` (tests/ on
PYTHONPATH).
"""

import keras
import tensorflow as tf

import tiny_experiment

BOUND = 1e-3  # The "clip" variant's bound on the gradient it hands back.


class ClipGradient(keras.layers.Layer):
    """The identity, whose backward pass clips the gradient to [-BOUND, BOUND]."""

    def call(self, x):
        @tf.custom_gradient
        def clipped(x):
            return tf.identity(x), lambda dy: tf.clip_by_value(dy, -BOUND, BOUND)

        return clipped(x)


class KerasVariableGradient(keras.layers.Layer):
    """x times a trainable scalar, whose custom gradient takes the Keras weight as an argument."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(), initializer="ones", name="gain")

    def call(self, x):
        @tf.custom_gradient
        def scaled(x, gain):
            gain = tf.cast(gain, x.dtype)

            def grad(dy):
                return dy * gain, tf.cast(tf.reduce_sum(dy * x), tf.float32)

            return x * gain, grad

        return scaled(x, self.gain)


class RaisingGradient(keras.layers.Layer):
    """The identity, with a backward pass that raises (a research layer not finished yet)."""

    def call(self, x):
        @tf.custom_gradient
        def unfinished(x):
            def grad(dy):
                raise NotImplementedError("the backward pass of this layer is not written yet")

            return tf.identity(x), grad

        return unfinished(x)


LAYERS = {"clip": ClipGradient, "keras_variable": KerasVariableGradient, "raising": RaisingGradient}


class CustomGradientTrainer(tiny_experiment.TinyTrainer):
    """tiny_experiment's MLP with the variant's custom-gradient layer after its hidden layer."""

    def build_model(self):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(self.config.model.width, activation="relu", name="hidden")(inputs)
        hidden = LAYERS[self.config.model.custom](name="custom")(hidden)
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))


def get_config(arg="clip"):
    if arg not in LAYERS:
        raise ValueError(f"unknown variant {arg!r}; expected one of {sorted(LAYERS)}")
    config = tiny_experiment.get_config()
    config.trainer = "custom_gradient_experiment.CustomGradientTrainer"
    config.model.custom = arg  # Which custom-gradient layer follows the hidden layer.
    config.train.num_steps = 10
    config.train.accumulation_steps = 1
    return config
