"""An experiment whose data and size can be made to fail on purpose, for the fault tests.

`config.data` knobs: `nan_batches` (batch indices whose inputs are NaN), `overflow_batches` (batch
indices whose loss is multiplied by 1e9, so float16 gradients overflow at any scale),
`drop_batches` (batch indices left out), `label_offset`
(pushes labels out of range), `eval_label_offset` (the same for the eval labels alone),
`num_examples`, `num_eval` (0: an empty eval set); data sources:
`generator` (the train batches come from a Python generator, `tf.data.Dataset.from_generator`,
whose iterator TensorFlow cannot checkpoint), `raise_at_batch` (the generator raises ValueError
at that batch index, -1: never), `bad_shape_batch` (that batch index has 9 features, not 8; -1:
none) and `no_drop_remainder` (the train set batched without `drop_remainder=True`); the last
three imply `generator`. `config.model` knobs: `width`, `depth` (slows steps), `ballast` (floats in an extra variable: slows checkpoints).
"""

import keras
import numpy as np
import tensorflow as tf

import mixloop
from mixloop.config import base_config

OVERFLOW_FACTOR = 1e9  # Finite in float32, but its gradients overflow float16 even at scale 1.


class Ballast(keras.layers.Layer):
    """A pass-through layer holding a large non-trainable variable, to make checkpoints slow."""

    def __init__(self, size, **kwargs):
        super().__init__(**kwargs)
        self.size = size

    def build(self, input_shape):
        self.weight = self.add_weight(shape=(self.size,), initializer="ones", trainable=False)

    def call(self, inputs):
        return inputs

    def get_config(self):
        return {**super().get_config(), "size": self.size}


class FaultyTrainer(mixloop.Trainer):
    """A deep MLP on Gaussian features, three classes; batches carry an overflow flag."""

    def build_model(self):
        inputs = keras.Input((8,))
        hidden = inputs
        for index in range(self.config.model.depth):
            hidden = keras.layers.Dense(self.config.model.width, activation="tanh",
                                        name=f"hidden_{index}")(hidden)
        if self.config.model.ballast:
            hidden = Ballast(self.config.model.ballast)(hidden)
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))

    def build_datasets(self):
        data = self.config.data
        batch_size = self.config.train.batch_size
        rng = np.random.default_rng(0)
        features = rng.normal(size=(data.num_examples, 8)).astype("float32")
        labels = (features[:, 0] > 0).astype("int32") + (features[:, 1] > 0) + data.label_offset
        overflow = np.zeros(data.num_examples, bool)
        for index in data.nan_batches:
            features[index * batch_size:(index + 1) * batch_size] = np.nan
        for index in data.overflow_batches:
            overflow[index * batch_size:(index + 1) * batch_size] = True
        keep = np.ones(data.num_examples, bool)
        for index in data.drop_batches:
            keep[index * batch_size:(index + 1) * batch_size] = False
        train = tf.data.Dataset.from_tensor_slices((features[keep], labels[keep], overflow[keep]))
        if data.generator or data.raise_at_batch >= 0 or data.bad_shape_batch >= 0:
            train = _generated_batches(features[keep], labels[keep], overflow[keep], batch_size, data)
        elif data.no_drop_remainder:
            train = train.batch(batch_size)
        else:
            train = train.batch(batch_size, drop_remainder=True)
        evaluation = tf.data.Dataset.from_tensor_slices((features[:data.num_eval],
                                                         labels[:data.num_eval] + data.eval_label_offset))
        return train, evaluation.batch(32, drop_remainder=True)

    def compute_loss(self, outputs, batch):
        per_example = keras.losses.sparse_categorical_crossentropy(batch[1], outputs, from_logits=True)
        if len(batch) == 3:  # Train batches carry the overflow flag; eval batches do not.
            per_example *= tf.where(batch[2], OVERFLOW_FACTOR, 1.0)
        return tf.reduce_mean(per_example)


def _generated_batches(features, labels, overflow, batch_size, data):
    """The same batches from a Python generator, failing as the `config.data` knobs ask."""

    def batches():
        for index in range(len(features) // batch_size):
            if index == data.raise_at_batch:
                raise ValueError(f"record {index * batch_size} of the generator is corrupt")
            rows = slice(index * batch_size, (index + 1) * batch_size)
            x = features[rows]
            if index == data.bad_shape_batch:
                x = np.concatenate([x, x[:, :1]], axis=1)
            yield x, labels[rows], overflow[rows]

    num_features = None if data.bad_shape_batch >= 0 else 8
    return tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec((batch_size, num_features), tf.float32),
        tf.TensorSpec((batch_size,), tf.int32), tf.TensorSpec((batch_size,), tf.bool)))


def get_config(arg=None):
    config = base_config()
    config.trainer = "faulty_experiment.FaultyTrainer"
    config.seed = 3
    config.deterministic = True
    config.model.width = 16  # Hidden units per layer.
    config.model.depth = 1  # Hidden layers.
    config.model.ballast = 0  # Floats in a pass-through variable (slow checkpoint writes).
    config.data.num_examples = 1024  # Train examples; 1024 / 32 = 32 batches per epoch.
    config.data.num_eval = 128  # Eval examples (the first ones of the train set); 0: empty.
    config.data.nan_batches = ()  # Batch indices whose inputs are NaN.
    config.data.overflow_batches = ()  # Batch indices whose loss is scaled by OVERFLOW_FACTOR.
    config.data.drop_batches = ()  # Batch indices left out of the train data.
    config.data.label_offset = 0  # Added to every label; 3 or more is out of range.
    config.data.eval_label_offset = 0  # Added to the eval labels too.
    config.data.generator = False  # True: train batches from a Python generator (uncheckpointable).
    config.data.raise_at_batch = -1  # The generator raises ValueError at this batch index.
    config.data.bad_shape_batch = -1  # This batch index has 9 features instead of 8.
    config.data.no_drop_remainder = False  # True: the train set batched without drop_remainder.
    config.precision.policy = "mixed_float16"
    config.train.num_steps = 24
    config.train.batch_size = 32
    config.train.steps_per_loop = 4
    config.train.log_every_steps = 4
    config.train.repeat_dataset = True
    config.eval.every_steps = 0
    config.checkpoint.every_steps = 4
    config.optimizer.learning_rate = 1e-2
    return config
