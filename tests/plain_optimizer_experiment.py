"""The tiny experiment with a research `build_optimizer` returning Keras's own SGD, as a user who
never heard of compact optimizers writes it: with `optimizer.state_dtype=int8` or bfloat16 master
weights the run must refuse it in one line (tests/test_lighter_runs.py).

Run it as `python -m mixloop.train --config=tests/plain_optimizer_experiment.py` (tests/ on PYTHONPATH).
"""

import keras

import tiny_experiment


class PlainOptimizerTrainer(tiny_experiment.TinyTrainer):
    """TinyTrainer trained by a plain `keras.optimizers.SGD`, whatever the config asks."""

    def build_optimizer(self):
        return keras.optimizers.SGD(self.config.optimizer.learning_rate)


def get_config(arg=None):
    config = tiny_experiment.get_config(arg)
    config.trainer = "plain_optimizer_experiment.PlainOptimizerTrainer"
    return config
