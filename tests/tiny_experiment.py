"""A tiny experiment shared by the Trainer and CLI tests: a config plus its Trainer subclass.

Run it as `python -m mixloop.train --config=tests/tiny_experiment.py` (tests/ on PYTHONPATH).
"""

import keras
import numpy as np
import tensorflow as tf

import mixloop
from mixloop.config import base_config


class TinyTrainer(mixloop.Trainer):
    """Three-class classification of 8 Gaussian features by a two-layer MLP with dropout."""

    def build_model(self):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(self.config.model.width, activation="relu")(inputs)
        hidden = keras.layers.Dropout(self.config.model.dropout)(hidden)
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))

    def build_datasets(self):
        rng = np.random.default_rng(0)
        features = rng.normal(size=(512, 8)).astype("float32")
        labels = (features[:, 0] > 0).astype("int32") + (features[:, 1] > 0)
        data = tf.data.Dataset.from_tensor_slices((features, labels))
        batch_size = self.config.train.batch_size
        train = data.shuffle(512, seed=self.config.seed).batch(batch_size, drop_remainder=True)
        return train, data.take(128).batch(64)

    def compute_loss(self, outputs, batch):
        losses = keras.losses.sparse_categorical_crossentropy(batch[1], outputs, from_logits=True)
        # A contract error on purpose: a per-example vector instead of a mean.
        return losses if self.config.model.per_example_loss else tf.reduce_mean(losses)

    def eval_metrics(self, outputs, batch):
        correct = tf.equal(tf.argmax(outputs, -1, output_type=tf.int32), batch[1])
        return {"loss": self.compute_loss(outputs, batch),
                "accuracy": tf.reduce_mean(tf.cast(correct, tf.float32))}


def get_config(arg=None):
    config = base_config()
    config.trainer = "tiny_experiment.TinyTrainer"
    config.model.width = 16  # Hidden units.
    config.model.dropout = 0.1  # Dropout rate after the hidden layer.
    config.model.per_example_loss = False  # True: compute_loss breaks its contract (error tests).
    config.precision.policy = "mixed_float16"
    config.train.num_steps = 40
    config.train.batch_size = 32
    config.train.accumulation_steps = 2
    config.train.steps_per_loop = 5
    config.train.repeat_dataset = True
    config.train.log_every_steps = 10
    config.eval.every_steps = 20
    config.checkpoint.every_steps = 20
    config.optimizer.learning_rate = 1e-2
    return config
