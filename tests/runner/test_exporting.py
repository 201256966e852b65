"""The exported model.keras loads in a fresh process with the code the export logs, and predicts
what the trained model does; a class no loader could rebuild is named when the export is written."""

import cli_runs
import logging
import os
import re
import subprocess
import sys
import importlib
import types

import keras
import numpy as np
import pytest
import tiny_experiment

from mixloop.errors import UserError
from mixloop.runner import exporting

REPO = cli_runs.REPO


def predict_in_fresh_process(loading_code, inputs_path, outputs_path, predictor="model"):
    """Runs `loading_code` in a new Python (only it imports anything), then saves the outputs of the
    loaded `predictor` (the model or one of its parts) on the saved inputs; returns them."""
    outputs = f"{predictor}(inputs, training=False)"
    script = (f"{loading_code}\nimport numpy as np\ninputs = np.load({str(inputs_path)!r})\n"
              f"np.save({str(outputs_path)!r}, keras.ops.convert_to_numpy({outputs}))")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return np.load(outputs_path)


@pytest.mark.slow
def test_the_export_of_a_run_loads_with_plain_keras_and_predicts_as_the_trained_model(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    config = tiny_experiment.get_config()
    config.precision.policy = "float32"  # The trained model's own predictions are float32 ones.
    config.train.num_steps = 5
    config.eval.every_steps = 0
    trainer = tiny_experiment.TinyTrainer(config, str(tmp_path))
    trainer.train()
    path = str(tmp_path / "model.keras")
    code = re.search(r"Exported the float32 model to .*; load it with: (.*)", caplog.text).group(1)
    assert code == f"import keras; model = keras.models.load_model({path!r})"

    inputs = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    np.save(tmp_path / "inputs.npy", inputs)
    loaded = predict_in_fresh_process(code, tmp_path / "inputs.npy", tmp_path / "outputs.npy")
    expected = keras.ops.convert_to_numpy(trainer.model(inputs, training=False))
    assert loaded.dtype == np.float32 and loaded.shape == (16, 3)
    np.testing.assert_allclose(loaded, expected, rtol=1e-6, atol=1e-6)
    assert np.ptp(expected) > 0.1  # Real predictions, not a constant both sides could agree on.


def built(trainer_class, config):
    """`trainer_class.build_model()` for `config`, without data or training."""
    return trainer_class.build_model(types.SimpleNamespace(config=config))


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["charlm", "gan_digits"])
def test_the_experiments_own_classes_load_after_importing_their_module(tmp_path, monkeypatch,
                                                                     experiment):
    monkeypatch.syspath_prepend(REPO)  # Imported as the CLI imports it: from the repository root.
    module = importlib.import_module(f"experiments.{experiment}")
    if experiment == "charlm":
        model = built(module.CharLMTrainer, module.get_config("quick"))
        predictor, inputs = "model", np.arange(2 * 32, dtype=np.int32).reshape(2, 32) * 7 % 256
        model.get_layer("position_embedding").positions.assign(
            np.random.default_rng(1).normal(size=(32, 32)))  # Zeros at first: make it count.
    else:  # The part a GAN is exported for: the generator, from given noise.
        model = built(module.GANTrainer, module.get_config("quick"))
        predictor, inputs = "model.generator", np.random.default_rng(2).normal(size=(4, 32))
    path = str(tmp_path / "model.keras")
    model.save(path)
    classes = exporting.custom_classes(path)
    assert exporting.loading_problems(classes) == []
    code = exporting.loading_code(path, classes)
    assert code == (f"import keras; import experiments.{experiment}; "
                    f"model = keras.models.load_model({path!r})")

    np.save(tmp_path / "inputs.npy", inputs)
    loaded = predict_in_fresh_process(code, tmp_path / "inputs.npy", tmp_path / "outputs.npy",
                                      predictor)
    expected = keras.ops.convert_to_numpy(
        (model if predictor == "model" else model.generator)(inputs, training=False))
    np.testing.assert_allclose(loaded, expected, rtol=1e-5, atol=1e-6)
    assert np.ptp(expected) > 0.1


class Unregistered(keras.layers.Layer):
    def call(self, x):
        return x * 2.0


@keras.saving.register_keras_serializable(package="test_export")
class InMain(keras.layers.Layer):
    def call(self, x):
        return x + 1.0


InMain.__module__ = "__main__"  # As when defined in a script or notebook.


def test_classes_no_loader_could_rebuild_are_named_with_the_fix(tmp_path):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, activation="gelu")(InMain()(Unregistered()(inputs)))
    path = str(tmp_path / "model.keras")
    keras.Model(inputs, outputs).save(path)

    classes = exporting.custom_classes(path)
    assert classes == [exporting.CustomClass("Unregistered", __name__, registered=False),
                       exporting.CustomClass("InMain", "__main__", registered=True)]
    problems = exporting.loading_problems(classes)
    assert len(problems) == 2
    assert problems[0].startswith("Unregistered (from test_exporting) is not registered")
    assert "@keras.saving.register_keras_serializable(package=...)" in problems[0]
    assert problems[1] == ("InMain is defined in __main__ (a script or notebook), which a loader "
                           "cannot import: move it into a module")


class UnsavableMap(keras.layers.Layer):
    """Applies a function given to its constructor, which no config can hold: Keras cannot save it."""

    def __init__(self, fn, **kwargs):
        super().__init__(**kwargs)
        self.fn = fn

    def call(self, inputs):
        return self.fn(inputs)


class UnsavableTrainer(tiny_experiment.TinyTrainer):
    def build_model(self):
        inputs = keras.Input((8,))
        hidden = UnsavableMap(lambda x: 2.0 * x)(keras.layers.Dense(16)(inputs))
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))


def test_an_export_keras_cannot_save_is_a_warning_not_a_traceback(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    trainer = UnsavableTrainer(tiny_experiment.get_config(), str(tmp_path))

    assert trainer.run.export() is None

    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                 and "Could not export" in r.getMessage()]
    assert warning.startswith("Could not export the model (the checkpoints hold the trained "
                              "weights): NotImplementedError: ")
    assert not {"model.keras", "model-partial.keras"} & set(os.listdir(tmp_path))


def test_a_model_keras_folder_made_during_the_run_is_one_line_and_leaves_no_partial_export(tmp_path):
    """A folder in its place at the start is refused then (test_train_cli); one made later fails
    the export's rename, which says so and removes the half it wrote."""
    trainer = tiny_experiment.TinyTrainer(tiny_experiment.get_config(), str(tmp_path))
    (tmp_path / "model.keras").mkdir()

    with pytest.raises(UserError) as raised:
        trainer.run.export()

    assert str(raised.value) == (
        f"could not export the model to {tmp_path}/model.keras: Is a directory; move it away and run "
        "the same command to export the trained weights (the checkpoints hold them)")
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]
