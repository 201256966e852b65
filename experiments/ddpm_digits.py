"""A small DDPM (denoising diffusion) on scikit-learn's bundled 8x8 digits, sampled with EMA weights.

Training (Ho et al. 2020): each train image x0 in [-1, 1] gets a diffusion step t drawn uniformly
from the `model.num_diffusion_steps` of a cosine schedule (Nichol & Dhariwal 2021) and Gaussian
noise eps; the model sees x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps and predicts eps, and the
loss is the mean squared error of that prediction (per pixel). The noising is computed in float32
inside the model (`Diffusion`), from its own seed generator (checkpointed: a resumed run draws
what the straight one would). The denoiser is a residual MLP over the 64 pixels, told t by a
sinusoidal embedding computed in a float32 layer (`SinusoidalEmbedding`: t * frequency reaches
500 radians, where float16's spacing is 0.25), its `logits` output in float32 as everywhere.

Sampling, after each eval, with the moving average of the weights (`train.ema_decay`, which eval
and the eval-time actions see): `data.num_samples` images by DDPM's ancestral sampler, all the
`model.num_diffusion_steps` from pure noise, each step's prediction of x0 clipped to [-1, 1], from
fixed noise (samples at different evals differ only by the weights). The eval-time action
`score_samples` returns gan_digits' `DigitJudge` scores of them as metrics, which join the
`eval at step N:` line and the run's `Finished ...` line:
  - `frechet_distance`: Fréchet distance between Gaussians fitted to the samples and to the real
    train digits, as 64 pixels in [0, 1] (FID's formula on pixels). Lower is better. Reference
    points (gan_digits' docstring): 256 held-out real digits 0.13, the same with noise of 0.2 0.65,
    averaged pairs of real digits 0.44, uniform noise 10.0, blank images 15.0;
  - `confidence`: mean share of the 10 nearest real train digits that agree on the majority label;
  - `classes_covered`: digits that at least 2% of the samples are classified as (of 10).
The eval Images tab shows an 8x8 grid of samples (`samples`). Eval's own `loss` is the
noise-prediction loss on the held-out digits.

Run (from the repository root)::

    python -m mixloop.train --config=experiments/ddpm_digits.py --workdir=runs/ddpm_digits
    python -m mixloop.train --config=experiments/ddpm_digits.py:quick --workdir=runs/ddpm_quick

Expect, on 2 CPU cores: about 2 minutes in any policy (`--config.precision.policy=...`; 133 s
measured in float32: 4,000 updates at ~70 per second in graph mode, which `jit_compile=auto`
picks after a 49 s probe, and 7 s of sampling per eval), ending at Fréchet distance 0.26,
confidence 0.84 and all 10 digits covered (0.2635 / 0.840 / 10 measured; mixed_float16 0.2607,
mixed_bfloat16 0.2618; 0.54 at step 2,000), train loss 0.185, eval loss 0.199, no update skipped.
The `quick` variant (60 updates of a narrower denoiser, 50 diffusion steps) only checks that
everything runs: a few seconds, samples still far from digits.
"""

from __future__ import annotations

import math
from typing import Optional

import keras
import ml_collections
import numpy as np
import tensorflow as tf

import mixloop
from mixloop.config import base_config

from experiments.digits import load_digits_arrays, split_indices
from experiments.gan_digits import DigitJudge, sample_grid

IMAGE_SHAPE = (8, 8, 1)
NUM_PIXELS = 64
COSINE_OFFSET = 0.008  # Nichol & Dhariwal's s: abar_t = cos^2((t/T + s) / (1 + s) * pi / 2), normalized.
MAX_BETA = 0.999  # Their clip on beta_t, which keeps the last steps from dividing by zero.
MAX_PERIOD = 10_000.0  # The sinusoidal embedding's longest period, in diffusion steps (Transformer's).


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs."""
    config = base_config()
    config.trainer = "experiments.ddpm_digits.DDPMTrainer"  # The Trainer subclass below.
    config.seed = 0  # Initialization, diffusion steps and noise, example order.
    config.precision.policy = "float32"  # Trains in all three; docs/results.md compares them.

    config.model.num_diffusion_steps = 500  # T: steps of the cosine noise schedule, and of sampling.
    config.model.width = 192  # The denoiser's hidden units.
    config.model.num_blocks = 3  # Residual MLP blocks, each told the step by the embedding.
    config.model.time_dim = 64  # Size of the sinusoidal embedding of t.

    config.data.num_eval = 256  # Held-out real images for the eval loss: 2 batches of 128.
    config.data.split_seed = 0  # The permutation that chooses them; fixed apart from `seed`.
    config.data.num_samples = 512  # Images sampled from fixed noise and judged after each eval.

    config.train.num_steps = 4000  # About 330 passes over the 1,541 train images.
    config.train.batch_size = 128  # Images per update, each at its own diffusion step.
    config.train.steps_per_loop = 100  # Updates per compiled loop call.
    config.train.log_every_steps = 500  # Console progress line.
    config.train.repeat_dataset = True  # Many passes over the train images.
    config.train.ema_decay = 0.999  # Eval and the samples use a moving average of the weights.

    config.optimizer.name = "adamw"  # Adam with decoupled weight decay.
    config.optimizer.learning_rate = 2e-3  # Peak learning rate.
    config.optimizer.schedule = "cosine"  # Cosine decay to 0 after warm-up.
    config.optimizer.warmup_steps = 200  # Linear warm-up from 0.
    config.optimizer.weight_decay = 1e-4  # Decoupled weight decay.

    config.eval.every_steps = 2000  # Evaluate (and sample) twice over the run.
    config.checkpoint.every_steps = 2000  # Save twice.

    if arg == "quick":
        config.model.num_diffusion_steps = 50  # A short chain to sample.
        config.model.width = 32  # Narrow.
        config.model.num_blocks = 1  # Shallow.
        config.model.time_dim = 16  # A small embedding.
        config.data.num_samples = 128  # Fewer samples to judge.
        config.train.num_steps = 60  # A few dozen updates.
        config.train.steps_per_loop = 20  # Three loop calls.
        config.train.log_every_steps = 20  # Three progress lines.
        config.train.ema_decay = 0.9  # An average over the last few updates.
        config.optimizer.warmup_steps = 5  # Short warm-up.
        config.eval.every_steps = 30  # Evaluate (and sample) twice.
        config.checkpoint.every_steps = 30  # Save twice.
    elif arg:
        raise ValueError(f"unknown ddpm_digits config variant {arg!r}; expected 'quick' or none")
    return config


def cosine_schedule(num_steps: int) -> dict[str, np.ndarray]:
    """The noise schedule's float64 arrays over t = 0 .. num_steps - 1: `beta` (noise added at step
    t), `alpha` = 1 - beta, `alpha_bar` (the product of alpha up to t: x_t's share of x0's variance)
    and `posterior_variance` (the variance of x_{t-1} given x_t and x0, the sampler's)."""
    fraction = np.arange(num_steps + 1) / num_steps
    squared_cos = np.cos((fraction + COSINE_OFFSET) / (1 + COSINE_OFFSET) * math.pi / 2) ** 2
    beta = np.clip(1.0 - squared_cos[1:] / squared_cos[:-1], 0.0, MAX_BETA)
    alpha_bar = np.cumprod(1.0 - beta)
    previous = np.concatenate([[1.0], alpha_bar[:-1]])
    return {"beta": beta, "alpha": 1.0 - beta, "alpha_bar": alpha_bar,
            "posterior_variance": beta * (1.0 - previous) / (1.0 - alpha_bar)}


@keras.saving.register_keras_serializable(package="ddpm_digits")
class SinusoidalEmbedding(keras.layers.Layer):
    """Diffusion steps t [B] (integers) -> [B, dim]: sin and cos of t at `dim / 2` frequencies from
    1 to 1 / MAX_PERIOD (geometric). Build it with dtype="float32": t * frequency needs float32."""

    def __init__(self, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim

    def call(self, steps):
        half = self.dim // 2
        frequencies = keras.ops.exp(-math.log(MAX_PERIOD) * keras.ops.arange(half, dtype="float32") / half)
        angles = keras.ops.cast(steps, "float32")[:, None] * frequencies[None, :]
        return keras.ops.cast(keras.ops.concatenate([keras.ops.sin(angles), keras.ops.cos(angles)], -1),
                              self.compute_dtype)

    def get_config(self) -> dict:
        return {**super().get_config(), "dim": self.dim}


def denoiser(width: int, num_blocks: int, time_dim: int) -> keras.Model:
    """(x_t [B, 8, 8, 1], t [B] int32) -> predicted noise [B, 8, 8, 1]: a residual MLP, each block
    LayerNorm -> + a projection of the step's embedding -> SiLU -> Dense -> SiLU -> Dense."""
    noisy = keras.Input(IMAGE_SHAPE, name="noisy")
    steps = keras.Input((), dtype="int32", name="steps")
    embedding = SinusoidalEmbedding(time_dim, dtype="float32", name="time_embedding")(steps)
    embedding = keras.layers.Dense(width, activation="silu", name="time_mlp")(embedding)
    h = keras.layers.Dense(width, name="input")(keras.layers.Flatten()(noisy))
    for index in range(num_blocks):
        r = keras.layers.LayerNormalization(name=f"norm{index}")(h)
        r = keras.layers.Add()([r, keras.layers.Dense(width, name=f"time{index}")(embedding)])
        r = keras.layers.Dense(width, activation="silu", name=f"hidden{index}")(keras.layers.Activation("silu")(r))
        h = keras.layers.Add()([h, keras.layers.Dense(width, name=f"output{index}")(r)])
    h = keras.layers.Activation("silu")(keras.layers.LayerNormalization(name="final_norm")(h))
    noise = keras.layers.Reshape(IMAGE_SHAPE)(keras.layers.Dense(NUM_PIXELS, name="logits")(h))
    return keras.Model([noisy, steps], noise, name="denoiser")


@keras.saving.register_keras_serializable(package="ddpm_digits")
class Diffusion(keras.Model):
    """The denoiser, and training's forward process: a call on clean images [B, 8, 8, 1] in [-1, 1]
    draws a step and noise per image from the model's own seed generator, noises them in float32
    and returns {"predicted": the denoiser's prediction of the noise, "noise": the noise drawn}."""

    def __init__(self, num_diffusion_steps: int, width: int, num_blocks: int, time_dim: int,
                 seed: int, **kwargs):
        super().__init__(**kwargs)
        self.num_diffusion_steps = num_diffusion_steps
        self.denoiser = denoiser(width, num_blocks, time_dim)
        self.seed_generator = keras.random.SeedGenerator(seed, name="diffusion_seed")
        alpha_bar = cosine_schedule(num_diffusion_steps)["alpha_bar"]
        self.signal_scale = np.sqrt(alpha_bar).astype(np.float32)  # sqrt(abar_t), per t.
        self.noise_scale = np.sqrt(1.0 - alpha_bar).astype(np.float32)  # sqrt(1 - abar_t), per t.
        self._config = dict(num_diffusion_steps=num_diffusion_steps, width=width,
                            num_blocks=num_blocks, time_dim=time_dim, seed=seed)

    def call(self, images, training=False) -> dict:
        clean = keras.ops.cast(images, "float32")
        steps = keras.random.randint((keras.ops.shape(clean)[0],), 0, self.num_diffusion_steps,
                                     dtype="int32", seed=self.seed_generator)
        noise = keras.random.normal(keras.ops.shape(clean), dtype="float32", seed=self.seed_generator)
        per_image = lambda table: keras.ops.take(table, steps)[:, None, None, None]
        noisy = per_image(self.signal_scale) * clean + per_image(self.noise_scale) * noise
        return {"predicted": self.denoiser([noisy, steps], training=training), "noise": noise}

    def get_config(self) -> dict:
        return {**super().get_config(), **self._config}


class DDPMTrainer(mixloop.Trainer):
    """Noise prediction on the digits; after each eval, samples with the EMA weights and their
    `DigitJudge` scores (an eval-time action's metrics)."""

    def build_model(self) -> keras.Model:
        """The `Diffusion` model, built by one call on a blank image."""
        m = self.config.model
        model = Diffusion(m.num_diffusion_steps, m.width, m.num_blocks, m.time_dim,
                          seed=self.config.seed, name="diffusion")
        model(np.zeros((1, *IMAGE_SHAPE), np.float32))
        return model

    def build_datasets(self) -> tuple[tf.data.Dataset, tf.data.Dataset]:
        """Shuffled train batches and in-order eval batches of real images in [-1, 1] (no labels),
        split by a fixed permutation. Fits the `DigitJudge` on the train images and labels."""
        images, labels = load_digits_arrays()
        eval_index, train_index = split_indices(len(labels), self.config.data)
        self.judge = DigitJudge(images[train_index], labels[train_index])
        images = images * 2.0 - 1.0
        batch_size = self.config.train.batch_size
        train = (tf.data.Dataset.from_tensor_slices(images[train_index])
                 .shuffle(len(train_index), seed=self.config.seed, reshuffle_each_iteration=True)
                 .batch(batch_size, drop_remainder=True))
        evaluation = tf.data.Dataset.from_tensor_slices(images[eval_index]).batch(batch_size)
        return train, evaluation

    def compute_loss(self, outputs: dict, batch: tf.Tensor) -> tf.Tensor:
        """Mean squared error of the predicted noise, per pixel (1.0 for a prediction of zero)."""
        return tf.reduce_mean(tf.square(outputs["predicted"] - outputs["noise"]))

    def actions(self) -> list[mixloop.Action]:
        """The samples' scores and grid after each eval."""
        return [mixloop.Action(self.score_samples, at_eval=True)]

    def score_samples(self, step: int) -> dict[str, float]:
        """Samples `data.num_samples` images with the weights eval used (the EMA ones), writes a grid
        of them as the image summary `samples` and returns their `DigitJudge` scores."""
        images = self.sample(self.config.data.num_samples)
        tf.summary.image("samples", sample_grid(images), step=step)
        return self.judge(images)

    def sample(self, num_images: int) -> np.ndarray:
        """`num_images` images [N, 8, 8, 1] in [0, 1] by DDPM's ancestral sampler from fixed noise
        (NumPy's generator seeded with `config.seed`): the denoiser runs in the run's precision,
        the update of x in float32; each step's estimate of x0 is clipped to [-1, 1]."""
        schedule = {name: values.astype(np.float32)
                    for name, values in cosine_schedule(self.config.model.num_diffusion_steps).items()}
        previous_alpha_bar = np.concatenate([[1.0], schedule["alpha_bar"][:-1]]).astype(np.float32)
        # Traced once per sample (the denoiser's layers may have moved to float32 since): run
        # eagerly, each of the hundreds of calls costs 80 ms of Python where it computes 10.
        denoise = tf.function(lambda x, steps: mixloop.forward(self.model.denoiser, self.policy,
                                                                [x, steps], training=False))
        rng = np.random.default_rng(self.config.seed)
        x = tf.constant(rng.standard_normal((num_images, *IMAGE_SHAPE), dtype=np.float32))
        for t in reversed(range(self.config.model.num_diffusion_steps)):
            noise = denoise(x, tf.fill([num_images], t))
            alpha_bar, previous = schedule["alpha_bar"][t], previous_alpha_bar[t]
            clean = tf.clip_by_value((x - math.sqrt(1.0 - alpha_bar) * noise) / math.sqrt(alpha_bar),
                                     -1.0, 1.0)
            # The mean of x_{t-1} given x_t and the estimate of x0 (Ho et al.'s eq. 7).
            x = (math.sqrt(previous) * schedule["beta"][t] / (1.0 - alpha_bar) * clean
                 + math.sqrt(schedule["alpha"][t]) * (1.0 - previous) / (1.0 - alpha_bar) * x)
            if t:
                x += math.sqrt(schedule["posterior_variance"][t]) * rng.standard_normal(
                    x.shape, dtype=np.float32)
        return (np.clip(x.numpy(), -1.0, 1.0) + 1.0) / 2.0
