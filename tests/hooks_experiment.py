"""tiny_experiment with its research hooks misused on purpose, one `config.model` switch each, for
the CLI tests of what a research subclass can get wrong.

`action`: "" (none), "raise_every" (an action every 15 updates that raises from update 30 on),
"raise_at_eval" (an eval-time action that raises from update 40 on), "single" (`actions()`
returns one `Action`, not a list) or "slow" (an action every 5 updates that logs ACTION_STARTED
and sleeps `action_seconds`). `objectives`: "" (the default one), "frozen" (an objective on a
layer with no trainable variables) or "shared" (two objectives training the same layer).
`python_loop_loss`: `compute_loss` loops over the labels' batch dimension in Python;
`unknown_label_batch`: the labels lose their static batch dimension in a map.
`get_config("dict")` returns the config as a plain dict; `get_config("own_dict")` a plain dict of
the experiment's own, without the framework's keys.
"""

import time

import keras
import tensorflow as tf
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

    def build_datasets(self):
        train, evaluation = super().build_datasets()
        if self.config.model.unknown_label_batch:
            train = train.map(lambda x, y: (x, tf.boolean_mask(y, y >= 0)))  # Every row.
        return train, evaluation

    def compute_loss(self, outputs, batch):
        if not self.config.model.python_loop_loss:
            return super().compute_loss(outputs, batch)
        labels = batch[1]
        total = 0.0
        for row in range(labels.shape[0]):  # A static batch dimension, or a one-line error.
            total += keras.losses.sparse_categorical_crossentropy(labels[row], outputs[row],
                                                                  from_logits=True)
        return total / labels.shape[0]

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
    config.model.python_loop_loss = False  # compute_loss loops over the batch in Python.
    config.model.unknown_label_batch = False  # The labels lose their static batch dimension.
    if arg == "own_dict":
        return {"trainer": config.trainer, "model": config.model.to_dict(), "train": {"num_steps": 4}}
    return config.to_dict() if arg == "dict" else config
