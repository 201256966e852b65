"""A small CNN with BatchNormalization on scikit-learn's bundled 8x8 handwritten digits.

The 1,797 images ship inside scikit-learn (nothing is downloaded; install it with
`pip install -e '.[digits]'`). A fixed permutation sets aside `data.num_eval` images for eval.
BatchNormalization computes in float32 under the mixed policy, and its moving statistics are
rolled back whenever the dynamic loss scale skips an update.

Run (from the repository root)::

    python -m mixloop.train --config=experiments/digits.py --workdir=runs/digits
    python -m mixloop.train --config=experiments/digits.py:quick --workdir=runs/digits_quick

Expect, on 2 CPU cores: about 16 seconds for 600 updates (with a 9 s probe of the compile modes,
which picks XLA: TensorFlow's float16 convolutions on a CPU are 15x slower), eval accuracy 0.99
(0.9922 measured) and loss 0.05. The loss scale stays at 2**15 with XLA; without XLA
(`--config.jit_compile=False`) one update is skipped at the start while it backs off to 2**14.
The `quick` variant (30 updates of a narrower model) only checks that everything runs: about 0.26.
"""

from __future__ import annotations

from typing import Optional

import keras
import ml_collections
import numpy as np
import tensorflow as tf

import mixloop
from mixloop.config import base_config
from mixloop.errors import UserError

NUM_CLASSES = 10
MAX_PIXEL = 16.0  # The digits' pixels are integers in [0, 16].


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs."""
    config = base_config()
    config.trainer = "experiments.digits.DigitsTrainer"  # The Trainer subclass below.
    config.seed = 0  # Initialization and example order.
    config.precision.policy = "mixed_float16"  # Exercises the dynamic loss scale with BatchNorm.

    config.model.channels = (32, 64)  # Filters of the two 3x3 conv blocks; a 2x2 max-pool between.
    config.model.batchnorm_momentum = 0.9  # Keras's 0.99 lags behind in a run this short.

    config.data.num_eval = 384  # Held-out images: 12 eval batches of 32, none dropped.
    config.data.split_seed = 0  # The permutation that chooses them; fixed apart from `seed`.

    config.train.num_steps = 600  # About 14 passes over the 1,413 train images.
    config.train.batch_size = 32  # Images per update.
    config.train.accumulation_steps = 2  # Two micro-batches of 16 per update.
    config.train.steps_per_loop = 50  # Updates per compiled loop call.
    config.train.log_every_steps = 100  # Console progress line.
    config.train.repeat_dataset = True  # Several passes over the train images.

    config.optimizer.name = "adamw"  # Adam with decoupled weight decay.
    config.optimizer.learning_rate = 3e-3  # Peak learning rate.
    config.optimizer.schedule = "cosine"  # Cosine decay to 0 after warm-up.
    config.optimizer.warmup_steps = 50  # Linear warm-up from 0.
    config.optimizer.weight_decay = 1e-4  # Decoupled weight decay.

    config.eval.every_steps = 200  # Evaluate three times over the run.
    config.checkpoint.every_steps = 600  # Save at the end only.

    if arg == "quick":
        config.model.channels = (8, 16)  # Narrow.
        config.train.num_steps = 30  # A few dozen updates.
        config.train.steps_per_loop = 10  # Three loop calls.
        config.train.log_every_steps = 10  # Three progress lines.
        config.optimizer.warmup_steps = 5  # Short warm-up.
        config.eval.every_steps = 15  # Evaluate twice.
        config.checkpoint.every_steps = 15  # Save twice.
    elif arg:
        raise ValueError(f"unknown digits config variant {arg!r}; expected 'quick' or none")
    return config


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """float32 images [1797, 8, 8, 1] scaled to [0, 1], and int32 labels [1797].

    Raises:
      UserError: when scikit-learn is not installed, saying how to install it.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UserError(
            "the digits experiment needs scikit-learn: pip install -e '.[digits]'"
        ) from None
    digits = load_digits()
    images = (digits.images / MAX_PIXEL).astype(np.float32)[..., np.newaxis]
    return images, digits.target.astype(np.int32)


def split_indices(num_images: int, data: ml_collections.ConfigDict) -> tuple[np.ndarray, np.ndarray]:
    """(eval indices, train indices): `data.num_eval` images set aside by a fixed permutation
    (`data.split_seed`), the same for every digits experiment."""
    order = np.random.default_rng(data.split_seed).permutation(num_images)
    eval_index, train_index = np.split(order, [data.num_eval])
    return eval_index, train_index


class DigitsTrainer(mixloop.Trainer):
    """Ten-way classification of 8x8 digits; reports eval loss and accuracy."""

    def build_model(self) -> keras.Model:
        """Conv-BN-ReLU blocks with a max-pool between them, global average pooling, logits."""
        m = self.config.model
        images = keras.Input(shape=(8, 8, 1), name="images")
        x = images
        for index, channels in enumerate(m.channels):
            if index:
                x = keras.layers.MaxPooling2D(name=f"pool{index}")(x)
            # No bias: the BatchNormalization that follows has its own offset.
            x = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False,
                                    name=f"conv{index}")(x)
            x = keras.layers.BatchNormalization(momentum=m.batchnorm_momentum, name=f"bn{index}")(x)
            x = keras.layers.ReLU(name=f"relu{index}")(x)
        x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
        logits = keras.layers.Dense(NUM_CLASSES, name="logits")(x)
        return keras.Model(images, logits, name="digits_cnn")

    def build_datasets(self) -> tuple[tf.data.Dataset, tf.data.Dataset]:
        """Shuffled train batches and in-order eval batches, split by a fixed permutation."""
        images, labels = load_digits_arrays()
        eval_index, train_index = split_indices(len(labels), self.config.data)
        batch_size = self.config.train.batch_size
        train = (tf.data.Dataset.from_tensor_slices((images[train_index], labels[train_index]))
                 .shuffle(len(train_index), seed=self.config.seed, reshuffle_each_iteration=True)
                 .batch(batch_size, drop_remainder=True))
        evaluation = (tf.data.Dataset.from_tensor_slices((images[eval_index], labels[eval_index]))
                      .batch(batch_size, drop_remainder=True))
        return train, evaluation

    def compute_loss(self, outputs: tf.Tensor, batch: tuple) -> tf.Tensor:
        """Mean cross-entropy in nats."""
        _, labels = batch
        losses = keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)
        return tf.reduce_mean(losses)

    def eval_metrics(self, outputs: tf.Tensor, batch: tuple) -> dict[str, tf.Tensor]:
        """Cross-entropy and the fraction of images whose top logit is the label."""
        _, labels = batch
        correct = tf.equal(tf.argmax(outputs, axis=-1, output_type=tf.int32), labels)
        return {"loss": self.compute_loss(outputs, batch),
                "accuracy": tf.reduce_mean(tf.cast(correct, tf.float32))}
