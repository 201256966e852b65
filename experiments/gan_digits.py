"""A small DCGAN on scikit-learn's bundled 8x8 digits: two objectives, two optimizers, two loss scales.

One forward pass per micro-batch draws noise, generates a batch of fakes and runs the discriminator
on the real and the fake images; `compute_loss` returns one loss per objective and the framework
differentiates each with respect to its own layer: the discriminator's logistic loss (real vs fake)
trains the discriminator only, the generator's non-saturating loss trains the generator only. In
`mixed_float16` each has its own dynamic loss scale and is skipped on its own overflows; the
generator's BatchNormalization statistics are rolled back with a skipped generator update.

Sample quality, after each eval, on `data.num_samples` images generated from fixed noise
(`DigitJudge`, fitted once on the train digits, no network involved):
  - `frechet_distance`: Fréchet distance between Gaussians fitted to the generated and the real
    train images, as 64 pixels in [0, 1] (FID's formula on pixels). Lower is better; it catches
    blur, noise and missing classes alike;
  - `confidence`: mean share of the 10 nearest real train digits that agree on the majority label;
  - `classes_covered`: digits that at least 2% of the samples are classified as (of 10).
Reference points (Fréchet / confidence / covered, measured on this split): the 256 held-out real
digits 0.13 / 0.97 / 10; the same with Gaussian noise of 0.2 added 0.65 / 0.95 / 10; 512 pairs of
real digits averaged 0.44 / 0.72 / 10; the real zeros only 4.7 / 1.00 / 1; 512 images of uniform
noise 10.0 / 0.61 / 9; 512 blank images 15.0 / 0.50 / 1. (The distance is biased upward for few
images: 512 of the train digits themselves give 0.04.) Confidence alone is weak, noise still
gets 0.61: read it beside the distance.
The eval Images tab shows an 8x8 grid of samples (`samples`) after each eval.

Run (from the repository root)::

    python -m mixloop.train --config=experiments/gan_digits.py --workdir=runs/gan_digits
    python -m mixloop.train --config=experiments/gan_digits.py:quick --workdir=runs/gan_digits_quick

Expect, on 2 CPU cores: about 80 seconds (6,000 updates at ~120 per second with XLA, which
`jit_compile=auto` picks after a 23 s probe, and start-up), ending at Fréchet distance 0.15,
confidence 0.88 and all 10 digits covered (0.154 / 0.884 / 10 measured, 0.24 / 0.86 / 10 at step
3,000; 0.149 / 0.871 on an AMD EPYC). The discriminator calls only 54% of the held-out real digits
real (`real_accuracy`) while it catches 71% of the fakes: it memorises the 1,541 train images. The
two loss scales part ways (both start at 2**15 and grow to 2**16 at step 2,000): the
discriminator's overflows by step 3,900 and once more after 5,500 (2 updates skipped, ending at
2**15); the generator's grows to 2**17 by step 4,000 and overflows by step 4,100 (1 skipped,
ending at 2**16).
The `quick` variant (200 updates of a narrower pair) only checks that everything runs: about
18 seconds, Fréchet distance 2.4, confidence 0.69, no update skipped.
"""

from __future__ import annotations

from typing import Optional

import keras
import ml_collections
import numpy as np
import tensorflow as tf

import mixloop
from mixloop.config import base_config

from experiments.digits import NUM_CLASSES, load_digits_arrays, split_indices

IMAGE_SHAPE = (8, 8, 1)
LEAKY_SLOPE = 0.2  # DCGAN's LeakyReLU slope.
MIN_CLASS_SHARE = 0.02  # A digit is covered when at least this share of the samples is classified as it.
NUM_NEIGHBORS = 10  # Real train digits that vote on a sample's label.
GRID_SIDE = 8  # The TensorBoard grid shows GRID_SIDE x GRID_SIDE samples,
GRID_ZOOM = 4  # each pixel as a GRID_ZOOM x GRID_ZOOM square.


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs."""
    config = base_config()
    config.trainer = "experiments.gan_digits.GANTrainer"  # The Trainer subclass below.
    config.seed = 0  # Initialization, noise and example order.
    config.precision.policy = "mixed_float16"  # Two dynamic loss scales, one per objective.

    config.model.latent_dim = 32  # Gaussian noise per generated image.
    config.model.generator_channels = (64, 32)  # Generator: channels of its 4x4 map, then of its 8x8 one.
    config.model.discriminator_channels = (32, 64)  # Discriminator: two stride-2 3x3 convolutions.
    config.model.batchnorm_momentum = 0.9  # The generator's BatchNorm; Keras's 0.99 lags in a short run.

    config.data.num_eval = 256  # Held-out real images for the eval losses: 4 batches of 64.
    config.data.split_seed = 0  # The permutation that chooses them; fixed apart from `seed`.
    config.data.num_samples = 512  # Images generated from fixed noise to judge at each eval.

    config.train.num_steps = 6000  # About 250 passes over the 1,541 train images.
    config.train.batch_size = 64  # Real images per update (and as many generated ones).
    config.train.steps_per_loop = 100  # Updates per compiled loop call.
    config.train.log_every_steps = 500  # Console progress line.
    config.train.repeat_dataset = True  # Many passes over the train images.
    # Eval and the samples use a moving average of the weights: Fréchet distance 0.15, not 0.18.
    config.train.ema_decay = 0.999

    # Both objectives get an optimizer from this section (DCGAN's Adam with beta_1 = 0.5).
    config.optimizer.name = "adam"  # Adam, no weight decay.
    config.optimizer.learning_rate = 5e-4  # Constant; the same for generator and discriminator.
    config.optimizer.beta_1 = 0.5  # Less momentum: the other player moves the target every step.

    config.eval.every_steps = 1500  # Evaluate four times over the run.
    config.checkpoint.every_steps = 3000  # Save twice.

    if arg == "quick":
        config.model.generator_channels = (16, 8)  # Narrow.
        config.model.discriminator_channels = (8, 16)  # Narrow.
        config.data.num_samples = 256  # Fewer samples to judge.
        config.train.num_steps = 200  # A couple of hundred updates.
        config.train.steps_per_loop = 50  # Four loop calls.
        config.train.ema_decay = 0.95  # An average over the last few dozen updates.
        config.train.log_every_steps = 50  # Four progress lines.
        config.eval.every_steps = 100  # Evaluate twice.
        config.checkpoint.every_steps = 100  # Save twice.
    elif arg:
        raise ValueError(f"unknown gan_digits config variant {arg!r}; expected 'quick' or none")
    return config


class DigitJudge:
    """Scores images of digits, [N, 8, 8, 1] floats in [0, 1], against real ones (see the docstring
    of this module): fitted once, deterministic, no training loop."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        from sklearn.neighbors import KNeighborsClassifier

        pixels = _flat(images)
        self.classifier = KNeighborsClassifier(NUM_NEIGHBORS).fit(pixels, labels)
        self.real_mean, self.real_cov = pixels.mean(axis=0), np.cov(pixels, rowvar=False)

    def __call__(self, images: np.ndarray) -> dict[str, float]:
        """`frechet_distance`, `confidence` and `classes_covered` of `images` (at least 2 of them)."""
        pixels = _flat(images)
        votes = self.classifier.predict_proba(pixels)
        share = np.bincount(votes.argmax(axis=1), minlength=NUM_CLASSES) / len(pixels)
        return {
            "frechet_distance": frechet_distance(pixels.mean(axis=0), np.cov(pixels, rowvar=False),
                                                 self.real_mean, self.real_cov),
            "confidence": float(votes.max(axis=1).mean()),
            "classes_covered": float(np.sum(share >= MIN_CLASS_SHARE)),
        }


def _flat(images: np.ndarray) -> np.ndarray:
    return np.asarray(images, np.float64).reshape(len(images), -1)


def frechet_distance(mean_a: np.ndarray, cov_a: np.ndarray, mean_b: np.ndarray,
                     cov_b: np.ndarray) -> float:
    """|mean_a - mean_b|^2 + tr(cov_a + cov_b - 2 (cov_a cov_b)^(1/2)), between two Gaussians.

    The trace of the square root is taken as the sum of the square roots of the eigenvalues of the
    symmetric cov_a^(1/2) cov_b cov_a^(1/2): the digits' always-blank corner pixels make both
    covariances singular, where a general matrix square root is unstable.
    """
    values, vectors = np.linalg.eigh(cov_a)
    root_a = (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T
    cross = np.sqrt(np.clip(np.linalg.eigvalsh(root_a @ cov_b @ root_a), 0.0, None)).sum()
    return float(np.sum((mean_a - mean_b) ** 2) + np.trace(cov_a) + np.trace(cov_b) - 2.0 * cross)


def sample_grid(images: np.ndarray) -> np.ndarray:
    """The first GRID_SIDE**2 of `images` ([N, 8, 8, 1] in [0, 1]) as one [1, H, W, 1] image, each
    digit framed by a one-pixel gray border and every pixel zoomed GRID_ZOOM times."""
    tiles = np.pad(images[: GRID_SIDE**2, :, :, 0], ((0, 0), (1, 0), (1, 0)), constant_values=0.5)
    side = tiles.shape[1]
    grid = tiles.reshape(GRID_SIDE, GRID_SIDE, side, side).transpose(0, 2, 1, 3)
    grid = grid.reshape(GRID_SIDE * side, GRID_SIDE * side)
    return np.kron(grid, np.ones((GRID_ZOOM, GRID_ZOOM)))[np.newaxis, :, :, np.newaxis]


@keras.saving.register_keras_serializable(package="gan_digits")
class GAN(keras.Model):
    """The generator and the discriminator; a call on real images returns the discriminator's logits
    for them and for as many freshly generated images.

    The noise comes from the model's own seed generator, whose state is one of the model's variables:
    checkpointed with it, and the same sequence on a resumed run.
    """

    def __init__(self, latent_dim: int, generator_channels: tuple, discriminator_channels: tuple,
                 batchnorm_momentum: float, seed: int, **kwargs):
        super().__init__(**kwargs)
        self.latent_dim = latent_dim
        self.generator = _generator(latent_dim, generator_channels, batchnorm_momentum)
        self.discriminator = _discriminator(discriminator_channels)
        self.seed_generator = keras.random.SeedGenerator(seed, name="noise_seed")
        self._config = dict(latent_dim=latent_dim, generator_channels=tuple(generator_channels),
                            discriminator_channels=tuple(discriminator_channels),
                            batchnorm_momentum=batchnorm_momentum, seed=seed)

    def call(self, images, training=False) -> dict:
        """{"real_logits": [B, 1], "fake_logits": [B, 1], "fake_images": [B, 8, 8, 1] in [-1, 1]}."""
        noise = keras.random.normal((keras.ops.shape(images)[0], self.latent_dim),
                                    dtype=self.compute_dtype, seed=self.seed_generator)
        fake = self.generator(noise, training=training)
        logits = self.discriminator(
            keras.ops.concatenate([keras.ops.cast(images, fake.dtype), fake]), training=training)
        real_logits, fake_logits = keras.ops.split(logits, 2)
        return {"real_logits": real_logits, "fake_logits": fake_logits, "fake_images": fake}

    def get_config(self) -> dict:
        return {**super().get_config(), **self._config}


def _generator(latent_dim: int, channels: tuple, momentum: float) -> keras.Sequential:
    """Noise -> 4x4 map -> nearest-neighbour upsampling to 8x8 -> one tanh channel in [-1, 1]."""
    wide, narrow = channels

    def normalized(name):  # BatchNorm has its own offset: the layer before it needs no bias.
        return [keras.layers.BatchNormalization(momentum=momentum, name=f"{name}_bn"),
                keras.layers.LeakyReLU(LEAKY_SLOPE, name=f"{name}_relu")]

    return keras.Sequential([
        keras.Input((latent_dim,)),
        keras.layers.Dense(4 * 4 * wide, use_bias=False, name="project"), *normalized("project"),
        keras.layers.Reshape((4, 4, wide)),
        keras.layers.UpSampling2D(2, name="upsample"),
        keras.layers.Conv2D(narrow, 3, padding="same", use_bias=False, name="conv"),
        *normalized("conv"),
        keras.layers.Conv2D(1, 3, padding="same", activation="tanh", name="pixels"),
    ], name="generator")


def _discriminator(channels: tuple) -> keras.Sequential:
    """8x8 image -> two stride-2 convolutions -> one logit, "real" when positive (no BatchNorm:
    it would mix the real and the fake halves of the batch)."""
    layers = [keras.Input(IMAGE_SHAPE)]
    for index, width in enumerate(channels):
        layers += [keras.layers.Conv2D(width, 3, strides=2, padding="same", name=f"conv{index}"),
                   keras.layers.LeakyReLU(LEAKY_SLOPE, name=f"relu{index}")]
    layers += [keras.layers.Flatten(), keras.layers.Dense(1, name="logits")]
    return keras.Sequential(layers, name="discriminator")


def gan_losses(real_logits: tf.Tensor, fake_logits: tf.Tensor) -> dict[str, tf.Tensor]:
    """Mean logistic losses (nats): the discriminator's on real (label 1) plus fake (label 0) images,
    the generator's non-saturating -log D(fake)."""
    return {"discriminator": (tf.reduce_mean(tf.nn.softplus(-real_logits))
                              + tf.reduce_mean(tf.nn.softplus(fake_logits))),
            "generator": tf.reduce_mean(tf.nn.softplus(-fake_logits))}


def _share(condition: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.cast(condition, tf.float32))


class GANTrainer(mixloop.Trainer):
    """Objectives `generator` and `discriminator`; eval reports the losses on held-out real images
    and the `DigitJudge` scores of generated ones."""

    def build_model(self) -> keras.Model:
        """The GAN, built by one call on a blank image."""
        m = self.config.model
        model = GAN(m.latent_dim, m.generator_channels, m.discriminator_channels,
                    m.batchnorm_momentum, seed=self.config.seed, name="gan")
        model(np.zeros((1, *IMAGE_SHAPE), np.float32))
        return model

    def build_objectives(self) -> dict[str, mixloop.Objective]:
        """The generator and the discriminator, each with its own optimizer from `config.optimizer`."""
        return {"generator": mixloop.Objective(self.model.generator, mixloop.build_optimizer(self.config)),
                "discriminator": mixloop.Objective(self.model.discriminator,
                                                   mixloop.build_optimizer(self.config))}

    def build_datasets(self) -> tuple[tf.data.Dataset, tf.data.Dataset]:
        """Shuffled train batches and in-order eval batches of real images in [-1, 1] (no labels),
        split by a fixed permutation. Fits the `DigitJudge` on the train images and labels."""
        images, labels = load_digits_arrays()
        eval_index, train_index = split_indices(len(labels), self.config.data)
        self.judge = DigitJudge(images[train_index], labels[train_index])
        # Fixed noise: samples at different evals differ only by the weights.
        self.sample_noise = np.random.default_rng(self.config.seed).standard_normal(
            (self.config.data.num_samples, self.config.model.latent_dim)).astype(np.float32)
        images = images * 2.0 - 1.0  # The generator's tanh range.
        batch_size = self.config.train.batch_size
        train = (tf.data.Dataset.from_tensor_slices(images[train_index])
                 .shuffle(len(train_index), seed=self.config.seed, reshuffle_each_iteration=True)
                 .batch(batch_size, drop_remainder=True))
        evaluation = (tf.data.Dataset.from_tensor_slices(images[eval_index])
                      .batch(batch_size, drop_remainder=True))
        return train, evaluation

    def compute_loss(self, outputs: dict, batch: tf.Tensor) -> dict[str, mixloop.Loss]:
        """`gan_losses`, with the share of generated images the discriminator takes for real
        (`fooled`) and its accuracy over the real and the fake halves (`d_accuracy`)."""
        real, fake = outputs["real_logits"], outputs["fake_logits"]
        losses = gan_losses(real, fake)
        return {"generator": mixloop.Loss(losses["generator"], metrics={"fooled": _share(fake > 0)}),
                "discriminator": mixloop.Loss(losses["discriminator"], metrics={
                    "d_accuracy": (_share(real > 0) + _share(fake <= 0)) / 2.0})}

    def eval_metrics(self, outputs: dict, batch: tf.Tensor) -> dict[str, tf.Tensor]:
        """Both losses on held-out real images and fresh fakes, and the discriminator's accuracy on
        each (an accuracy on held-out real images well below 1 while the fakes are caught is the
        discriminator memorising the train images)."""
        real, fake = outputs["real_logits"], outputs["fake_logits"]
        losses = gan_losses(real, fake)
        return {"discriminator_loss": losses["discriminator"], "generator_loss": losses["generator"],
                "real_accuracy": _share(real > 0), "fake_accuracy": _share(fake <= 0)}

    def evaluate(self) -> dict[str, float]:
        """The mean `eval_metrics`, and the `DigitJudge` scores of `data.num_samples` generated images
        (a score of the whole sample, such as the classes covered, is no mean over batches)."""
        metrics = super().evaluate()
        with self.ema_weights():
            metrics.update(self.judge(self.generate(self.sample_noise)))
        return metrics

    def generate(self, noise: np.ndarray) -> np.ndarray:
        """Images [N, 8, 8, 1] in [0, 1] from noise [N, latent_dim], in the run's precision (the
        generator's BatchNorm with its moving statistics)."""
        images = mixloop.forward(self.model.generator, self.policy, tf.constant(noise), training=False)
        return (np.asarray(images) + 1.0) / 2.0

    def actions(self) -> list[mixloop.Action]:
        """A grid of samples after each eval."""
        return [mixloop.Action(self.write_samples, at_eval=True)]

    def write_samples(self, step: int) -> None:
        """Writes `sample_grid` of the fixed-noise samples as the image summary `samples` (an
        eval-time action: with the weights eval used)."""
        images = self.generate(self.sample_noise[: GRID_SIDE**2])
        tf.summary.image("samples", sample_grid(np.clip(images, 0.0, 1.0)), step=step)
