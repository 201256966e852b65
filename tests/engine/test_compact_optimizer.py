"""The optimizers that store state and weights in fewer bits (engine/compact_optimizer.py): Keras's
Adam(W)/SGD numbers reproduced, low-bit state tracking float32 Adam, tiny updates kept by bfloat16
weights, checkpoints restored bit-identically, and build_optimizer's choice."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.config import base_config
from mixloop.engine.compact_optimizer import CompactAdam, CompactAdamW, CompactSGD, quantizes_moments

JIT = pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
BF16_ULP_AT_1 = 2.0**-7  # The gap between 1 and the next bfloat16.


def gradient_sequence(shapes, num_steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[tf.constant(rng.normal(size=shape).astype(np.float32)) for shape in shapes]
            for _ in range(num_steps)]


def run(optimizer, variables, gradients):
    """Applies each step's gradients to `variables` (the optimizer built first, as the train step does)."""
    optimizer.build(variables)
    for step_gradients in gradients:
        optimizer.apply(step_gradients, variables)


def weight_and_bias(dtype="float32", shape=(6, 5)):
    rng = np.random.default_rng(2)
    return [keras.Variable(rng.normal(size=shape), dtype=dtype, name="kernel"),
            keras.Variable(rng.normal(size=shape[-1:]), dtype=dtype, name="bias")]


def schedule():
    return keras.optimizers.schedules.CosineDecay(0.0, decay_steps=15, warmup_target=0.05, warmup_steps=5)


@pytest.mark.parametrize("compact, keras_optimizer", [
    (lambda: CompactAdam(schedule(), weight_decay=0.1),
     lambda: keras.optimizers.Adam(schedule(), weight_decay=0.1)),
    (lambda: CompactAdamW(schedule(), weight_decay=0.1, beta_2=0.99),
     lambda: keras.optimizers.AdamW(schedule(), weight_decay=0.1, beta_2=0.99)),
    (lambda: CompactSGD(schedule(), weight_decay=0.1),
     lambda: keras.optimizers.SGD(schedule(), weight_decay=0.1)),
    (lambda: CompactSGD(schedule(), momentum=0.9, nesterov=True, weight_decay=0.1),
     lambda: keras.optimizers.SGD(schedule(), momentum=0.9, nesterov=True, weight_decay=0.1)),
], ids=["adam", "adamw", "sgd", "nesterov"])
def test_float32_state_and_weights_reproduce_keras(compact, keras_optimizer):
    """20 steps over a warm-up and cosine schedule, with weight decay (the bias excluded from it)."""
    gradients = gradient_sequence([(6, 5), (5,)], 20)
    results = []
    for optimizer in (compact(), keras_optimizer()):
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        variables = weight_and_bias()
        run(optimizer, variables, gradients)
        results.append(([v.numpy() for v in variables], [v.numpy() for v in optimizer.variables]))
    (weights, state), (expected_weights, expected_state) = results
    for value, expected in zip(weights + state, expected_weights + expected_state):
        np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7)
    assert not np.allclose(weights[0], weight_and_bias()[0].numpy(), atol=1e-2)  # It did train.


def least_squares_loss(optimizer, num_steps=150):
    """The final mean squared error of a 64 x 128 linear map (8192 weights: quantized under int8)
    and its float32-moment bias, fitted by `optimizer` in one compiled loop to noisy targets."""
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(256, 64)).astype(np.float32))
    noise = 0.3 * rng.normal(size=(256, 128)).astype(np.float32)
    y = x @ rng.normal(size=(64, 128)).astype(np.float32) + noise
    variables = [keras.Variable(np.zeros((64, 128)), dtype="float32", name="kernel"),
                 keras.Variable(np.zeros(128), dtype="float32", name="bias")]
    loss_fn = lambda: tf.reduce_mean(tf.square(x @ variables[0] + variables[1] - y))  # noqa: E731
    optimizer.build(variables)

    @tf.function(jit_compile=True)
    def train():
        for _ in tf.range(num_steps):
            with tf.GradientTape() as tape:
                loss = loss_fn()
            optimizer.apply(tape.gradient(loss, variables), variables)
        return loss_fn()

    return float(train())


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_low_bit_moments_track_float32_adam(state_dtype):
    expected = least_squares_loss(keras.optimizers.Adam(0.05))
    optimizer = CompactAdam(0.05, state_dtype=state_dtype)
    loss = least_squares_loss(optimizer)
    # From 64 at the start to near the floor, 0.067: the noise 65 parameters an output cannot fit.
    assert expected < 0.07
    assert loss == pytest.approx(expected, rel=0.01)
    stored = {v.name: v.dtype for v in optimizer.variables}
    if state_dtype == "int8":
        assert stored["kernel_momentum_codes"] == "uint8" and stored["kernel_velocity_scales"] == "float32"
        assert stored["bias_momentum"] == "float32"  # 128 values: too few to quantize.
    else:
        assert stored["kernel_momentum"] == "bfloat16" and stored["bias_velocity"] == "bfloat16"


@pytest.mark.parametrize("compact, keras_optimizer, gradient, expected", [
    # A weight of 1 moved by +1e-4 a step (SGD, lr 1): 100 steps add 0.01, a bfloat16 step near 1
    # being 0.0078 (round to nearest drops each 1e-4).
    (lambda: CompactSGD(1.0), lambda: keras.optimizers.SGD(1.0), -1e-4, 1.0 + 100 * 1e-4),
    # No gradient, decay 1e-4 a step (AdamW, lr 1e-3, weight_decay 0.1): the decay alone.
    (lambda: CompactAdamW(1e-3, weight_decay=0.1), lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.1),
     0.0, (1 - 1e-4) ** 100),
], ids=["sgd-update", "adamw-decay"])
def test_bfloat16_weights_keep_updates_round_to_nearest_loses(compact, keras_optimizer, gradient, expected):
    gradients = [[tf.fill([2000], gradient)]] * 100
    weights = keras.Variable(np.ones(2000), dtype="bfloat16", name="w")
    run(compact(), [weights], gradients)
    assert weights.dtype == "bfloat16"
    assert np.mean(weights.numpy().astype(np.float64)) == pytest.approx(expected, abs=2e-4)
    nearest = keras.Variable(np.ones(2000), dtype="bfloat16", name="w")
    run(keras_optimizer(), [nearest], gradients)
    np.testing.assert_array_equal(nearest.numpy().astype(np.float32), 1.0)


def compact_run(state_dtype):
    """A bfloat16 kernel of 8192 values, a float32 bias, CompactAdamW storing `state_dtype` moments."""
    variables = weight_and_bias(shape=(64, 128))
    variables[0] = keras.Variable(variables[0].numpy(), dtype="bfloat16", name="kernel")
    optimizer = CompactAdamW(1e-2, weight_decay=0.05, state_dtype=state_dtype)
    optimizer.build(variables)
    return variables, optimizer


def state_of(variables, optimizer):
    return [v.numpy() for v in variables + optimizer.variables]


def assert_bit_identical(values, expected):
    assert len(values) == len(expected)
    for value, reference in zip(map(np.atleast_1d, values), map(np.atleast_1d, expected)):
        np.testing.assert_array_equal(value.view(np.uint8), reference.view(np.uint8))


@JIT
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_a_restored_run_continues_bit_identically(state_dtype, jit_compile, tmp_path):
    gradients = gradient_sequence([(64, 128), (128,)], 10)
    variables, optimizer = compact_run(state_dtype)
    apply = tf.function(lambda g: optimizer.apply(g, variables), jit_compile=jit_compile)
    for step_gradients in gradients[:5]:
        apply(step_gradients)
    path = tf.train.Checkpoint(optimizer=optimizer, variables=variables).write(str(tmp_path / "ckpt"))
    saved = state_of(variables, optimizer)
    for step_gradients in gradients[5:]:
        apply(step_gradients)
    uninterrupted = state_of(variables, optimizer)

    variables, optimizer = compact_run(state_dtype)
    tf.train.Checkpoint(optimizer=optimizer, variables=variables).read(path).assert_consumed()
    assert_bit_identical(state_of(variables, optimizer), saved)
    apply = tf.function(lambda g: optimizer.apply(g, variables), jit_compile=jit_compile)
    for step_gradients in gradients[5:]:
        apply(step_gradients)
    assert_bit_identical(state_of(variables, optimizer), uninterrupted)
    assert int(optimizer.iterations) == 10


def test_a_variable_overwritten_with_its_gradient_is_left_to_keras():
    """float8 scales: assigned their gradient, with no state, while the others are updated."""
    scale = keras.Variable(1.0, name="scale")
    scale.overwrite_with_gradient = True
    weights = keras.Variable(np.ones(5000), name="w")
    optimizer = CompactAdamW(0.1, state_dtype="int8")
    run(optimizer, [weights, scale], [[tf.ones(5000), tf.constant(3.0)]])
    assert float(scale.numpy()) == 3.0 and np.all(weights.numpy() < 1.0)
    assert not any(v.name.startswith("scale") for v in optimizer.variables)


def test_int8_keeps_float32_moments_for_embedding_tables():
    """Keras's tables (a plain Embedding, keras-hub's tied ReversibleEmbedding and its
    PositionEmbedding) keep float32 moments, as Hugging Face's Trainer keeps them in 32 bits under
    bitsandbytes; a Dense kernel of the same size is quantized."""
    pytest.importorskip("keras_hub")
    from keras_hub.layers import PositionEmbedding, ReversibleEmbedding

    tokens = keras.ops.zeros([2, 64], "int32")
    plain, tied = keras.layers.Embedding(256, 64), ReversibleEmbedding(256, 64)
    position = PositionEmbedding(sequence_length=256)
    position(tied(tokens))
    plain(tokens)
    dense = keras.layers.Dense(64)
    dense.build((None, 256))
    tables = [plain.embeddings, tied.embeddings, position.position_embeddings]
    variables = tables + [dense.kernel]
    assert {math.prod(v.shape) for v in variables} == {256 * 64}  # Each above MIN_QUANTIZED_SIZE.

    optimizer = CompactAdam(1e-3, state_dtype="int8")
    optimizer.build(variables)
    stored = {v.name: v.dtype for v in optimizer.variables}
    for table in tables:
        assert not quantizes_moments(table)
        path = table.path.replace("/", "_")
        assert stored[f"{path}_momentum"] == stored[f"{path}_velocity"] == "float32", stored
    assert quantizes_moments(dense.kernel)
    assert stored[f"{dense.kernel.path.replace('/', '_')}_momentum_codes"] == "uint8", stored


def built_optimizer(**fields):
    config = base_config()
    for key, value in fields.items():
        section, name = key.split("__")
        config[section][name] = value
    return mixloop.build_optimizer(config)


@pytest.mark.parametrize("name, cls", [("sgd", keras.optimizers.SGD), ("momentum", keras.optimizers.SGD),
                                       ("adam", keras.optimizers.Adam), ("adamw", keras.optimizers.AdamW)])
def test_build_optimizer_keeps_keras_for_float32_and_goes_compact_otherwise(name, cls):
    assert type(built_optimizer(optimizer__name=name)) is cls
    compact = {"sgd": CompactSGD, "momentum": CompactSGD, "adam": CompactAdam, "adamw": CompactAdamW}[name]
    bfloat16_weights = built_optimizer(optimizer__name=name, precision__master_weights="bfloat16")
    assert type(bfloat16_weights) is compact and isinstance(bfloat16_weights, cls)
    if name == "momentum":
        assert bfloat16_weights.momentum == pytest.approx(0.9)
    if name.startswith("adam"):
        assert bfloat16_weights.state_dtype == "float32"
        int8 = built_optimizer(optimizer__name=name, optimizer__state_dtype="int8", optimizer__beta_2=0.95)
        assert type(int8) is compact and int8.state_dtype == "int8" and int8.beta_2 == pytest.approx(0.95)
        assert compact.from_config(int8.get_config()).state_dtype == "int8"


def update_peak(optimizer, num_variables: int, size: int = 2**20) -> float:
    """The CPU allocator's peak above what was allocated before, in bytes, while a traced `apply`
    updates `num_variables` bfloat16 weights of `size` values (their float32 gradients given)."""
    variables = [keras.Variable(tf.random.normal([size], seed=i) * 0.01, dtype="bfloat16")
                 for i in range(num_variables)]
    optimizer.build(variables)
    grads = [tf.random.normal([size], seed=100 + i) for i in range(num_variables)]
    apply = tf.function(lambda grads: optimizer.apply(grads, variables))
    apply(grads)  # Traced and run once: what stays allocated after is the state.
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
    except ValueError:  # TensorFlow without oneDNN (its default on a CPU with AVX2 alone).
        pytest.skip("this TensorFlow's CPU allocator keeps no statistics (oneDNN off)")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    apply(grads)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def test_variables_are_updated_one_after_another_so_their_temporaries_never_add_up():
    """Eight variables' int8 AdamW update peaks at one variable's float32 temporaries (moments
    dequantized, the weight cast up, the rounding's noise: about 29 bytes a value) plus what every
    gradient takes before the updates start (under 8 bytes a value): each variable's temporaries are
    freed before the next variable's are made. Left to the graph, all eight were alive at once:
    4.7x one variable's peak, above this bound."""
    size, num_variables = 2**20, 8
    one = update_peak(CompactAdamW(1e-3, state_dtype="int8"), 1, size)
    if one == 0:
        pytest.skip("this TensorFlow's CPU allocator keeps no statistics (oneDNN off)")
    eight = update_peak(CompactAdamW(1e-3, state_dtype="int8"), num_variables, size)
    assert eight < one + num_variables * size * 8, (one, eight)


def test_replicas_update_their_copies_side_by_side_each_in_order():
    """Under MirroredStrategy each device's updates wait for that device's previous one only: no
    update waits for another replica's (which would make the replicas take turns)."""
    from mixloop.engine import keras_adapter
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        variables = [keras.Variable(tf.ones([4096]) * i, dtype="bfloat16") for i in range(3)]
        optimizer = CompactAdamW(1e-3, state_dtype="int8")
        optimizer.build(variables)
        keras_adapter.leave_gradients_summed(optimizer)

    @tf.function
    def apply():
        strategy.run(lambda: optimizer.apply([tf.ones([4096])] * 3, variables))

    graph = apply.get_concrete_function().graph
    waits = [(op.device, c.device) for op in graph.get_operations() if op.device
             for c in op.control_inputs if c.type != "NoOp" and c.device]
    assert waits and all(reader == writer for reader, writer in waits), waits
    apply()
    assert all(np.isfinite(v.numpy().astype(np.float32)).all() for v in variables)
