"""BYOL on scikit-learn's bundled 8x8 digits: a momentum target network as `Objective(after_update=...)`.

Bootstrap Your Own Latent (Grill et al. 2020): each image is augmented twice (simclr_digits'
`Augment`: a shift of up to one pixel, a random contrast, Gaussian noise); the online network
(`online`: a small CNN encoder and a projector) and a predictor map one view to a prediction of
what the target network (`target`: the same encoder and projector) makes of the other view. The
loss is 2 - 2 cos(prediction, target projection), symmetrized over the two views (0 when they
agree, 2 when orthogonal). No gradient reaches the target (it is not trainable): after each
applied update of the online network, `after_update` moves it toward the online one,
target <- decay * target + (1 - decay) * online, inside the compiled step on the float32 master
weights (never on a skipped update, once per update whatever the accumulation). There are no
negative pairs: what keeps the representations from collapsing to a constant is the predictor
and the slowly moving target.

Eval, after each `eval.every_steps`: `loss`, the BYOL loss on augmented held-out images; and the
eval-time action `probe_representations`, whose metrics join the `eval at step N:` and
`Finished ...` lines: `knn_accuracy`, the 1-nearest-neighbour (cosine) accuracy of the held-out
digits' encoder representations against the labelled train digits', `few_label_accuracy`, the
same against 5 labelled train digits per class, and `spread`, the representations' standard
deviation across the held-out digits after normalizing each to unit length, times sqrt(its size)
(0 for a collapsed encoder that maps every digit to one point). Reference points on this split
(simclr_digits' docstring): raw pixels 0.995 and 0.891; a random encoder 0.977 and 0.807.

Run (from the repository root)::

    python -m mixloop.train --config=experiments/byol_digits.py --workdir=runs/byol_digits
    python -m mixloop.train --config=experiments/byol_digits.py:quick --workdir=runs/byol_quick

Expect, on 2 CPU cores: about 70 seconds in float32 (69 s measured: 1,500 updates in graph mode,
which `jit_compile=auto` picks after a 21 s probe), 2 minutes in mixed_float16 (XLA), ending at
1-NN accuracy 0.98 and 0.84 from 5 labels per class, spread 0.39, eval loss 0.14 (0.9818 / 0.8385
/ 0.395 / 0.1396 measured; mixed_float16 0.9714 / 0.8594, mixed_bfloat16 0.9661 / 0.7891), no
update skipped.
The `quick` variant (40 updates of a narrower model) only checks that everything runs.
"""

from __future__ import annotations

from typing import Optional

import keras
import ml_collections
import numpy as np
import tensorflow as tf

import mixloop

from experiments.simclr_digits import (Augment, SimCLRTrainer, build_encoder,
                                       nearest_neighbor_accuracy, two_view_config)

IMAGE_SHAPE = (8, 8, 1)


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs."""
    config = two_view_config("byol_digits", arg)  # simclr_digits' encoder, augmentation and schedule.
    config.trainer = "experiments.byol_digits.BYOLTrainer"  # The Trainer subclass below.
    config.precision.policy = "float32"  # Trains in all three; docs/results.md compares them.

    config.model.hidden_dim = 256  # Hidden units of the projector and of the predictor.
    config.model.projection_dim = 64  # The projector's and the predictor's output.
    config.model.target_decay = 0.99  # The target's moving average: target <- d * target + (1 - d) * online.

    if arg == "quick":
        config.model.hidden_dim = 32  # Narrow.
        config.model.projection_dim = 16  # Narrow.
        config.model.target_decay = 0.9  # A target that visibly moves in a few updates.
    return config


def byol_loss(prediction: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
    """2 - 2 cos(prediction, target) per row [N], float32; no gradient flows into `target`."""
    prediction = tf.math.l2_normalize(prediction, axis=1)
    target = tf.math.l2_normalize(tf.stop_gradient(target), axis=1)
    return 2.0 - 2.0 * tf.reduce_sum(prediction * target, axis=1)


def spread(representations: np.ndarray) -> float:
    """The mean over features of the standard deviation over rows of the unit-length rows, times
    sqrt(features): 0 when every row is the same point."""
    unit = representations / np.maximum(np.linalg.norm(representations, axis=1, keepdims=True), 1e-12)
    return float(unit.std(axis=0).mean() * np.sqrt(unit.shape[1]))


def _mlp(hidden_dim: int, output_dim: int, name: str) -> keras.Sequential:
    """Dense -> BatchNorm -> ReLU -> Dense: BYOL's projector and predictor (with LayerNorm in its
    place the representations collapse here: 1-NN from 5 labels per class ends at 0.71, below a
    random encoder's 0.81, with a train loss of 0.001)."""
    return keras.Sequential([
        keras.layers.Dense(hidden_dim, use_bias=False, name="hidden"),
        keras.layers.BatchNormalization(name="norm"),
        keras.layers.ReLU(name="relu"),
        keras.layers.Dense(output_dim, name="output"),
    ], name=name)


def _tower(m: ml_collections.ConfigDict, name: str) -> keras.Sequential:
    """simclr_digits' encoder (its output: the representation) and the projector, built."""
    return keras.Sequential([keras.Input(IMAGE_SHAPE), build_encoder(m),
                             _mlp(m.hidden_dim, m.projection_dim, "projector")], name=name)


class BYOLTrainer(mixloop.Trainer):
    """Self-supervised digit representations; the target network follows the online one in
    `after_update`; eval-time metrics from the encoder's representations."""

    def build_model(self) -> keras.Model:
        """Images -> two `Augment`ed views -> {"p1", "p2"}: the online predictions [B, projection_dim]
        for each view, {"z1", "z2"}: the target's projections of each."""
        m = self.config.model
        images = keras.Input(IMAGE_SHAPE, name="images")
        augment = Augment(m.max_shift, m.contrast, m.noise, seed=self.config.seed, name="augment")
        online, target = _tower(m, "online"), _tower(m, "target")
        predictor = keras.Sequential([keras.Input((m.projection_dim,)),
                                      _mlp(m.hidden_dim, m.projection_dim, "mlp")], name="predictor")
        target.set_weights(online.get_weights())  # It starts as the online network.
        # No optimizer trains it: it follows. Declared here, not in build_objectives(), so that
        # every model build_model() makes (the precision probe's float32 twin) has it frozen too.
        target.trainable = False
        view1, view2 = augment(images), augment(images)
        return keras.Model(images, {"p1": predictor(online(view1)), "p2": predictor(online(view2)),
                                    "z1": target(view1), "z2": target(view2)}, name="byol")

    def build_objectives(self) -> dict[str, mixloop.Objective]:
        """One objective: the model's trainable variables (online and predictor; the target is
        not trainable), and after each applied update the target's step toward the online tower."""
        online, target = self.model.get_layer("online"), self.model.get_layer("target")
        decay = self.config.model.target_decay

        def follow_online():
            for target_weight, online_weight in zip(target.weights, online.weights):
                # The online weights as stored: bfloat16 with precision.master_weights="bfloat16".
                online_weight = tf.cast(online_weight, target_weight.dtype)
                target_weight.assign(decay * target_weight + (1.0 - decay) * online_weight)

        return {"model": mixloop.Objective(self.model, mixloop.build_optimizer(self.config),
                                           after_update=follow_online)}

    # simclr_digits' split, few-label set and batches; its `probe` arrays are what the eval reads.
    build_datasets = SimCLRTrainer.build_datasets

    def compute_loss(self, outputs: dict, batch: tuple) -> tf.Tensor:
        """The BYOL loss, averaged over the batch and the two directions."""
        return tf.reduce_mean(byol_loss(outputs["p1"], outputs["z2"])
                              + byol_loss(outputs["p2"], outputs["z1"])) / 2.0

    def actions(self) -> list[mixloop.Action]:
        """The representations' 1-NN accuracies and spread after each eval."""
        return [mixloop.Action(self.probe_representations, at_eval=True)]

    def probe_representations(self, step: int) -> dict[str, float]:
        """`knn_accuracy`, `few_label_accuracy` and `spread` of the online encoder's representations
        of the un-augmented digits (with the weights eval used)."""
        represented = {name: self.represent(images) for name, (images, _) in self.probe.items()}
        labels = {name: labels for name, (_, labels) in self.probe.items()}
        metrics = {metric: nearest_neighbor_accuracy(represented[reference], labels[reference],
                                                     represented["eval"], labels["eval"])
                   for metric, reference in (("knn_accuracy", "train"), ("few_label_accuracy", "few"))}
        return {**metrics, "spread": spread(represented["eval"])}

    def represent(self, images: np.ndarray) -> np.ndarray:
        """The online encoder's representations [N, representation_dim] of `images`, in the run's
        precision."""
        encoder = self.model.get_layer("online").get_layer("encoder")
        return np.concatenate([
            np.asarray(mixloop.forward(encoder, self.policy, tf.constant(chunk), training=False))
            for chunk in np.array_split(images, max(len(images) // 512, 1))])
