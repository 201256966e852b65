"""Research models the framework must describe honestly: a frozen teacher loaded from a `.keras` file
inside the model (`config.model.teacher_path`), and with the `subclassed` variant a subclassed model
without a `get_config`, which Keras cannot export.

Run it as `python -m mixloop.train --config=tests/loaded_model_experiment.py[:subclassed]` (tests/ on
PYTHONPATH).
"""

import keras

import tiny_experiment


class TeacherTrainer(tiny_experiment.TinyTrainer):
    """TinyTrainer's data; the logits read a frozen teacher's outputs beside a hidden layer."""

    def build_model(self):
        teacher = keras.models.load_model(self.config.model.teacher_path)
        teacher.trainable = False
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(self.config.model.width, activation="relu")(inputs)
        both = keras.layers.Concatenate()([hidden, teacher(inputs)])
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(both))


class TwoLayers(keras.Model):
    """A subclassed model whose constructor takes an argument, without a `get_config`."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(width, activation="relu")
        self.logits = keras.layers.Dense(3, name="logits")

    def call(self, inputs):
        return self.logits(self.hidden(inputs))


class SubclassedTrainer(tiny_experiment.TinyTrainer):
    def build_model(self):
        model = TwoLayers(self.config.model.width)
        model(keras.ops.zeros((1, 8)))
        return model


def get_config(arg=None):
    config = tiny_experiment.get_config()
    config.trainer = ("loaded_model_experiment.SubclassedTrainer" if arg == "subclassed"
                      else "loaded_model_experiment.TeacherTrainer")
    config.model.teacher_path = ""  # A .keras model mapping 8 features to some outputs.
    config.train.num_steps = 10
    config.eval.every_steps = 10
    config.checkpoint.every_steps = 10
    return config
