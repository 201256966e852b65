"""A small keras-hub Vision Transformer on scikit-learn's bundled 8x8 handwritten digits.

A `keras_hub.models.ViTBackbone` built from its config (random weights: no preset, no download)
cuts each digit into 2x2 patches and classifies it from its class token. The data and its split are
`digits`'s (1,797 images that ship inside scikit-learn). ViT is here because it is a model nobody here
wrote whose float16 run, with Keras's usual loss scale starting at 2**15, skips its first updates
while the scale backs off, and those skipped updates cost accuracy; the default
`precision.initial_scale=auto` starts the scale where the probed gradients fit.

Run (from the repository root; needs `pip install keras-hub` and scikit-learn)::

    python -m mixloop.train --config=experiments/vit_digits.py --workdir=runs/vit_digits
    python -m mixloop.train --config=experiments/vit_digits.py:quick --workdir=runs/vit_quick

docs/results.md has its figures and the command that made them.
"""

from __future__ import annotations

from typing import Optional

import keras
import ml_collections

from experiments.bert_mlm import import_keras_hub
from experiments.digits import NUM_CLASSES, DigitsTrainer, get_config as digits_config


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs: `digits`'s data,
    schedule and variants, with a ViT instead of the CNN."""
    if arg not in (None, "", "quick"):
        raise ValueError(f"unknown vit_digits config variant {arg!r}; expected 'quick' or none")
    config = digits_config(arg)
    config.trainer = "experiments.vit_digits.ViTDigitsTrainer"  # The Trainer subclass below.
    config.model = ml_collections.ConfigDict()
    config.model.patch_size = 2  # 16 patches of 2x2 pixels, and a class token.
    config.model.num_layers = 2  # Transformer encoder layers.
    config.model.num_heads = 4  # Attention heads.
    config.model.hidden_dim = 64  # Width of the residual stream.
    config.model.mlp_dim = 128  # Width of the feed-forward layers.
    config.optimizer.learning_rate = 1e-3  # Peak learning rate; 3e-3 (the CNN's) is unstable here.
    if arg == "quick":
        config.model.num_layers = 1  # One encoder layer.
        config.model.hidden_dim = 32  # Narrow.
        config.model.mlp_dim = 64
    return config


class ViTDigitsTrainer(DigitsTrainer):
    """Ten-way classification of 8x8 digits with a keras-hub ViT; `digits`'s data and metrics."""

    def build_model(self) -> keras.Model:
        """The backbone on the image, then logits over its class token's output."""
        keras_hub = import_keras_hub("vit_digits")
        m = self.config.model
        backbone = keras_hub.models.ViTBackbone(
            image_shape=(8, 8, 1), patch_size=m.patch_size, num_layers=m.num_layers,
            num_heads=m.num_heads, hidden_dim=m.hidden_dim, mlp_dim=m.mlp_dim, name="vit")
        images = keras.Input(shape=(8, 8, 1), name="images")
        class_token = backbone(images)[:, 0, :]
        logits = keras.layers.Dense(NUM_CLASSES, name="logits")(class_token)
        return keras.Model(images, logits, name="vit_digits")
