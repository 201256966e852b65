"""SimCLR on scikit-learn's bundled 8x8 digits: a contrastive loss over the whole batch under accumulation.

Each image is augmented twice (a random shift of up to one pixel, a random contrast, Gaussian
noise: the `Augment` layer, drawn from its own seed generator, at eval too), a small CNN encodes
each view and a projection head maps it to 32 numbers; NT-Xent (normalized temperature-scaled
cross-entropy) asks each of the 2 x 128 projections of a batch to pick its other view among the
255 others. The loss couples the batch's examples, so `train.accumulation_steps=4` alone would
contrast each micro-batch's 32 pairs among themselves (63 candidates, chance log 63 = 4.14, not log
255 = 5.54): another loss. `train.batch_loss=True` computes it on the whole batch with
accumulation's memory (GradCache's two passes, docs/recipes.md "A loss over the whole batch").

Eval, after each `eval.every_steps`: `loss` and `pair_accuracy` (the share of projections whose
nearest other projection is their other view), NT-Xent on augmented held-out images in batches of
128 as in training; `knn_accuracy`, the 1-nearest-neighbour (cosine) accuracy of the held-out
digits' encoder representations against the labelled train digits', and `few_label_accuracy`, the
same against 5 labelled train digits per class. Reference points on this split: raw pixels 0.995
and 0.891; the encoder at its random initialization 0.977 and 0.807 (float32; its eval NT-Xent
5.50, pair accuracy 0.108).

Run (from the repository root)::

    python -m mixloop.train --config=experiments/simclr_digits.py --workdir=runs/simclr_digits
    python -m mixloop.train --config=experiments/simclr_digits.py:quick --workdir=runs/simclr_quick

Expect, on 2 CPU cores: about a minute (63 s measured: 1,500 updates with XLA, which
`jit_compile=auto` picks after a 29 s probe), ending at eval NT-Xent 2.05, pair accuracy 0.86,
1-NN accuracy 0.982 and 0.898 from 5 labels per class (2.0463 / 0.859 / 0.9818 / 0.8984
measured; float32, where auto picks graph mode, 2.0479 / 0.858 / 0.9870 / 0.9115), train NT-Xent
2.02, no update skipped. With
`--config.train.batch_loss=False` the train loss reads 0.96 (each micro-batch's 63 candidates)
and the eval NT-Xent is worse, 2.0992 (docs/results.md).
The `quick` variant (40 updates of a narrower model) only checks that everything runs.
"""

from __future__ import annotations

from typing import Optional

import keras
import ml_collections
import numpy as np
import tensorflow as tf

import mixloop
from mixloop.config import base_config

from experiments.digits import load_digits_arrays, split_indices

IMAGE_SHAPE = (8, 8, 1)
NUM_CLASSES = 10
FEW_LABELS_PER_CLASS = 5  # Labelled train digits per class for `few_label_accuracy`.


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs."""
    config = two_view_config("simclr_digits", arg)
    config.trainer = "experiments.simclr_digits.SimCLRTrainer"  # The Trainer subclass below.
    config.precision.policy = "mixed_float16"  # A dynamic loss scale through both passes.

    config.model.projection_dim = 32  # The head's output, where NT-Xent compares views.
    config.model.temperature = 0.2  # NT-Xent's temperature.

    config.train.accumulation_steps = 4  # Four micro-batches of 32 images...
    config.train.batch_loss = True  # ...and NT-Xent over all 256 projections (two passes).
    return config


def two_view_config(experiment: str, arg: Optional[str]) -> ml_collections.ConfigDict:
    """What the digits' two-view experiments (this one, byol_digits) share: the encoder, the
    augmentation, the split and 1,500 AdamW updates of 128 images, or with `arg="quick"` 40 updates
    of a narrower encoder.

    Raises:
      ValueError: for an `arg` other than "quick" or none, naming `experiment`.
    """
    config = base_config()
    config.seed = 0  # Initialization, augmentation and example order.

    config.model.channels = (32, 64)  # Encoder: 3x3 convolutions, the second with stride 2.
    config.model.representation_dim = 128  # The encoder's output, read by the 1-NN eval.
    config.model.max_shift = 1  # Augmentation: random shift in pixels, each axis.
    config.model.contrast = 0.3  # Augmentation: intensity multiplied by 1 +- this, uniformly.
    config.model.noise = 0.1  # Augmentation: Gaussian pixel noise (pixels in [0, 1]).

    config.data.num_eval = 384  # Held-out images: 3 eval batches of 128.
    config.data.split_seed = 0  # The permutation that chooses them; fixed apart from `seed`.

    config.train.num_steps = 1500  # About 140 passes over the 1,413 train images.
    config.train.batch_size = 128  # Images per update, each seen in two views.
    config.train.steps_per_loop = 50  # Updates per compiled loop call.
    config.train.log_every_steps = 250  # Console progress line.
    config.train.repeat_dataset = True  # Many passes over the train images.

    config.optimizer.name = "adamw"  # Adam with decoupled weight decay.
    config.optimizer.learning_rate = 2e-3  # Peak learning rate.
    config.optimizer.schedule = "cosine"  # Cosine decay to 0 after warm-up.
    config.optimizer.warmup_steps = 100  # Linear warm-up from 0.
    config.optimizer.weight_decay = 1e-4  # Decoupled weight decay.

    config.eval.every_steps = 500  # Evaluate three times over the run.
    config.checkpoint.every_steps = 500  # Save three times.

    if arg == "quick":
        config.model.channels = (8, 16)  # Narrow.
        config.model.representation_dim = 32  # Narrow.
        config.train.num_steps = 40  # A few dozen updates.
        config.train.steps_per_loop = 10  # Four loop calls.
        config.train.log_every_steps = 20  # Two progress lines.
        config.optimizer.warmup_steps = 5  # Short warm-up.
        config.eval.every_steps = 20  # Evaluate twice.
        config.checkpoint.every_steps = 20  # Save twice.
    elif arg:
        raise ValueError(f"unknown {experiment} config variant {arg!r}; expected 'quick' or none")
    return config


@keras.saving.register_keras_serializable(package="simclr_digits")
class Augment(keras.layers.Layer):
    """A random view of each image [B, 8, 8, 1]: shifted by up to `max_shift` pixels along each axis
    (zeros come in), its intensity scaled by 1 +- `contrast`, Gaussian noise of `noise` added.

    It augments in every call, eval's too (the eval loss compares augmented views), drawing from
    its own `SeedGenerator`: a checkpointed state, which eval leaves as it found it.
    """

    def __init__(self, max_shift: int, contrast: float, noise: float, seed: int, **kwargs):
        super().__init__(**kwargs)
        self.max_shift, self.contrast, self.noise, self.seed = max_shift, contrast, noise, seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, images):
        batch, side = keras.ops.shape(images)[0], 2 * self.max_shift + 1
        padded = keras.ops.pad(images, [[0, 0], [self.max_shift] * 2, [self.max_shift] * 2, [0, 0]])
        shifted = keras.ops.stack([padded[:, dy:dy + 8, dx:dx + 8] for dy in range(side)
                                   for dx in range(side)], axis=1)  # [B, side**2, 8, 8, 1]
        choice = keras.random.randint((batch,), 0, side**2, seed=self.seed_generator)
        one_hot = keras.ops.one_hot(choice, side**2, dtype=self.compute_dtype)
        images = keras.ops.einsum("bk,bkhwc->bhwc", one_hot, shifted)
        gain = keras.random.uniform((batch, 1, 1, 1), 1.0 - self.contrast, 1.0 + self.contrast,
                                    dtype=self.compute_dtype, seed=self.seed_generator)
        noise = keras.random.normal(keras.ops.shape(images), stddev=self.noise,
                                    dtype=self.compute_dtype, seed=self.seed_generator)
        return images * gain + noise

    def get_config(self) -> dict:
        return {**super().get_config(), "max_shift": self.max_shift, "contrast": self.contrast,
                "noise": self.noise, "seed": self.seed}


def nt_xent(z1: tf.Tensor, z2: tf.Tensor, temperature: float) -> tuple[tf.Tensor, tf.Tensor]:
    """(NT-Xent in nats, the share of projections whose most similar other one is their other
    view) for two views' projections [N, D] in float32: each of the 2N projections, normalized,
    classifies its other view among the 2N - 1 others by cosine similarity / temperature."""
    z = tf.math.l2_normalize(tf.concat([z1, z2], 0), axis=1)
    n = tf.shape(z1)[0]
    logits = tf.matmul(z, z, transpose_b=True) / temperature - 1e9 * tf.eye(2 * n)  # Not itself.
    labels = tf.concat([tf.range(n, 2 * n), tf.range(0, n)], 0)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    correct = tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), labels)
    return loss, tf.reduce_mean(tf.cast(correct, tf.float32))


def nearest_neighbor_accuracy(reference: np.ndarray, reference_labels: np.ndarray,
                              queries: np.ndarray, query_labels: np.ndarray) -> float:
    """The share of `queries` whose most cosine-similar `reference` row has their label."""
    unit = lambda x: x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    nearest = np.argmax(unit(queries) @ unit(reference).T, axis=1)
    return float(np.mean(reference_labels[nearest] == query_labels))


def build_encoder(m: ml_collections.ConfigDict) -> keras.Sequential:
    """The `encoder`: images [B, 8, 8, 1] -> their representations [B, representation_dim] (what
    the 1-NN eval reads), through two 3x3 convolutions, the second with stride 2. Built where it is
    first called, so that its variables' paths start with the model that calls it."""
    return keras.Sequential([
        keras.layers.Conv2D(m.channels[0], 3, padding="same", activation="relu", name="conv0"),
        keras.layers.Conv2D(m.channels[1], 3, strides=2, padding="same", activation="relu",
                            name="conv1"),
        keras.layers.Flatten(),
        keras.layers.Dense(m.representation_dim, activation="relu", name="representation"),
    ], name="encoder")


class SimCLRTrainer(mixloop.Trainer):
    """Contrastive learning of digit representations; eval reports NT-Xent on held-out images and
    the 1-NN accuracies of the encoder's representations."""

    def build_model(self) -> keras.Model:
        """Images -> two `Augment`ed views -> `encoder` -> `projection`: {"z1", "z2"} [B, 32]."""
        m = self.config.model
        images = keras.Input(IMAGE_SHAPE, name="images")
        augment = Augment(m.max_shift, m.contrast, m.noise, seed=self.config.seed, name="augment")
        encoder = build_encoder(m)
        projection = keras.Sequential([
            keras.Input((m.representation_dim,)),
            keras.layers.Dense(m.representation_dim, activation="relu", name="hidden"),
            keras.layers.Dense(m.projection_dim, name="output"),
        ], name="projection")
        return keras.Model(images, {"z1": projection(encoder(augment(images))),
                                    "z2": projection(encoder(augment(images)))}, name="simclr")

    def build_datasets(self) -> tuple[tf.data.Dataset, tf.data.Dataset]:
        """Shuffled train batches and in-order eval batches of (images, labels), split by a fixed
        permutation (the labels only for the 1-NN eval). Keeps the arrays the eval reads."""
        images, labels = load_digits_arrays()
        eval_index, train_index = split_indices(len(labels), self.config.data)
        rng = np.random.default_rng(self.config.data.split_seed)
        few = np.concatenate([rng.choice(train_index[labels[train_index] == digit],
                                         FEW_LABELS_PER_CLASS, replace=False)
                              for digit in range(NUM_CLASSES)])
        self.probe = {"train": (images[train_index], labels[train_index]),
                      "few": (images[few], labels[few]), "eval": (images[eval_index], labels[eval_index])}
        batch_size = self.config.train.batch_size
        train = (tf.data.Dataset.from_tensor_slices((images[train_index], labels[train_index]))
                 .shuffle(len(train_index), seed=self.config.seed, reshuffle_each_iteration=True)
                 .batch(batch_size, drop_remainder=True))
        evaluation = (tf.data.Dataset.from_tensor_slices((images[eval_index], labels[eval_index]))
                      .batch(batch_size, drop_remainder=True))
        return train, evaluation

    def compute_loss(self, outputs: dict, batch: tuple) -> mixloop.Loss:
        """NT-Xent over the batch's views (with `batch_loss`, the whole global batch), and
        `pair_accuracy`."""
        loss, pair_accuracy = nt_xent(outputs["z1"], outputs["z2"], self.config.model.temperature)
        return mixloop.Loss(loss, metrics={"pair_accuracy": pair_accuracy})

    def evaluate(self) -> dict[str, float]:
        """The mean NT-Xent and pair accuracy over the eval batches, and the 1-NN accuracies of
        the encoder's representations (with the EMA weights when on)."""
        metrics = super().evaluate()
        with self.ema_weights():
            represented = {name: self.represent(images) for name, (images, _) in self.probe.items()}
        labels = {name: labels for name, (_, labels) in self.probe.items()}
        for metric, reference in (("knn_accuracy", "train"), ("few_label_accuracy", "few")):
            metrics[metric] = nearest_neighbor_accuracy(represented[reference], labels[reference],
                                                        represented["eval"], labels["eval"])
        return metrics

    def represent(self, images: np.ndarray) -> np.ndarray:
        """The encoder's representations [N, representation_dim] of un-augmented `images`, in the
        run's precision."""
        encoder = self.model.get_layer("encoder")
        return np.concatenate([
            np.asarray(mixloop.forward(encoder, self.policy, tf.constant(chunk), training=False))
            for chunk in np.array_split(images, max(len(images) // 512, 1))])
