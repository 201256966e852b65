"""FP8 layers: `precision.float8_layers` (regex and auto) quantizing with Keras's float8 layers after
the float32 placement, a float8 layer the placement keeps in float32, and their variables training."""

import cli_runs
import importlib
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from cli_runs import FIXTURES_DIR, error_lines, run
from mixloop.config import ConfigError
from mixloop.engine import float8_layers
from mixloop.engine.layer_precision import describe_placement, keep_float32_layers, named_layers
from mixloop.engine.policy import Policy
from mixloop.engine.step import TrainStep

FLOAT8_CONFIG = os.path.join(FIXTURES_DIR, "float8_experiment.py")
# The six variables Keras's float8 Dense and EinsumDense add, which the optimizer overwrites.
FLOAT8_VARIABLES = ("inputs_scale", "inputs_amax_history", "kernel_scale", "kernel_amax_history",
                    "outputs_grad_scale", "outputs_grad_amax_history")
WIDTH, NUM_CLASSES, BATCH_SIZE = 8, 3, 4


def mlp(quantize=False):
    """Dense, EinsumDense, a Dense the tests keep in float32 by regex, a softmax and `logits`."""
    def build():
        inputs = keras.Input((WIDTH,))
        x = keras.layers.Dense(WIDTH, activation="relu", name="dense")(inputs)
        x = keras.layers.EinsumDense("ab,bc->ac", output_shape=WIDTH, name="einsum")(x)
        x = keras.layers.Dense(WIDTH, name="kept")(x)
        x = keras.layers.Softmax(name="softmax")(x)
        model = keras.Model(inputs, keras.layers.Dense(NUM_CLASSES, name="logits")(x))
        if quantize:  # As a user quantizes a model in build_model.
            model.quantize("float8", filters="dense|einsum|kept|logits")
        return model
    return build


class Residual(keras.layers.Layer):
    """`x + dense(x)`: plain arithmetic after a sublayer, which must hand back the compute dtype."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(WIDTH, name="dense")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        return x + self.dense(x)


def residual_model():
    inputs = keras.Input((WIDTH,))
    x = Residual(name="block")(inputs)
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES, name="logits")(x))


def batch():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(BATCH_SIZE, WIDTH)), tf.float32),
            tf.constant(rng.integers(0, NUM_CLASSES, BATCH_SIZE), tf.int32))


def cross_entropy(logits, batch):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch[1], logits, from_logits=True))


def placed(build_fn, policy_name, float32_layers="kept", float8="", quantize=()):
    """The model built under the policy, placed, then quantized as `float8` selects (as the
    Trainer does)."""
    policy = Policy.from_string(policy_name)
    model = mixloop.build_model(build_fn, policy, float32_layers=float32_layers)
    float8_layers.quantize_selected(model, policy, float8)
    return model, policy


def policies(model):
    return {path: layer.dtype_policy.name for path, layer in named_layers(model).items()
            if isinstance(layer, float8_layers.FLOAT8_TYPES)}


def test_a_float8_layer_kept_in_float32_keeps_float8_with_float32_compute():
    policy = Policy.from_string("mixed_bfloat16")
    with mixloop.engine.layer_precision.building_under(policy):
        model = mlp(quantize=True)()
    kept = keep_float32_layers(model, policy, "kept")

    assert policies(model) == {"dense": "float8_from_mixed_bfloat16",
                               "einsum": "float8_from_mixed_bfloat16",
                               "kept": "float8_from_float32", "logits": "float8_from_float32"}
    assert model.get_layer("logits").compute_dtype == "float32"
    assert describe_placement(kept, policy) == (
        "Layers computing in float32, the rest in bfloat16: 1 by precision.float32_layers (kept as "
        "float8_from_float32, its quantization kept); 1 by Softmax (default type) (softmax); 1 by "
        "named logits (logits as float8_from_float32, its quantization kept)")


@pytest.mark.parametrize("how", ["quantized by the user, then placed", "float8_layers=.*"])
def test_every_float8_layers_variables_move_in_training_under_bfloat16(how):
    """The QDQ runs in every float8 layer, those computing in float32 too: each of its six
    variables changes in two updates (the scales follow the first update's amax history)."""
    if how == "float8_layers=.*":
        model, policy = placed(mlp(), "mixed_bfloat16", float8="dense|einsum|kept|logits")
    else:
        model, policy = placed(mlp(quantize=True), "mixed_bfloat16")
    layers = [model.get_layer(name) for name in ("dense", "einsum", "kept", "logits")]
    before = {(layer.name, name): getattr(layer, name).numpy()
              for layer in layers for name in FLOAT8_VARIABLES}
    step = TrainStep(model=model, optimizer=keras.optimizers.SGD(0.1), loss_fn=cross_entropy,
                     policy=policy)
    for _ in range(2):
        step(batch())

    unchanged = [key for key, value in before.items()
                 if np.array_equal(getattr(model.get_layer(key[0]), key[1]).numpy(), value)]
    assert unchanged == []
    assert {layer.name: layer.quantization_mode for layer in layers} == dict.fromkeys(
        ("dense", "einsum", "kept", "logits"), "float8")


def test_a_float8_sublayer_kept_in_float32_hands_back_the_compute_dtype():
    policy = Policy.from_string("mixed_bfloat16")
    with mixloop.engine.layer_precision.building_under(policy):
        model = residual_model()
    dense = model.get_layer("block").dense
    dense.quantize("float8")
    keep_float32_layers(model, policy, "block/dense")

    assert dense.dtype_policy.name == "float8_from_float32"
    # Without the hand-back, `x + dense(x)` adds float32 to bfloat16 and raises.
    assert model(tf.ones((BATCH_SIZE, WIDTH), tf.bfloat16)).dtype == tf.float32


@pytest.mark.parametrize("policy_name, expected", [
    ("mixed_bfloat16", {"dense": "float8_from_mixed_bfloat16", "einsum": "float8_from_mixed_bfloat16",
                        "kept": "float32", "logits": "float32"}),
    # Under float32 nothing is placed: `kept` trains in float8 too, `logits` is still the output.
    ("float32", {"dense": "float8_from_float32", "einsum": "float8_from_float32",
                 "kept": "float8_from_float32", "logits": "float32"}),
])
def test_auto_takes_every_dense_and_einsum_dense_but_the_outputs_and_the_float32_placement(
        policy_name, expected):
    model, _ = placed(mlp(), policy_name, float8="auto")
    assert policies(model) == expected


def test_auto_leaves_out_an_output_layer_of_any_name():
    def build():
        inputs = keras.Input((WIDTH,))
        hidden = keras.layers.Dense(WIDTH, name="hidden")(inputs)
        return keras.Model(inputs, [keras.layers.Dense(2, name="head_a")(hidden),
                                    keras.layers.Dense(2, name="head_b")(hidden)])

    policy = Policy.from_string("mixed_bfloat16")
    model = mixloop.build_model(build, policy)
    assert float8_layers.quantize_selected(model, policy, "auto") == ["hidden"]
    assert policies(model) == {"hidden": "float8_from_mixed_bfloat16", "head_a": "mixed_bfloat16",
                               "head_b": "mixed_bfloat16"}


def test_a_regex_quantizes_what_it_names_and_returns_its_paths():
    policy = Policy.from_string("mixed_bfloat16")
    model = mixloop.build_model(mlp(), policy, float32_layers="kept")
    assert float8_layers.quantize_selected(model, policy, "dense|kept") == ["dense", "kept"]
    assert policies(model) == {"dense": "float8_from_mixed_bfloat16", "einsum": "mixed_bfloat16",
                               "kept": "float8_from_float32", "logits": "float32"}


def test_a_regex_leaves_a_layer_float8_already_as_it_is():
    policy = Policy.from_string("mixed_bfloat16")
    model = mixloop.build_model(mlp(quantize=True), policy, float32_layers="kept")
    assert float8_layers.quantize_selected(model, policy, "dense|einsum") == []


@pytest.mark.parametrize("pattern, message", [
    ("dense_typo", "config.precision.float8_layers='dense_typo' fully matches no layer path; paths "
                   "look like: dense, "),
    ("dense|softmax", "config.precision.float8_layers='dense|softmax' matches softmax, a Softmax; "
                      "Keras trains only Dense and EinsumDense layers in float8, here: dense, einsum, "
                      "kept, logits"),
])
def test_a_regex_naming_no_layer_or_one_keras_cannot_train_in_float8_is_one_line(pattern, message):
    policy = Policy.from_string("mixed_bfloat16")
    model = mixloop.build_model(mlp(), policy)
    with pytest.raises(ConfigError) as raised:
        float8_layers.quantize_selected(model, policy, pattern)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
    assert set(policies(model).values()) <= {"mixed_bfloat16", "float32"}  # Nothing quantized.


def test_the_log_line_names_the_float8_layers_by_policy():
    model, _ = placed(mlp(), "mixed_bfloat16", float8="dense|einsum|kept")
    assert float8_layers.describe(model, "dense|einsum|kept") == (
        "Layers training in FP8 (Keras's float8 QDQ): 2 as float8_from_mixed_bfloat16 (dense, einsum); "
        "1 as float8_from_float32 (kept)")


def test_no_log_line_without_float8_and_one_when_auto_finds_none():
    model, _ = placed(mlp(), "mixed_bfloat16")
    assert float8_layers.describe(model, "") is None
    assert float8_layers.describe(model, "auto") == (
        "No layer trains in FP8: config.precision.float8_layers='auto' selected none (only Dense and "
        "EinsumDense layers outside the output layers and the float32 placement)")


@pytest.mark.slow
def test_auto_trains_in_float8_through_the_cli_and_exports_a_loadable_model(tmp_path):
    result = run("mixloop.train", f"--config={FLOAT8_CONFIG}:quick", f"--workdir={tmp_path}",
                 "--config.precision.policy=mixed_bfloat16", "--config.model.quantize=False",
                 "--config.precision.float8_layers=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split("] ", 1)[1] for line in result.stderr.splitlines()
             if "Layers computing in float32" in line or "Layers training in FP8" in line]
    assert lines == [
        "Layers computing in float32, the rest in bfloat16: 1 by named logits (logits)",
        "Layers training in FP8 (Keras's float8 QDQ): 2 as float8_from_mixed_bfloat16 (dense0, dense1)"]
    exported = keras.models.load_model(tmp_path / "model.keras")  # Plain: FP8 is how it trained.
    assert policies(exported) == {"dense0": "float32", "dense1": "float32", "logits": "float32"}
    reader = tf.train.load_checkpoint(str(tmp_path / "checkpoints"))
    trained = sorted(reader.get_tensor(name).tobytes() for name in reader.get_variable_to_shape_map()
                     if name.startswith("model_variables/"))
    assert all(w.tobytes() in trained for w in exported.get_weights())  # The trained weights.


@pytest.mark.slow
@pytest.mark.parametrize("value, message", [
    ("(", "config.precision.float8_layers='(' is not allowed: '' (none), 'auto', or a Python regular "
          "expression over Dense/EinsumDense layer paths"),
    ("flatten", "config.precision.float8_layers='flatten' matches flatten, a Flatten; Keras trains "
                "only Dense and EinsumDense layers in float8, here: dense0, dense1, logits"),
])
def test_a_bad_float8_layers_is_one_error_line_through_the_cli(tmp_path, value, message):
    result = run("mixloop.train", f"--config={FLOAT8_CONFIG}:quick", f"--workdir={tmp_path / 'run'}",
                 "--config.model.quantize=False", f"--config.precision.float8_layers={value}")
    assert result.returncode == 2
    assert error_lines(result) == [f"error: {message}"], result.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_charlm_in_float8_exports_a_model_that_loads(tmp_path):
    """Keras cannot reload a float8 MultiHeadAttention (it rebuilds the projections unquantized):
    the export holds the plain layers with the trained weights."""
    result = run("mixloop.train", "--config=experiments/charlm.py:quick", f"--workdir={tmp_path}",
                 "--config.precision.float8_layers=auto", "--config.jit_compile=False",
                 cwd=cli_runs.REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "block0_attention/query" in next(line for line in result.stderr.splitlines()
                                            if "Layers training in FP8" in line)
    sys.path.insert(0, cli_runs.REPO)
    importlib.import_module("experiments.charlm")  # As the export's loading line says.
    exported = keras.models.load_model(tmp_path / "model.keras")
    assert not any(layer.quantization_mode for layer in named_layers(exported).values())


def test_the_probes_pin_line_keeps_the_float8_layers_auto_chose():
    """A layer the probe moves to float32 keeps float8 over float32; a run started with the pinned
    float32_layers would place it first, and auto would leave it out: the pin names auto's choice."""
    from types import SimpleNamespace

    from mixloop.config import base_config
    from mixloop.runner import auto_precision

    config = base_config()
    trainer = SimpleNamespace(config=config, float8_paths=["block0/query", "block0/mlp.in"])
    assert auto_precision._pin(trainer, "hot") == "--config.precision.float32_layers='hot'"
    config.precision.float8_layers = "auto"
    assert auto_precision._pin(trainer, "hot") == (
        "--config.precision.float32_layers='hot' "
        "--config.precision.float8_layers='block0/query|block0/mlp\\.in'")
