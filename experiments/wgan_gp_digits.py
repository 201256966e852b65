"""WGAN-GP on scikit-learn's bundled 8x8 digits: the critic updated 5 times per generator update, a gradient penalty.

gan_digits' generator and discriminator (here the critic, its one output an unbounded score), with
Gulrajani et al.'s (2017) losses: the critic minimizes mean D(fake) - mean D(real) plus 10 times the
gradient penalty (E[(|d D(x) / d x| - 1)^2] at random interpolations x of real and generated
images) plus a drift term 0.001 E[D(real)^2] that keeps the scores near 0 (Karras et al. 2018);
the generator minimizes -mean D(fake). The generator is an `Objective(..., every_steps=5)`
(n_critic = 5): on steps 5, 10, 15, ... both objectives update from one forward pass, on the others
the critic alone, and the generator's backward is not computed at all. Its optimizer's schedule
and iterations count its own updates (`mixloop.build_optimizer(config, every_steps=5)`).

The penalty's inner gradient is `mixloop.input_gradients` of the critic run in the policy
(`mixloop.forward`): in mixed_float16 that inner backward runs in float16 unscaled (each
example's own score, values far from float16's limits), the outer one, through it, under the
critic's dynamic loss scale.

Eval: the critic's Wasserstein estimate on held-out real images and fresh fakes (`wasserstein`:
mean D(real) - mean D(fake)) and gan_digits' sample judge (`frechet_distance`, `confidence`,
`classes_covered`; reference points in gan_digits' docstring), and the sample grid.

Run (from the repository root)::

    python -m mixloop.train --config=experiments/wgan_gp_digits.py --workdir=runs/wgan_gp_digits
    python -m mixloop.train --config=experiments/wgan_gp_digits.py:quick --workdir=runs/wgan_gp_quick

Expect, on 2 CPU cores: about 4.5 minutes in mixed_float16 (282 s measured: 10,000 updates at ~40
per second with XLA, after a 24 s probe of the compile modes: float16 convolutions' double backward
is slow on a CPU; 79 s in float32, graph mode),
ending at Fréchet distance 1.2, confidence 0.77, all 10 digits covered (1.1889 / 0.773 / 10
measured; float32 1.4290 / 0.744 / 10), still improving (6.1 at step 2,500, 2.5 at 7,500). The
critic's penalty backward overflows 3 times: twice on a step of the critic's alone, taken again
on its batch at the halved scale (`precision.overflow_retries`), once at step 8,300, where the
generator's update went ahead, so the critic's is skipped (1 update); the generator's skips none.
The `quick` variant (100 updates, 20 of the generator's, of a narrower pair) only checks that
everything runs.
"""

from __future__ import annotations

from typing import Optional

import keras
import ml_collections
import tensorflow as tf

import mixloop

from experiments import gan_digits


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs."""
    config = gan_digits.get_config(arg)  # The same model, data, eval and precision.
    config.trainer = "experiments.wgan_gp_digits.WGANGPTrainer"  # The Trainer subclass below.
    config.model.n_critic = 5  # Critic updates per generator update (the generator's every_steps).
    config.model.penalty_weight = 10.0  # The gradient penalty's weight (lambda).
    config.model.drift_weight = 1e-3  # E[D(real)^2]'s weight, keeping the scores near 0.

    config.train.num_steps = 10000  # 2,000 generator updates, 10,000 critic updates.
    config.train.log_every_steps = 1000  # Console progress line.
    # Both objectives' optimizers, as Gulrajani et al.: Adam without momentum, beta_2 0.9.
    config.optimizer.learning_rate = 1e-4  # Constant; the same for generator and critic.
    config.optimizer.beta_1 = 0.0  # No momentum.
    config.optimizer.beta_2 = 0.9  # A short memory of the gradients' scale.
    config.eval.every_steps = 2500  # Evaluate four times over the run.
    config.checkpoint.every_steps = 5000  # Save twice.

    if arg == "quick":
        config.train.num_steps = 100  # 20 generator updates.
        config.train.log_every_steps = 50  # Two progress lines.
        config.eval.every_steps = 50  # Evaluate twice.
        config.checkpoint.every_steps = 50  # Save twice.
    return config


@keras.saving.register_keras_serializable(package="wgan_gp_digits")
class WGAN(gan_digits.GAN):
    """gan_digits' GAN whose call on real images also draws, per image, the mix of real and
    generated image at which the gradient penalty is taken (from the model's seed generator)."""

    def call(self, images, training=False) -> dict:
        """{"real_scores": [B, 1], "fake_scores": [B, 1], "fake_images": [B, 8, 8, 1] in [-1, 1],
        "mix": [B, 1, 1, 1] in [0, 1]}."""
        batch = keras.ops.shape(images)[0]
        noise = keras.random.normal((batch, self.latent_dim), dtype=self.compute_dtype,
                                    seed=self.seed_generator)
        fake = self.generator(noise, training=training)
        scores = self.discriminator(
            keras.ops.concatenate([keras.ops.cast(images, fake.dtype), fake]), training=training)
        real_scores, fake_scores = keras.ops.split(scores, 2)
        mix = keras.random.uniform((batch, 1, 1, 1), dtype=self.compute_dtype, seed=self.seed_generator)
        return {"real_scores": real_scores, "fake_scores": fake_scores, "fake_images": fake,
                "mix": mix}


class WGANGPTrainer(gan_digits.GANTrainer):
    """Objectives `generator` (every `model.n_critic` steps) and `critic`; gan_digits' data, sample
    judge and grid."""

    def build_model(self) -> keras.Model:
        """The WGAN, built by one call on a blank image."""
        m = self.config.model
        model = WGAN(m.latent_dim, m.generator_channels, m.discriminator_channels,
                     m.batchnorm_momentum, seed=self.config.seed, name="wgan")
        model(tf.zeros((1, *gan_digits.IMAGE_SHAPE)))
        return model

    def build_objectives(self) -> dict[str, mixloop.Objective]:
        """The generator, updated every `n_critic` steps, and the critic, each with the optimizer
        `config.optimizer` describes (the generator's schedule over its own updates)."""
        n_critic = self.config.model.n_critic
        return {"generator": mixloop.Objective(
                    self.model.generator, mixloop.build_optimizer(self.config, every_steps=n_critic),
                    every_steps=n_critic),
                "critic": mixloop.Objective(self.model.discriminator, mixloop.build_optimizer(self.config))}

    def compute_loss(self, outputs: dict, batch: tf.Tensor) -> dict[str, mixloop.Loss]:
        """The critic's Wasserstein loss, penalty and drift; the generator's -mean D(fake); the
        train Wasserstein estimate (`wasserstein`) and the penalty (`penalty`) as metrics."""
        real, fake = outputs["real_scores"], outputs["fake_scores"]
        wasserstein = tf.reduce_mean(real) - tf.reduce_mean(fake)
        penalty = self.gradient_penalty(batch, outputs["fake_images"], outputs["mix"])
        m = self.config.model
        critic = -wasserstein + m.penalty_weight * penalty + m.drift_weight * tf.reduce_mean(real**2)
        return {"generator": -tf.reduce_mean(fake),
                "critic": mixloop.Loss(critic, metrics={"wasserstein": wasserstein,
                                                        "penalty": penalty})}

    def gradient_penalty(self, real: tf.Tensor, fake: tf.Tensor, mix: tf.Tensor) -> tf.Tensor:
        """E[(|d D(x) / d x| - 1)^2] at x = mix * real + (1 - mix) * fake, per image, in float32:
        the inner gradient from `mixloop.input_gradients` of the critic in the run's policy."""
        interpolated = mix * real + (1.0 - mix) * fake
        gradients = mixloop.input_gradients(
            lambda x: mixloop.forward(self.model.discriminator, self.policy, x, training=True),
            interpolated)
        norms = tf.sqrt(tf.reduce_sum(tf.square(gradients), axis=[1, 2, 3]) + 1e-12)
        return tf.reduce_mean(tf.square(norms - 1.0))

    def eval_metrics(self, outputs: dict, batch: tf.Tensor) -> dict[str, tf.Tensor]:
        """The critic's Wasserstein estimate on held-out real images and fresh fakes."""
        return {"wasserstein": tf.reduce_mean(outputs["real_scores"])
                - tf.reduce_mean(outputs["fake_scores"])}
