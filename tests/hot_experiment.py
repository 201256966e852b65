"""Planted precision problems for the doctor's and the automatic placement's tests: a hot layer,
faint gradients, a long-axis reduction (alone and inside blocks) and a layer that overflows only
after some training. The probe is on by default in mixed_float16: `--config.precision.float32_layers=
--config.precision.initial_scale=32768` shows a plain run.

    python -m mixloop.diagnose --config=tests/hot_experiment.py        # tests/ on PYTHONPATH
    python -m mixloop.diagnose --config=tests/hot_experiment.py:faint
    python -m mixloop.train --config=tests/hot_experiment.py:reduction --workdir=/tmp/r
    python -m mixloop.train --config=tests/hot_experiment.py:growing --workdir=/tmp/g \
        --config.precision.heal=True --config.train.max_recoveries=1

Expect for the default ("hot"): layer `hot` outputs values near 1e5, beyond float16's 65504, so the
mixed_float16 loss is NaN from the first step; the advice keeps `hot` and its consumer `squash` in
float32, and calls mixed_bfloat16 safe. For "faint": gradients near 3e-15 all flush to zero in float16 without a loss
scale, and at the default start 2^15 too; the advice is a dynamic loss scale starting at 2^61 (and a
max_scale to allow it).
For "nested": the reduction inside a block (`pooling/pool`) and inside a block's own `call`
(`summing`): the automatic placement moves those two, not `pooling`. For "reduction": `pool`
averages 2,048 positions of values near 40 by summing them first; the sum, near 82,000, overflows float16 although every input and output of the layer is near 40, so the
mixed_float16 loss is NaN from the first step. For "growing": `grow` multiplies its outputs by a
gain that grows 30% with every applied update and `shrink` divides it out again; its values leave
float16's range after 35 to 40 updates, so mixed_float16 trains and then diverges.
"""

import keras
import numpy as np
import tensorflow as tf

import mixloop
from mixloop.config import base_config

HOT_STDDEV = 3.5e4  # Kernel stddev of `hot`: its outputs on 8 unit-normal features have stddev ~1e5.
FAINT_FACTOR = 1e-14  # Multiplies the faint model's loss, so its gradients are near 3e-15.
SEQUENCE_LENGTH, READING_LEVEL = 2048, 40.0  # The reduction's axis and its values: sums near 82,000.
GROWTH = 1.3  # The growing layer's gain per update: 1.3**38 is about 21,000, times outputs near 3.


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


@keras.saving.register_keras_serializable(package="hot_experiment")
class SumThenDivide(keras.layers.Layer):
    """The mean over axis 1, computed as its sum divided by the count: the sum holds the whole axis."""

    def call(self, inputs):
        return keras.ops.sum(inputs, axis=1) / keras.ops.cast(keras.ops.shape(inputs)[1], inputs.dtype)


class ReductionTrainer(HotTrainer):
    """Classifies sequences of 2,048 readings near 40 by their mean, pooled by a long-axis sum."""

    def build_model(self):
        inputs = keras.Input((SEQUENCE_LENGTH, 2))
        x = SumThenDivide(name="pool")(inputs)
        x = keras.layers.Dense(16, activation="relu", name="body")(x - READING_LEVEL)
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))

    def build_datasets(self):
        rng = np.random.default_rng(0)
        means = rng.normal(size=(256, 1, 2)).astype("float32")
        readings = READING_LEVEL + means + rng.normal(size=(256, SEQUENCE_LENGTH, 2)).astype("float32")
        labels = (means[:, 0, 0] > 0).astype("int32") + (means[:, 0, 1] > 0)
        data = tf.data.Dataset.from_tensor_slices((readings, labels))
        train = data.shuffle(256, seed=self.config.seed).repeat()
        return train.batch(self.config.train.batch_size, drop_remainder=True), data.batch(64)


@keras.saving.register_keras_serializable(package="hot_experiment")
class Gain(keras.layers.Layer):
    """Multiplies its inputs by gain ** exponent, where the gain grows by GROWTH with every training
    call: two of them with exponents 1 and -1 grow in step, and the second undoes the first."""

    def __init__(self, exponent=1, **kwargs):
        super().__init__(**kwargs)
        self.exponent = exponent

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(), initializer="ones", trainable=False, autocast=False,
                                    name="gain")

    def call(self, inputs, training=False):
        outputs = inputs * keras.ops.cast(self.gain**self.exponent, inputs.dtype)
        if training:
            self.gain.assign(self.gain * GROWTH)
        return outputs

    def get_config(self):
        return {**super().get_config(), "exponent": self.exponent}


class GrowingTrainer(HotTrainer):
    """The hot task through a layer whose scale grows with training until float16 overflows."""

    def build_model(self):
        inputs = keras.Input((8,))
        x = keras.layers.Dense(16, name="hidden")(inputs)
        x = Gain(name="grow")(x)
        x = Gain(exponent=-1, name="shrink")(x)
        x = keras.layers.Dense(16, activation="relu", name="body")(x)
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))

    def build_datasets(self):
        train, _ = super().build_datasets()
        rng = np.random.default_rng(1)
        features = rng.normal(size=(512, 8)).astype("float32")
        labels = (features[:, 0] > 0).astype("int32") + (features[:, 1] > 0)
        return train.repeat(), tf.data.Dataset.from_tensor_slices((features, labels)).batch(128)


@keras.saving.register_keras_serializable(package="hot_experiment")
class PoolingBlock(keras.layers.Layer):
    """A block whose sublayer `pool` overflows float16 (a long-axis sum), followed by a calm `body`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pool = SumThenDivide(name="pool")
        self.body = keras.layers.Dense(8, activation="relu", name="body")

    def call(self, inputs):
        return self.body(self.pool(inputs) - READING_LEVEL)


@keras.saving.register_keras_serializable(package="hot_experiment")
class SummingBlock(keras.layers.Layer):
    """A block whose own op overflows float16 (a long-axis sum, in its `call`) after a calm sublayer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mix = keras.layers.Dense(2, kernel_initializer="identity", name="mix")

    def call(self, inputs):
        mixed = self.mix(inputs)
        return keras.ops.sum(mixed, axis=1) / keras.ops.cast(keras.ops.shape(mixed)[1], mixed.dtype)


class NestedTrainer(ReductionTrainer):
    """The reduction's task through two blocks, one with an overflowing sublayer, one overflowing in
    its own ops: the finest layers to move are `pooling/pool` and `summing`."""

    def build_model(self):
        inputs = keras.Input((SEQUENCE_LENGTH, 2))
        pooled = PoolingBlock(name="pooling")(inputs)
        summed = SummingBlock(name="summing")(inputs) - READING_LEVEL
        x = keras.layers.Concatenate(name="join")([pooled, summed])
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))


class FaintTrainer(HotTrainer):
    """The same task through an ordinary MLP, with a loss so small that its gradients are near 3e-15."""

    def build_model(self):
        inputs = keras.Input((8,))
        x = keras.layers.Dense(16, activation="relu", name="body")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))

    def compute_loss(self, outputs, batch):
        return self.config.model.loss_factor * super().compute_loss(outputs, batch)


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
        config.model.loss_factor = FAINT_FACTOR  # What the loss is multiplied by.
    elif arg == "reduction":
        config.trainer = "hot_experiment.ReductionTrainer"
    elif arg == "nested":
        config.trainer = "hot_experiment.NestedTrainer"
    elif arg == "growing":
        config.trainer = "hot_experiment.GrowingTrainer"
        config.train.num_steps = 80
        config.checkpoint.every_steps = 10  # A recent checkpoint for the heal to restore.
        config.eval.every_steps = 20  # Before and after the heal: the eval step is traced anew too.
    elif arg:
        raise ValueError(f"unknown hot_experiment variant {arg!r}; expected 'faint', 'reduction', "
                         "'nested', 'growing' or none")
    return config
