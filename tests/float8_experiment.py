"""A 3-layer MLP on the digits, quantized by Keras's own `model.quantize("float8")` in build_model:
the float8 tests' model, as a new user writes it (Keras's QDQ Dense layers, whose scale and
amax-history variables the optimizer overwrites with their "gradient").

Run it as `python -m mixloop.train --config=tests/float8_experiment.py` (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import sys
from pathlib import Path

import keras

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # The repository root: experiments.
from experiments import digits  # noqa: E402


class Float8MlpTrainer(digits.DigitsTrainer):
    """Ten-way classification of the flattened digits by an MLP whose Dense layers train in FP8."""

    def build_model(self) -> keras.Model:
        width = self.config.model.width
        images = keras.Input(shape=(8, 8, 1), name="images")
        x = keras.layers.Flatten(name="flatten")(images)
        x = keras.layers.Dense(width, activation="relu", name="dense0")(x)
        x = keras.layers.Dense(width, activation="relu", name="dense1")(x)
        model = keras.Model(images, keras.layers.Dense(digits.NUM_CLASSES, name="logits")(x))
        if self.config.model.quantize:
            model.quantize("float8")
        return model


def get_config(arg=None):
    config = digits.get_config()
    config.trainer = "float8_experiment.Float8MlpTrainer"
    config.model = type(config.model)()
    config.model.width = 64  # Hidden units of the two hidden Dense layers.
    config.model.quantize = True  # model.quantize("float8") after building.
    config.train.num_steps = 200  # The 200 updates.
    config.train.accumulation_steps = 1  # One micro-batch of 32.
    config.train.steps_per_loop = 50
    config.eval.every_steps = 200
    config.checkpoint.every_steps = 200
    config.optimizer.warmup_steps = 20
    if arg == "quick":
        config.train.num_steps = 20
        config.train.steps_per_loop = 10
        config.train.log_every_steps = 10
        config.eval.every_steps = 20
        config.checkpoint.every_steps = 10
    elif arg:
        raise ValueError(f"unknown float8 config variant {arg!r}; expected 'quick' or none")
    return config
