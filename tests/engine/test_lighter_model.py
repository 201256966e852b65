"""The model's side of a lighter run: `train.recompute` (activations recomputed, with the forward's
noise and statistics) and `precision.master_weights="bfloat16"` (which weights move to bfloat16)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mixloop.config import ConfigError
from mixloop.engine import lighter_model
from mixloop.engine.layer_precision import building_under, keep_float32_layers
from mixloop.engine.policy import Policy

WIDTH = 8


def block_model(dropout=0.5):
    """Inputs -> block (Dense, BatchNorm, Dropout, Dense) -> logits, the same weights every build."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((WIDTH,))
    block = keras.Sequential([keras.layers.Dense(16, activation="gelu"),
                              keras.layers.BatchNormalization(),
                              keras.layers.Dropout(dropout),
                              keras.layers.Dense(WIDTH)], name="block")
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(block(inputs)))


def gradients_and_state(model, jit_compile):
    """The loss, its gradients and the model's non-trainable state after one training forward."""
    inputs = tf.random.stateless_normal([6, WIDTH], seed=[3, 4])

    @tf.function(jit_compile=jit_compile)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(inputs, training=True) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    loss, grads = step()
    return loss.numpy(), [g.numpy() for g in grads], [v.numpy() for v in model.non_trainable_variables]


@pytest.mark.parametrize("jit_compile", [False, True])
def test_recomputed_block_gives_the_same_gradients_noise_and_statistics(jit_compile):
    kept = gradients_and_state(block_model(), jit_compile)
    model = block_model()
    assert lighter_model.recompute(model, "block") == ["block"]
    recomputed = gradients_and_state(model, jit_compile)
    np.testing.assert_allclose(recomputed[0], kept[0], rtol=1e-6)
    for a, b in zip(kept[1], recomputed[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # Another fusion order.
    # The dropout seed and BatchNorm's statistics moved once, as without recomputation.
    for a, b in zip(kept[2], recomputed[2]):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(g != 0) for g in recomputed[1])


def test_recompute_regex_naming_no_layer_is_one_line():
    with pytest.raises(ConfigError, match=r"config.train.recompute='blocks' fully matches no layer"):
        lighter_model.recompute(block_model(), "blocks")


def test_bfloat16_master_weights_a_float32_layer_reads_cast_up():
    policy = Policy.from_string("mixed_bfloat16")
    with building_under(policy):
        model = block_model(dropout=0.0)
    keep_float32_layers(model, policy, "logits")
    inputs = np.random.default_rng(0).normal(size=(2, WIDTH)).astype(np.float32)
    total = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]
    assert lighter_model.store_weights_in_bfloat16(model) == total
    for variable, value in zip(model.trainable_variables, before):
        assert variable.dtype == "bfloat16", variable.path
        np.testing.assert_array_equal(variable.numpy().astype(np.float32),
                                      value.astype("bfloat16").astype(np.float32))
    # BatchNorm's moving statistics are not trained: they stay float32.
    assert {v.dtype for v in model.non_trainable_variables if "moving" in v.path} == {"float32"}
    # The logits layer still computes in float32, from its weights cast up: exactly the float32
    # product of its input with the bfloat16-stored kernel.
    logits = model.get_layer("logits")
    hidden = model.get_layer("block")(inputs)
    expected = (tf.cast(hidden, tf.float32) @ tf.cast(logits.kernel.value, tf.float32)
                + tf.cast(logits.bias.value, tf.float32))
    outputs = model(inputs)
    assert outputs.dtype == tf.float32
    np.testing.assert_allclose(outputs, expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_weights_checkpoint_and_restore():
    policy = Policy.from_string("mixed_bfloat16")
    with building_under(policy):
        model = block_model(dropout=0.0)
    lighter_model.store_weights_in_bfloat16(model)
    saved = [v.numpy() for v in model.variables]
    checkpoint = tf.train.Checkpoint(variables=list(model.variables))
    path = checkpoint.save(str(pytest.importorskip("tempfile").mkdtemp()) + "/ckpt")
    for variable in model.trainable_variables:
        variable.assign(tf.zeros(variable.shape, variable.dtype))
    checkpoint.restore(path).assert_consumed()
    for variable, value in zip(model.variables, saved):
        np.testing.assert_array_equal(variable.numpy(), value)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_recomputed_layers_with_weights_train_in_16_bits_as_kept_ones(kind, activation, policy,
                                                                       jit_compile):
    """A recomputed Dense or EinsumDense over float32 master weights: the backward pass recomputes
    it in its compute dtype, as the forward ran it (its weights read as 16-bit copies), so three
    updates end bit-identical to the same updates without recomputation."""
    import mixloop

    def build():
        inputs = keras.Input((4, WIDTH))
        if kind == "dense":
            x = keras.layers.Dense(16, activation=activation, name="block")(inputs)
        else:
            x = keras.layers.EinsumDense("abc,cd->abd", (4, 16), activation=activation,
                                         name="block")(inputs)
        return keras.Model(inputs, keras.layers.Dense(1, name="logits")(x))

    data = (tf.random.stateless_normal([8, 4, WIDTH], seed=[1, 2]),
            tf.random.stateless_normal([8, 4, 1], seed=[3, 4]))
    weights = {}
    for recompute in (False, True):
        keras.utils.set_random_seed(5)
        run_policy = Policy.from_string(policy)
        model = mixloop.build_model(build, run_policy)
        if recompute:
            assert lighter_model.recompute(model, "block") == ["block"]
        step = mixloop.TrainStep(
            model=model, optimizer=keras.optimizers.SGD(0.1), policy=run_policy,
            loss_fn=lambda outputs, batch: tf.reduce_mean(tf.square(outputs - batch[1])),
            loss_scale=mixloop.DynamicLossScale() if policy == "mixed_float16" else None,
            jit_compile=jit_compile)
        for _ in range(3):
            report = step(data)["objectives"]["model"]
            assert bool(report["applied"])
        weights[recompute] = [v.numpy() for v in model.trainable_variables]
    for kept, recomputed in zip(weights[False], weights[True]):
        np.testing.assert_array_equal(kept, recomputed)
