"""tiny_experiment with its research hooks misused on purpose, one `config.model` switch each, for
the CLI tests of what a research subclass can get wrong.

`action`: "" (none), "raise_every" (an action every 15 updates that raises from update 30 on),
"raise_at_eval" (an eval-time action that raises from update 40 on), "single" (`actions()`
returns one `Action`, not a list) or "slow" (an action every 5 updates that logs ACTION_STARTED
and sleeps `action_seconds`). `objectives`: "" (the default one), "frozen" (an objective on a
layer with no trainable variables) or "shared" (two objectives training the same layer).
`get_config("dict")` returns the config as a plain dict.
"""

import time

import keras
from absl import logging

import mixloop
import tiny_experiment

ACTION_STARTED = "The slow action started"  # What the slow action logs before it sleeps.


class HooksTrainer(tiny_experiment.TinyTrainer):
    """TinyTrainer whose actions and objectives are what `config.model` asks for."""

    def build_objectives(self):
        kind = self.config.model.objectives
        if kind == "frozen":
            dropout = next(layer for layer in self.model.layers
                           if isinstance(layer, keras.layers.Dropout))
            return {"model": mixloop.Objective(dropout, keras.optimizers.SGD(0.1))}
        if kind == "shared":
            logits = self.model.get_layer("logits")
            return {"a": mixloop.Objective(self.model, keras.optimizers.SGD(0.1)),
                    "b": mixloop.Objective(logits, keras.optimizers.SGD(0.1))}
        return super().build_objectives()

    def actions(self):
        kind = self.config.model.action
        if kind == "raise_every":
            return [mixloop.Action(sample_failing_from(30), every_steps=15)]
        if kind == "raise_at_eval":
            return [mixloop.Action(sample_failing_from(40), at_eval=True)]
        if kind == "single":
            return mixloop.Action(log_the_step, every_steps=20)
        if kind == "slow":
            return [mixloop.Action(self.sleep, every_steps=5)]
        return []

    def sleep(self, step):
        logging.info("%s at step %d", ACTION_STARTED, step)
        time.sleep(self.config.model.action_seconds)


def sample_failing_from(first_failing_step):
    """An action that raises RuntimeError from update `first_failing_step` on."""

    def sample(step):
        if step >= first_failing_step:
            raise RuntimeError(f"no sample at step {step}")

    return sample


def log_the_step(step):
    logging.info("The single action ran at step %d", step)


def get_config(arg=None):
    config = tiny_experiment.get_config()
    config.trainer = "hooks_experiment.HooksTrainer"
    config.model.action = ""  # "", "raise_every", "raise_at_eval", "single" or "slow".
    config.model.action_seconds = 0.0  # How long the slow action sleeps.
    config.model.objectives = ""  # "", "frozen" or "shared".
    return config.to_dict() if arg == "dict" else config
