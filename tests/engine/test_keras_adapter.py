"""Pins every Keras private name mixloop reads (mixloop/keras_adapter.py): each test fails loudly,
naming the name, when a Keras release changes it."""

import threading

import keras
import tensorflow as tf
from keras.src.random import seed_generator

from mixloop.engine import gelu, keras_adapter
from mixloop.engine.layer_precision import building_under
from mixloop.engine.policy import Policy
from mixloop.runner import distribution


def test_sublayers_lists_direct_children_such_as_attentions_softmax():
    attention = keras.layers.MultiHeadAttention(2, 4, dropout=0.1)
    attention(tf.ones((1, 3, 8)), tf.ones((1, 3, 8)))
    sublayers = keras_adapter.sublayers(attention)
    assert any(isinstance(layer, keras.layers.Softmax) for layer in sublayers)
    assert not any(layer is attention for layer in sublayers)


def test_output_layers_of_a_functional_model_and_of_a_plain_layer():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="hidden")(inputs)
    model = keras.Model(inputs, {"logits": keras.layers.Dense(2, name="logits")(hidden),
                                 "hidden": hidden})
    assert sorted(layer.name for layer in keras_adapter.output_layers(model)) == ["hidden", "logits"]
    assert keras_adapter.output_layers(keras.layers.Dense(2)) == []


def test_fresh_name_counters_number_unnamed_layers_afresh():
    keras.layers.Softmax()  # some earlier softmax in the process
    names = []
    for _ in range(2):
        with building_under(Policy.from_string("float32")):
            names.append(keras.layers.Softmax().name)
    assert names == ["softmax", "softmax"]


def test_leave_gradients_summed_stops_keras_summing_over_replicas_again():
    """Two replicas each apply the gradient 1.0 (already all-reduced) with SGD(1.0) to a variable at 0:
    Keras alone sums them again (-2.0); after the adapter each replica applies its own (-1.0)."""
    strategy = distribution.make_strategy("mirrored")
    results = {}
    for summed in (False, True):
        with strategy.scope():
            variable = tf.Variable(0.0)
            optimizer = keras.optimizers.SGD(1.0)
            optimizer.build([variable])
            if summed:
                keras_adapter.leave_gradients_summed(optimizer)

        @tf.function
        def apply():
            strategy.run(lambda: optimizer.apply([tf.constant(1.0)], [variable]))

        apply()
        results[summed] = float(variable.numpy())
    assert results == {False: -2.0, True: -1.0}


def test_store_as_recreates_a_layers_variable_in_bfloat16_in_place():
    dense = keras.layers.Dense(3, dtype="mixed_bfloat16")
    dense.build((None, 4))
    kernel = dense.kernel
    value = kernel.numpy()
    keras_adapter.store_as(kernel, "bfloat16")
    assert dense.kernel is kernel and kernel.dtype == "bfloat16"
    assert kernel.value.dtype == tf.bfloat16  # The storage itself, not a cast on read.
    assert (kernel.numpy().astype("float32") == value.astype("bfloat16").astype("float32")).all()
    assert dense(tf.ones((2, 4))).dtype == tf.bfloat16


def test_own_trainable_variables_leave_out_sublayers_and_frozen_ones():
    attention = keras.layers.MultiHeadAttention(2, 4)
    attention(tf.ones((1, 3, 8)), tf.ones((1, 3, 8)))
    assert keras_adapter.own_trainable_variables(attention) == []
    norm = keras.layers.BatchNormalization()
    norm.build((None, 4))
    assert [v.path for v in keras_adapter.own_trainable_variables(norm)] == [
        norm.gamma.path, norm.beta.path]


def test_compact_optimizers_override_kerass_weight_decay_and_variable_index():
    """engine/compact_optimizer.py replaces `_apply_weight_decay` and calls `_use_weight_decay` and
    `_get_variable_index`, which Keras's optimizers define and call."""
    from mixloop.engine import compact_optimizer
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    variable = keras.Variable(tf.ones((2,)))
    optimizer.build([variable])
    assert optimizer._use_weight_decay(variable) and optimizer._get_variable_index(variable) == 0
    assert callable(keras.optimizers.Optimizer._apply_weight_decay)
    compact = compact_optimizer.CompactAdamW(learning_rate=0.5, weight_decay=0.1)
    compact.build([variable])
    compact.apply([tf.zeros((2,))], [variable])
    # Decay once (1 - 0.5 * 0.1 = 0.95), not twice: Keras's own decay is replaced, not added to.
    assert abs(float(variable.numpy()[0]) - 0.95) < 1e-6


def test_compact_optimizers_chain_their_updates_through_kerass_backend_update_step():
    """engine/compact_optimizer.py wraps `_backend_update_step`, which Keras's `apply` calls with
    every variable: traced, the second variable's reads wait for what the first one stored."""
    from mixloop.engine import compact_optimizer
    assert callable(keras.optimizers.Optimizer._backend_update_step)
    variables = [keras.Variable(tf.ones((4096,)), name=f"v{i}") for i in range(2)]
    compact = compact_optimizer.CompactAdamW(learning_rate=0.5, state_dtype="int8")
    compact.build(variables)
    apply = tf.function(lambda grads: compact.apply(grads, variables))
    graph = apply.get_concrete_function([tf.TensorSpec((4096,))] * 2).graph
    waiting = [op for op in graph.get_operations() if op.type == "ReadVariableOp" and op.control_inputs
               and any(c.type != "NoOp" for c in op.control_inputs)]
    assert waiting, "no variable's update waits for the previous one's"


def test_another_thread_adopting_the_state_sees_the_same_global_policy_and_seed_generator():
    """Keras keeps its global state per thread: the compile-mode probe's thread must trace with
    the run's (an unseeded random op's generator, a global dtype policy)."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        generator = seed_generator.global_seed_generator()
        state, seen = keras_adapter.thread_state(), {}

        def in_thread(adopt):
            if adopt:
                keras_adapter.adopt_thread_state(state)
            seen[adopt] = (keras.config.dtype_policy().name, seed_generator.global_seed_generator())

        for adopt in (False, True):
            thread = threading.Thread(target=in_thread, args=(adopt,))
            thread.start()
            thread.join()
        assert seen[True] == ("mixed_bfloat16", generator)
        assert seen[False][0] == "float32" and seen[False][1] is not generator  # Keras's own.
    finally:
        keras.config.set_dtype_policy("float32")


def test_replace_backend_gelu_is_what_every_keras_gelu_computes():
    calls = []

    def recording_gelu(x, approximate=True):
        calls.append(approximate)
        return tf.nn.gelu(x, approximate=approximate)

    x = tf.ones((2, 3))
    previous = keras_adapter.replace_backend_gelu(recording_gelu)
    try:
        keras.ops.gelu(x)
        keras.activations.gelu(x)
        keras.layers.Dense(3, activation="gelu")(x)
    finally:
        assert keras_adapter.replace_backend_gelu(previous) is recording_gelu
    assert previous is not gelu.gelu  # Keras's own: mixloop's is in place only while it traces.
    assert calls == [True, False, False]
