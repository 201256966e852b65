"""mixloop's kernels (engine/kernels.py) apply to what mixloop traces and to nothing else: importing
mixloop leaves a user's own TensorFlow and Keras computation bit-identical."""

import os
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

from mixloop.engine import gelu, kernels, matmul_gradient, tracing
from mixloop.engine.keras_adapter import replace_backend_gelu

# A user's own float32 and bfloat16 computation: a broadcast matrix product's gradient, Keras's
# GELU and its gradient, and model.fit of an EinsumDense + GELU model. Prints a digest of every
# result; with MIXLOOP_IMPORT=1 mixloop is imported first.
_USER_PROGRAM = """
import hashlib, os
if os.environ.get("MIXLOOP_IMPORT") == "1":
    import mixloop  # noqa: F401
import keras
import numpy as np
import tensorflow as tf

keras.utils.set_random_seed(3)
rng = np.random.default_rng(3)
results = []
x = tf.constant(rng.normal(size=(6, 5, 16)), tf.float32)
w = tf.Variable(rng.normal(size=(16, 8)).astype(np.float32))
with tf.GradientTape() as tape:
    total = tf.reduce_sum(tf.square(tf.linalg.matmul(x, w)))
results.append(tape.gradient(total, w))
for dtype in (tf.float32, tf.bfloat16):
    z = tf.constant(rng.normal(size=(4, 64)) * 4, dtype)
    with tf.GradientTape() as tape:
        tape.watch(z)
        g = keras.activations.gelu(z, approximate=True)
        total = tf.reduce_sum(g)
    results += [g, tape.gradient(total, z), keras.ops.gelu(z, approximate=False)]
for policy in ("float32", "mixed_bfloat16"):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(4)
    inputs = keras.Input((5, 16))
    hidden = keras.layers.EinsumDense("abc,cd->abd", (5, 32), activation="gelu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
    model.fit(rng.normal(size=(64, 5, 16)).astype(np.float32),
              rng.normal(size=(64, 5, 1)).astype(np.float32), batch_size=16, epochs=2, verbose=0)
    results += model.get_weights()
digest = hashlib.sha256()
for value in results:
    digest.update(np.asarray(tf.cast(value, tf.float32)).tobytes())
print(digest.hexdigest())
"""


def _digest(import_mixloop: bool) -> str:
    env = dict(os.environ, MIXLOOP_IMPORT="1" if import_mixloop else "0", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", _USER_PROGRAM], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_importing_mixloop_leaves_a_users_computation_bit_identical():
    assert _digest(import_mixloop=True) == _digest(import_mixloop=False)


def test_the_kernels_are_mixloops_only_inside_its_traces_and_nested_blocks_share_them():
    tensorflows = matmul_gradient._TENSORFLOWS
    from tensorflow.python.framework import ops
    registry = ops._gradient_registry._registry["BatchMatMulV2"]
    kerass = replace_backend_gelu(gelu.gelu)  # What Keras's backend had; put back at once.
    replace_backend_gelu(kerass)
    assert registry["type"] is tensorflows and not kernels.are_installed()
    with kernels.installed():
        with kernels.installed():
            assert registry["type"] is matmul_gradient.batch_times_matrix_gradient
        assert kernels.are_installed() and registry["type"] is matmul_gradient.batch_times_matrix_gradient
        assert replace_backend_gelu(gelu.gelu) is gelu.gelu
    assert registry["type"] is tensorflows and not kernels.are_installed()
    assert replace_backend_gelu(kerass) is kerass


def test_a_mixloop_trace_takes_mixloops_gelu_and_a_plain_one_keras_own():
    z = tf.constant(np.linspace(-6.0, 2.0, 4001), tf.bfloat16)

    def gelu_and_slope(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            g = keras.activations.gelu(z, approximate=True)
        return g, tape.gradient(tf.reduce_sum(g), z)

    ours = tracing.function(gelu_and_slope)(z)
    plain = tf.function(gelu_and_slope, autograph=False)(z)
    # Keras's GELU computed op by op in bfloat16 is 0 below about -3 (its tanh rounds to -1):
    # mixloop's, computed in float32 and rounded once, is not.
    below = z.numpy().astype(np.float32) < -4.0
    assert np.all(plain[0].numpy()[below] == 0) and np.all(ours[0].numpy()[below] != 0)
