"""Two planted precision problems for the precision doctor's tests: a hot layer and faint gradients.

    python -m mixloop.diagnose --config=tests/hot_experiment.py        # tests/ on PYTHONPATH
    python -m mixloop.diagnose --config=tests/hot_experiment.py:faint

Expect for the default ("hot"): layer `hot` outputs values near 1e5, beyond float16's 65504, so the
mixed_float16 loss is NaN from the first step; the advice keeps `hot` and its consumer `squash` in
float32, and calls mixed_bfloat16 safe. For "faint": gradients near 1e-9 all flush to zero in float16 without a loss
scale; the advice is a dynamic loss scale starting at 2^41 (and a max_scale to allow it).
"""

import keras
import numpy as np
import tensorflow as tf

import mixloop
from mixloop.config import base_config

HOT_STDDEV = 3.5e4  # Kernel stddev of `hot`: its outputs on 8 unit-normal features have stddev ~1e5.
FAINT_FACTOR = 1e-8  # Multiplies the faint model's loss, so its gradients are near 1e-9.


class HotTrainer(mixloop.Trainer):
    """Three-class classification of 8 Gaussian features, through a layer whose outputs are near 1e5."""

    def build_model(self):
        inputs = keras.Input((8,))
        x = keras.layers.Dense(16, kernel_initializer=keras.initializers.RandomNormal(stddev=HOT_STDDEV),
                               name="hot")(inputs)
        x = keras.layers.Rescaling(1 / HOT_STDDEV, name="squash")(x)  # Back to order 1.
        x = keras.layers.Dense(16, activation="relu", name="body")(x)
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))

    def build_datasets(self):
        rng = np.random.default_rng(0)
        features = rng.normal(size=(512, 8)).astype("float32")
        labels = (features[:, 0] > 0).astype("int32") + (features[:, 1] > 0)
        data = tf.data.Dataset.from_tensor_slices((features, labels))
        train = data.shuffle(512, seed=self.config.seed)
        return train.batch(self.config.train.batch_size, drop_remainder=True), None

    def compute_loss(self, outputs, batch):
        return tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(batch[1], outputs, from_logits=True)
        )


class FaintTrainer(HotTrainer):
    """The same task through an ordinary MLP, with a loss so small that its gradients are near 1e-9."""

    def build_model(self):
        inputs = keras.Input((8,))
        x = keras.layers.Dense(16, activation="relu", name="body")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))

    def compute_loss(self, outputs, batch):
        return FAINT_FACTOR * super().compute_loss(outputs, batch)


def get_config(arg=None):
    config = base_config()
    config.trainer = "hot_experiment.HotTrainer"
    config.precision.policy = "mixed_float16"
    config.train.num_steps = 30  # Enough updates to see every step skipped, or none.
    config.train.batch_size = 16  # 32 batches in the 512 examples: enough for 30 steps.
    config.train.steps_per_loop = 10  # Three loop calls.
    config.train.log_every_steps = 10  # A progress line per loop call.
    config.eval.every_steps = 0  # No eval set.
    config.checkpoint.every_steps = 0  # Save only at the end.
    if arg == "faint":
        config.trainer = "hot_experiment.FaintTrainer"
        config.precision.loss_scale = "none"  # Gradients as they are, unscaled.
    elif arg:
        raise ValueError(f"unknown hot_experiment variant {arg!r}; expected 'faint' or none")
    return config
