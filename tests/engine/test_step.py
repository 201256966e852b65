"""The train step, with real numbers: skipped updates leave every variable bit-identical, float32 master
weights keep updates float16 would lose, loss scaling rescues underflowing gradients, accumulation
equals the full batch, clipping acts on the true gradient, and XLA changes none of it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.engine.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale
from mixloop.engine.policy import Policy
from mixloop.engine.step import TrainStep
from helpers import (BATCH_SIZE, JIT, NUM_HIDDEN, NUM_INPUTS, assert_bit_identical, mse,
                     regression_batch, state_of, with_nan_rows)


def mlp(*, norm=False, batch_norm=False, dropout=0.0):
    """A model factory: a tanh Dense body (compute dtype), optional norm layers, float32 logits."""

    def build():
        inputs = keras.Input((NUM_INPUTS,))
        x = keras.layers.Dense(NUM_HIDDEN, activation="tanh", name="body")(inputs)
        if norm:
            x = keras.layers.LayerNormalization(name="norm")(x)
        if batch_norm:
            x = keras.layers.BatchNormalization(name="batch_norm")(x)
        if dropout:
            x = keras.layers.Dropout(dropout, name="dropout")(x)
        return keras.Model(inputs, keras.layers.Dense(1, name="logits")(x))

    return build


def make_step(policy="float32", *, build_fn=None, weights=None, optimizer=None, loss_fn=mse, **step_kwargs):
    policy = Policy.from_string(policy)
    model = mixloop.build_model(build_fn or mlp(norm=True), policy)
    if weights is not None:
        model.set_weights(weights)
    return TrainStep(model=model, optimizer=optimizer or keras.optimizers.SGD(1.0), loss_fn=loss_fn,
                     policy=policy, **step_kwargs)


def initial_weights(build_fn=None):
    return mixloop.build_model(build_fn or mlp(norm=True), Policy.from_string("float32")).get_weights()


def update_of(step, batch):
    """Runs one step; returns (the change of every trainable variable, the step's report)."""
    before = [v.numpy() for v in step.model.trainable_variables]
    metrics = step(batch)["objectives"]["model"]
    return [v.numpy() - b for v, b in zip(step.model.trainable_variables, before)], metrics


def full_batch_gradients(weights, batch, loss_fn=mse, build_fn=None):
    """The float32 reference: a plain tape over the whole batch, on a fresh model with `weights`."""
    model = mixloop.build_model(build_fn or mlp(norm=True), Policy.from_string("float32"))
    model.set_weights(weights)
    with tf.GradientTape() as tape:
        loss = loss_fn(model(batch[0], training=True), batch)
        if isinstance(loss, tuple):  # (sum, weight)
            loss = loss[0] / loss[1]
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)], float(loss)


def relative_gap(actual, expected):
    """max |actual - expected| over all entries, relative to max |expected|."""
    gap = max(np.max(np.abs(a - e)) for a, e in zip(actual, expected))
    return gap / max(np.max(np.abs(e)) for e in expected)


# 3, 11: a non-finite gradient skips the update and leaves all state untouched.

# Targets of 3000 keep the forward pass and the float32 loss (about 1e7) finite, but the gradient
# reaching the float16 body, about 2 * 3000 / 8 * |w| * 2**15 > 1e7, is far above float16's 65504.
OVERFLOW_TARGET_SCALE = 3000.0
SKIP_CASES = [("float32", "nan_inputs"), ("mixed_bfloat16", "nan_inputs"), ("mixed_float16", "nan_inputs"),
              ("mixed_float16", "float16_overflow")]


def bad_batch(cause):
    if cause == "nan_inputs":
        return with_nan_rows(regression_batch(seed=2), rows=[3])
    return regression_batch(seed=2, target_scale=OVERFLOW_TARGET_SCALE)


@pytest.mark.parametrize("policy, cause", SKIP_CASES, ids=["-".join(c) for c in SKIP_CASES])
@JIT
def test_non_finite_step_is_skipped_with_every_variable_bit_identical(policy, cause, jit_compile):
    step = make_step(policy, build_fn=mlp(batch_norm=True, dropout=0.25),
                     optimizer=keras.optimizers.Adam(1e-3), loss_scale=DynamicLossScale(initial_scale=2.0**15),
                     jit_compile=jit_compile)
    # A good step first, so Adam's moments, the BatchNorm statistics and the dropout seed all hold
    # values a skipped step could visibly disturb.
    assert bool(step(regression_batch(seed=1, target_scale=0.1))["objectives"]["model"]["applied"])
    before = state_of(step)
    assert int(before[step.objectives["model"].optimizer.iterations.path]) == 1

    metrics = step(bad_batch(cause))["objectives"]["model"]

    assert not bool(metrics["applied"]) and not bool(metrics["grads_finite"])
    assert_bit_identical(before, state_of(step))
    assert float(metrics["loss_scale"]) == 2.0**15
    assert float(step.objectives["model"].loss_scale.scale) == 2.0**14
    if cause == "float16_overflow":
        assert np.isfinite(float(metrics["loss"])) and float(metrics["loss"]) > 1e6


# An overflowed step taken again on the same batch (overflow_retries) instead of losing the batch.

def retrying_step(retries, initial_scale, jit_compile=False):
    keras.utils.set_random_seed(4)  # The same weights and dropout seeds in every step made here.
    return make_step("mixed_float16", build_fn=mlp(batch_norm=True, dropout=0.25),
                     optimizer=keras.optimizers.Adam(1e-3),
                     loss_scale=DynamicLossScale(initial_scale=initial_scale), jit_compile=jit_compile,
                     overflow_retries=retries)


@JIT
def test_an_overflowed_step_is_taken_again_at_the_backed_off_scale_as_if_it_had_started_there(jit_compile):
    step = retrying_step(20, 2.0**15, jit_compile)
    report = step(bad_batch("float16_overflow"))["objectives"]["model"]

    # The scale halved once per attempt, then the batch was applied at the scale that held.
    retries = int(report["retries"])
    assert retries >= 2 and bool(report["applied"]) and bool(report["grads_finite"])
    assert float(report["loss_scale"]) == 2.0**(15 - retries)
    assert int(step.global_step.numpy()) == 1  # One step, however many attempts.
    assert int(step.objectives["model"].optimizer.iterations.numpy()) == 1
    # Bit for bit the step a run started at that scale takes: every attempt before left no trace.
    reference = retrying_step(0, 2.0**(15 - retries), jit_compile)
    reference_report = reference(bad_batch("float16_overflow"))["objectives"]["model"]
    assert bool(reference_report["applied"]) and int(reference_report["retries"]) == 0
    for (path, expected), actual in zip(state_of(reference).items(), state_of(step).values()):
        np.testing.assert_array_equal(actual, expected, err_msg=path, strict=True)
    assert float(step.objectives["model"].loss_scale.scale) == float(reference.objectives["model"].loss_scale.scale)


def test_retries_end_after_overflow_retries_with_the_update_skipped():
    step = retrying_step(2, 2.0**15)
    before = state_of(step)
    report = step(bad_batch("float16_overflow"))["objectives"]["model"]

    # Tried at 2**15, 2**14 and 2**13; counted as without retries: one skip at 2**15, one back-off.
    assert int(report["retries"]) == 2 and not bool(report["applied"])
    assert float(report["loss_scale"]) == 2.0**15
    assert float(step.objectives["model"].loss_scale.scale) == 2.0**14
    assert_bit_identical(before, state_of(step))
    assert int(step.global_step.numpy()) == 1


@pytest.mark.parametrize("case", ["nan_inputs", "static_scale", "at_min_scale", "float32"])
def test_an_overflow_no_lower_scale_can_cure_is_not_retried(case):
    """Bad data, a scale that does not move, or one at its floor: a retry would fail the same way."""
    policy, loss_scale, batch = "mixed_float16", DynamicLossScale(), bad_batch("float16_overflow")
    if case == "nan_inputs":
        batch = bad_batch("nan_inputs")
    elif case == "static_scale":
        loss_scale = StaticLossScale(2.0**15)
    elif case == "at_min_scale":
        loss_scale = DynamicLossScale(initial_scale=2.0**15, min_scale=2.0**15)
    else:
        policy = "float32"
        batch = bad_batch("nan_inputs")
    step = make_step(policy, loss_scale=loss_scale, overflow_retries=3)
    report = step(batch)["objectives"]["model"]
    assert not bool(report["applied"]) and int(report["retries"]) == 0
    assert int(step.global_step.numpy()) == 1


@pytest.mark.parametrize("policy, loss_scale_fn", [("float32", DynamicLossScale),
                                                   ("mixed_float16", lambda: StaticLossScale(1.0))],
                         ids=["float32", "float16_unscaled"])
def test_overflow_batch_is_finite_without_float16_or_without_scaling(policy, loss_scale_fn):
    """The control for the overflow case above: the same batch is applied in float32, and in float16
    at scale 1, so it is the scaled float16 gradient that overflows there."""
    step = make_step(policy, build_fn=mlp(batch_norm=True, dropout=0.25), loss_scale=loss_scale_fn())
    assert bool(step(bad_batch("float16_overflow"))["objectives"]["model"]["applied"])


# 4: float32 master weights keep updates that float16 weights would round away.

def test_float32_master_weight_keeps_updates_below_float16_resolution():
    def build():
        inputs = keras.Input((1,))
        hidden = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="weight")(inputs)
        return keras.Model(inputs, keras.layers.Identity(name="output")(hidden))

    learning_rate, loss_factor, num_steps = 0.05, 2.0**-10, 30
    step = make_step("mixed_float16", build_fn=build, optimizer=keras.optimizers.SGD(learning_rate),
                     loss_fn=lambda outputs, batch: tf.reduce_sum(outputs) * loss_factor,
                     loss_scale=DynamicLossScale())
    assert step.model.get_layer("weight").compute_dtype == "float16"
    # Inputs on the float16 grid, so the float16 backward pass (x * 2**-10 * 2**15) is exact and the
    # unscaled gradient of the single weight is x * 2**-10: an update of 2.4e-5 to 7.3e-5 per step.
    inputs = np.random.default_rng(0).uniform(0.5, 1.5, num_steps).astype(np.float16).astype(np.float32)

    master32, weight16 = np.float32(1.0), np.float16(1.0)
    for x in inputs:
        assert bool(step((tf.constant([[x]]),))["objectives"]["model"]["applied"])
        update = np.float32(x) * np.float32(loss_factor) * np.float32(learning_rate)
        master32 = np.float32(master32 - update)
        weight16 = np.float16(weight16 - np.float16(update))

    kernel = step.model.get_layer("weight").kernel.numpy()
    assert kernel.dtype == np.float32
    assert kernel.item() == master32  # float32-exact
    # float16 spacing just below 1 is 2**-11 = 4.9e-4; every update is under half of it, so a float16
    # weight rounds back to 1 each step, while the float32 master moved three float16 spacings.
    assert weight16 == np.float16(1.0)
    assert 1.0 - master32 > 3 * 2.0**-11


# 5: loss scaling rescues gradients that underflow in float16.

def test_loss_scaling_rescues_underflowing_float16_gradients(capsys):
    def build():
        inputs = keras.Input((NUM_INPUTS,))
        # A zero body kernel: its gradient does not depend on it, and one SGD step with learning rate
        # 1 turns it into exactly minus the float32 gradient the step applied.
        hidden = keras.layers.Dense(NUM_HIDDEN, kernel_initializer="zeros", name="body")(inputs)
        logits_init = keras.initializers.RandomUniform(0.5, 1.0, seed=3)
        return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer=logits_init, name="logits")(hidden))

    # The body's gradient is about 1e-8: the float16 gradient of its activations, 2.5e-9 * w with
    # w in [0.5, 1], is below half of float16's smallest subnormal (6e-8) and rounds to zero unless
    # scaled. At 2**15 it is 4e-5 to 8e-5, where float16's spacing (6e-8) is at most 1.5e-3 of it.
    def tiny_loss(outputs, batch):
        return tf.reduce_mean(outputs) * 1e-8

    batch = (tf.constant(np.random.default_rng(5).uniform(0.5, 2.0, (4, NUM_INPUTS)), tf.float32),)
    weights = mixloop.build_model(build, Policy.from_string("float32")).get_weights()
    reference, _ = full_batch_gradients(weights, batch, tiny_loss, build)
    reference_kernel = reference[0]
    assert 1e-9 < np.abs(reference_kernel).min() and np.abs(reference_kernel).max() < 1e-7

    def body_gradient(loss_scale):
        step = make_step("mixed_float16", build_fn=build, weights=weights, loss_fn=tiny_loss, loss_scale=loss_scale)
        assert step.model.get_layer("body").compute_dtype == "float16"
        assert bool(step(batch)["objectives"]["model"]["applied"])
        return -step.model.get_layer("body").kernel.numpy()

    zero_fractions = {}
    for name, loss_scale in [("none", NoLossScale()), ("static_2**15", StaticLossScale(2.0**15)),
                             ("dynamic", DynamicLossScale())]:
        gradient = body_gradient(loss_scale)
        zero_fractions[name] = float(np.mean(gradient == 0.0))
        if name != "none":
            np.testing.assert_allclose(gradient, reference_kernel, rtol=1e-2, err_msg=name)
    with capsys.disabled():
        print(f"\nfloat16 body-gradient zero fractions: {zero_fractions}")
    assert zero_fractions["none"] > 0.9, zero_fractions
    assert zero_fractions["static_2**15"] < 0.01 and zero_fractions["dynamic"] < 0.01, zero_fractions


# 6: gradient accumulation.

@pytest.mark.parametrize("num_micro_batches", [2, 4])
@JIT
def test_accumulated_update_equals_full_batch_update_in_float32(num_micro_batches, jit_compile):
    weights = initial_weights()
    batch = regression_batch(16)
    full, full_metrics = update_of(make_step(weights=weights, jit_compile=jit_compile), batch)
    accumulated, metrics = update_of(
        make_step(weights=weights, accumulation_steps=num_micro_batches, jit_compile=jit_compile), batch)

    gradients, loss = full_batch_gradients(weights, batch)
    assert relative_gap(full, [-g for g in gradients]) < 1e-5  # SGD with learning rate 1
    assert relative_gap(accumulated, full) < 1e-5
    assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-6)
    assert float(full_metrics["weight"]) == 1.0 and float(metrics["weight"]) == num_micro_batches


def test_accumulated_update_matches_full_batch_in_mixed_float16(capsys):
    weights = initial_weights()
    batch = regression_batch(16)
    # 2**10: the body gradients (up to about 2) stay far below float16's 65504 once scaled.
    updates = {k: update_of(make_step("mixed_float16", weights=weights, accumulation_steps=k,
                                      loss_scale=DynamicLossScale(initial_scale=2.0**10)), batch)[0]
               for k in (1, 2, 4)}
    float32_update = [-g for g in full_batch_gradients(weights, batch)[0]]
    gaps = {k: relative_gap(updates[k], updates[1]) for k in (2, 4)}
    with capsys.disabled():
        print(f"\nfloat16 accumulated vs full-batch update, max gap / max update: {gaps}; "
              f"full batch vs float32: {relative_gap(updates[1], float32_update):.2e}")
    # Each micro-batch gradient is rounded to float16 (unit roundoff 2**-11 = 4.9e-4) before the
    # float32 sum, the full-batch gradient once: the two differ by under one float16 rounding
    # (measured 1.1e-4 for k = 2 and 4 here, up to 3.7e-4 with other data), and both lie within
    # 2.5e-4 (up to 9e-4) of float32. 2e-3 allows four roundoffs, and is 500 times below the
    # error of mis-weighting micro-batches, which is of order 1.
    for k, gap in gaps.items():
        assert gap < 2e-3, (k, gap)
    assert relative_gap(updates[1], float32_update) < 2e-3


@JIT
def test_bfloat16_accumulators_round_stochastically_and_alike_on_every_run(jit_compile):
    weights = initial_weights()
    batch = regression_batch(32)
    float32_update = update_of(make_step(weights=weights, accumulation_steps=4, jit_compile=jit_compile),
                               batch)[0]

    def bfloat16_updates():
        step = make_step(weights=weights, accumulation_steps=4, accumulation_dtype="bfloat16",
                         jit_compile=jit_compile)
        return [update_of(step, batch)[0] for _ in range(2)]

    first, again = bfloat16_updates(), bfloat16_updates()
    # Four micro-batch sums, each rounded to bfloat16 (unit roundoff 2**-8 = 3.9e-3) at most once
    # per addition: within a few roundings of the float32 accumulators, and not equal to them.
    gap = relative_gap(first[0], float32_update)
    assert 0 < gap < 2e-2, gap
    # Keyed by the step and the micro-batch: a new run rounds bit-identically, step by step.
    for run, rerun in zip(first, again):
        for a, b in zip(run, rerun):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("num_micro_batches", [1, 4])
def test_iterations_and_loss_scale_change_once_per_call(num_micro_batches):
    step = make_step("mixed_float16", optimizer=keras.optimizers.SGD(0.01), accumulation_steps=num_micro_batches,
                     loss_scale=DynamicLossScale(initial_scale=2.0**4, growth_interval=1))
    good, bad = regression_batch(seed=1), with_nan_rows(regression_batch(seed=2), rows=[5])
    scales, applied, iterations = [], [], []
    for batch in [good, good, bad, good]:
        metrics = step(batch)["objectives"]["model"]
        scales.append(float(metrics["loss_scale"]))
        applied.append(bool(metrics["applied"]))
        iterations.append(int(step.objectives["model"].optimizer.iterations))
    # One growth per finite call and one back-off for the bad call, however many micro-batches.
    assert scales == [16.0, 32.0, 64.0, 32.0]
    assert float(step.objectives["model"].loss_scale.scale) == 64.0
    assert applied == [True, True, False, True]
    assert iterations == [1, 2, 2, 3]


@JIT
def test_one_non_finite_micro_batch_skips_the_whole_update(jit_compile):
    step = make_step("mixed_float16", build_fn=mlp(batch_norm=True, dropout=0.25),
                     optimizer=keras.optimizers.Adam(1e-3), accumulation_steps=4,
                     loss_scale=DynamicLossScale(initial_scale=2.0**10), jit_compile=jit_compile)
    assert bool(step(regression_batch(seed=1))["objectives"]["model"]["applied"])
    before = state_of(step)
    # Rows 4 and 5 form the third of four micro-batches; the others are finite and update the
    # BatchNorm statistics before the NaN arrives, which the skip must undo too.
    metrics = step(with_nan_rows(regression_batch(seed=2), rows=[5]))["objectives"]["model"]
    assert not bool(metrics["applied"])
    assert_bit_identical(before, state_of(step))
    assert float(step.objectives["model"].loss_scale.scale) == 2.0**9


def test_batch_not_divisible_by_accumulation_steps_is_rejected():
    step = make_step(accumulation_steps=3)
    with pytest.raises(ValueError, match="not divisible by accumulation_steps=3"):
        step(regression_batch(8))


@pytest.mark.parametrize("kwargs, named", [(dict(accumulation_steps=0), "accumulation_steps"),
                                           (dict(clip_global_norm=0.0), "clip_global_norm")])
def test_constructor_rejects_bad_options_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named):
        make_step(**kwargs)


def python_loop_mse(sizes):
    """`mse` summed example by example in a Python loop over the batch dimension, which must be a
    static int; records each size the loss is traced with in `sizes`."""
    def loss_fn(outputs, batch):
        sizes.append((outputs.shape[0], batch[1].shape[0]))
        total = 0.0
        for row in range(batch[1].shape[0]):
            total += tf.reduce_sum(tf.square(outputs[row] - batch[1][row]))
        return total / batch[1].shape[0]
    return loss_fn


@pytest.mark.parametrize("replicas, accumulation_steps, batch_loss",
                         [(1, 1, False), (1, 4, False), (2, 2, False), (2, 2, True)])
def test_the_loss_sees_the_static_size_of_what_it_reads(replicas, accumulation_steps, batch_loss):
    """Traced for its metric names and in the step alike, the loss reads its batch size as a
    Python int: one micro-batch of one replica, or the global batch with the two passes; and it
    trains as `mse` does."""
    from mixloop.runner import distribution

    strategy = distribution.make_strategy("mirrored") if replicas > 1 else tf.distribute.get_strategy()
    sizes, steps, weights = [], {}, initial_weights()
    for name, loss_fn in (("loop", python_loop_mse(sizes)), ("mse", mse)):
        with strategy.scope():
            steps[name] = make_step(loss_fn=loss_fn, weights=weights,
                                    accumulation_steps=accumulation_steps, batch_loss=batch_loss)
        x, y = regression_batch()
        batches = tf.data.Dataset.from_tensors((x, y))
        for batch in distribution.distribute(strategy, lambda: batches, BATCH_SIZE):
            steps[name](batch)
    seen = BATCH_SIZE if batch_loss else BATCH_SIZE // (replicas * accumulation_steps)
    assert sizes and set(sizes) == {(seen, seen)}
    for looped, plain in zip(steps["loop"].model.get_weights(), steps["mse"].model.get_weights()):
        np.testing.assert_allclose(looped, plain, rtol=1e-5, atol=1e-6)


def test_a_loss_failing_on_an_unknown_batch_dimension_is_one_line_naming_the_leaf():
    """A leaf without a static batch dimension (lost in a map) reaches the loss as None: its
    failure on it is one line naming that leaf, not TensorFlow's staging traceback."""
    step = make_step(loss_fn=python_loop_mse([]))
    spec = (tf.TensorSpec([BATCH_SIZE, NUM_INPUTS]), tf.TensorSpec([None, 1]))
    with pytest.raises(mixloop.errors.UserError) as raised:
        step.metric_names(spec)
    loop_line = next(number for number, line in enumerate(open(__file__), 1)
                     if "for row in range(batch[1].shape[0])" in line)
    assert str(raised.value) == (
        "compute_loss failed on a batch whose batch dimension is unknown (element [1] of shape "
        "(None, 1)): TypeError: 'NoneType' object cannot be interpreted as an integer (at "
        f"{__file__}:{loop_line}); give every element of the train data a static batch dimension "
        "(batch with drop_remainder=True; after a map, set_shape), or read the batch size as "
        "tf.shape(x)[0]")


# 7: clipping acts on the unscaled, accumulated gradient.

@JIT
def test_clipping_is_independent_of_the_loss_scale_and_matches_a_manual_reference(jit_compile):
    weights = initial_weights()
    batch = regression_batch(16)
    clip_norm, learning_rate = 0.5, 0.1
    results = {}
    for name, loss_scale in [("static_1", StaticLossScale(1.0)), ("static_1024", StaticLossScale(1024.0)),
                             ("dynamic", DynamicLossScale())]:
        step = make_step(weights=weights, optimizer=keras.optimizers.SGD(learning_rate), loss_scale=loss_scale,
                         accumulation_steps=2, clip_global_norm=clip_norm, jit_compile=jit_compile)
        metrics = step(batch)["objectives"]["model"]
        results[name] = ([v.numpy() for v in step.model.trainable_variables], float(metrics["grad_norm"]))

    gradients, _ = full_batch_gradients(weights, batch)
    true_norm = np.sqrt(sum(np.sum(np.square(g.astype(np.float64))) for g in gradients))
    assert true_norm > 4 * clip_norm  # clipping really acts
    clipped, _ = tf.clip_by_global_norm([tf.constant(g) for g in gradients], clip_norm)
    expected = [w - learning_rate * g.numpy() for w, g in zip(weights, clipped)]

    # Power-of-two scales commute exactly with float32 rounding, so the results are bit-identical.
    for name, (variables, grad_norm) in results.items():
        for actual, same in zip(variables, results["static_1"][0]):
            np.testing.assert_array_equal(actual, same, err_msg=name)
        np.testing.assert_allclose(np.concatenate([v.ravel() for v in variables]),
                                   np.concatenate([e.ravel() for e in expected]), rtol=1e-6, atol=1e-7)
        assert grad_norm == pytest.approx(true_norm, rel=1e-5), name


# 8: XLA gives the results of graph mode.

@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_jit_compile_gives_the_same_results(policy):
    weights = initial_weights()
    batches = [regression_batch(seed=1), regression_batch(seed=2), with_nan_rows(regression_batch(seed=3), [0]),
               regression_batch(seed=4)]
    runs = {}
    for jit_compile in (False, True):
        step = make_step(policy, weights=weights, optimizer=keras.optimizers.Adam(1e-2), accumulation_steps=2,
                         clip_global_norm=1.0, loss_scale=DynamicLossScale(initial_scale=2.0**10, growth_interval=2),
                         jit_compile=jit_compile)
        metrics = [step(batch)["objectives"]["model"] for batch in batches]
        runs[jit_compile] = (
            [(bool(m["applied"]), float(m["loss_scale"])) for m in metrics],
            [float(m["loss"]) for m in metrics],
            [v.numpy() for v in step.model.trainable_variables],
        )
    assert runs[True][0] == runs[False][0] == [(True, 1024.0), (True, 1024.0), (False, 2048.0), (True, 1024.0)]
    # Measured on CPU: in float32, losses within 1.1e-7 relative and weights within 6e-8 (1e-5 and
    # 1e-6 leave room for XLA fusing differently). In float16, XLA compiles the micro-batch body
    # apart (TrainStep._compile) and rounds its float16 arithmetic differently from graph mode:
    # losses within 1.5e-5 relative (float16 rounds at 4.9e-4) and weights within 2.0e-4 after 4
    # Adam steps of 1e-2 (Adam divides by the gradient's own scale, which carries the rounding
    # into the update); the bounds are 1e-4 and a tenth of one step.
    float32 = policy == "float32"
    np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=1e-5 if float32 else 1e-4)
    for xla, graph in zip(runs[True][2], runs[False][2]):
        np.testing.assert_allclose(xla, graph, rtol=0, atol=1e-6 if float32 else 1e-3)


# 9: token-weighted losses are averaged over all tokens of all micro-batches.

SEQ_LEN, NUM_FEATURES = 5, 4
# Micro-batch 1 (rows 0-1) holds 9 tokens, micro-batch 2 (rows 2-3) only 3.
TOKEN_MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], np.float32)


def sequence_model():
    inputs = keras.Input((SEQ_LEN, NUM_FEATURES))
    hidden = keras.layers.Dense(NUM_HIDDEN, activation="tanh", name="body")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="logits")(hidden))


def masked_token_batch():
    """Features, targets and TOKEN_MASK for four sequences."""
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(4, SEQ_LEN, NUM_FEATURES)), tf.float32),
            tf.constant(rng.normal(size=(4, SEQ_LEN)), tf.float32), tf.constant(TOKEN_MASK))


def token_sum_and_count(outputs, batch):
    _, targets, mask = batch
    return tf.reduce_sum(mask * tf.square(outputs[..., 0] - targets)), tf.reduce_sum(mask)


def token_mean(outputs, batch):
    loss_sum, count = token_sum_and_count(outputs, batch)
    return loss_sum / count


@JIT
def test_token_weighted_accumulation_equals_the_full_batch_token_mean(jit_compile):
    batch = masked_token_batch()
    weights = mixloop.build_model(sequence_model, Policy.from_string("float32")).get_weights()

    def update(loss_fn, num_micro_batches):
        step = make_step(build_fn=sequence_model, weights=weights, loss_fn=loss_fn,
                         accumulation_steps=num_micro_batches, jit_compile=jit_compile)
        return update_of(step, batch)

    full, full_metrics = update(token_sum_and_count, 1)
    accumulated, metrics = update(token_sum_and_count, 2)
    mean_of_means, _ = update(token_mean, 2)

    gradients, loss = full_batch_gradients(weights, batch, token_sum_and_count, sequence_model)
    assert relative_gap(full, [-g for g in gradients]) < 1e-5
    assert relative_gap(accumulated, full) < 1e-5
    assert float(metrics["weight"]) == float(full_metrics["weight"]) == TOKEN_MASK.sum() == 12
    assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-6)
    # Averaging the two micro-batch means would weight each of the 3 tokens of micro-batch 2 as
    # much as 3 tokens of micro-batch 1: a different update (measured gap 0.23, against 9e-8 for the
    # token-weighted accumulation), far outside the tolerance above.
    assert relative_gap(mean_of_means, full) > 0.1


# 11: Keras optimizers with a learning-rate schedule, unchanged.

def halving_schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5)


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(halving_schedule(), momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(halving_schedule()),
    "adamw": lambda: keras.optimizers.AdamW(halving_schedule(), weight_decay=0.5),
}


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_keras_optimizers_and_schedules_match_a_plain_keras_run(optimizer_name):
    weights = initial_weights()
    batches = [regression_batch(seed=1), regression_batch(seed=2), with_nan_rows(regression_batch(seed=3), [6]),
               regression_batch(seed=4)]
    step = make_step(weights=weights, optimizer=OPTIMIZERS[optimizer_name](), accumulation_steps=4)
    applied = [bool(step(batch)["objectives"]["model"]["applied"]) for batch in batches]

    reference_model = mixloop.build_model(mlp(norm=True), Policy.from_string("float32"))
    reference_model.set_weights(weights)
    reference_optimizer = OPTIMIZERS[optimizer_name]()
    for batch in batches[:2] + batches[3:]:  # a plain Keras loop that never sees the bad batch
        with tf.GradientTape() as tape:
            loss = mse(reference_model(batch[0], training=True), batch)
        reference_optimizer.apply(tape.gradient(loss, reference_model.trainable_variables),
                                  reference_model.trainable_variables)

    assert applied == [True, True, False, True]
    assert int(step.objectives["model"].optimizer.iterations) == 3  # once per applied update, not per micro-batch
    # The schedule halves the rate per iteration: had it advanced per micro-batch, it would be 0.05 / 2**12.
    assert float(step.objectives["model"].optimizer.learning_rate) == pytest.approx(0.05 / 2**3, rel=1e-6)
    for actual, expected in zip(step.model.trainable_variables, reference_model.trainable_variables):
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6, err_msg=actual.path)
    assert len(step.objectives["model"].optimizer.variables) == len(reference_optimizer.variables)
    for actual, expected in zip(step.objectives["model"].optimizer.variables, reference_optimizer.variables):
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-4, atol=1e-8, err_msg=actual.path)


# Unused variables: a head the loss does not read is left alone, as model.fit leaves it.

def two_headed():
    inputs = keras.Input((NUM_INPUTS,))
    hidden = keras.layers.Dense(NUM_HIDDEN, activation="tanh", name="body")(inputs)
    unused = keras.layers.Dense(3, name="unused_head")(hidden)
    return keras.Model(inputs, {"logits": keras.layers.Dense(1, name="logits")(hidden), "unused": unused})


def mse_of_logits(outputs, batch):
    return mse(outputs["logits"], batch)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@JIT
def test_unused_variables_are_left_alone_and_the_rest_trains_as_in_keras(policy, jit_compile):
    weights = mixloop.build_model(two_headed, Policy.from_string("float32")).get_weights()
    step = make_step(policy, build_fn=two_headed, weights=weights, loss_fn=mse_of_logits,
                     optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.5), accumulation_steps=2,
                     jit_compile=jit_compile)
    before = state_of(step)
    for seed in (1, 2):
        assert bool(step(regression_batch(seed=seed))["objectives"]["model"]["applied"])
    after = state_of(step)

    unused = [path for path in before if "unused_head" in path]
    assert len(unused) == 2 + 4  # kernel and bias, and their two Adam moments
    for path in unused:  # no update, no weight decay, no moment decay
        np.testing.assert_array_equal(after[path], before[path], err_msg=path)
    # The used variables train as a plain Keras loop with the same AdamW trains them.
    reference = mixloop.build_model(two_headed, Policy.from_string("float32"))
    reference.set_weights(weights)
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    used = [v for v in reference.trainable_variables if "unused_head" not in v.path]
    for seed in (1, 2):
        batch = regression_batch(seed=seed)
        with tf.GradientTape() as tape:
            loss = mse_of_logits(reference(batch[0], training=True), batch)
        optimizer.apply(tape.gradient(loss, used), used)
    tolerance = 1e-5 if policy == "float32" else 2e-2
    for variable in used:
        np.testing.assert_allclose(after[variable.path], variable.numpy(), rtol=tolerance,
                                   atol=tolerance, err_msg=variable.path)


# A token-weighted (sum, weight) loss is scaled as a mean: it overflows no more often than one.

VOCAB, LM_SEQ_LEN, LM_BATCH = 64, 64, 32  # 2,048 token positions per update, about a quarter padding.


def token_lm():
    tokens = keras.Input((LM_SEQ_LEN,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 32)(tokens)
    x = keras.layers.Dense(64, activation="gelu", name="body")(x)
    return keras.Model(tokens, keras.layers.Dense(VOCAB, name="logits")(x))


def token_lm_batches(num_batches):
    rng = np.random.default_rng(0)
    for _ in range(num_batches):
        tokens = rng.integers(1, VOCAB, (LM_BATCH, LM_SEQ_LEN))
        lengths = rng.integers(LM_SEQ_LEN // 2, LM_SEQ_LEN + 1, LM_BATCH)
        mask = (np.arange(LM_SEQ_LEN)[None, :] < lengths[:, None]).astype(np.float32)
        yield tf.constant(tokens * mask, tf.int32), tf.constant(np.roll(tokens, -1, 1), tf.int32), tf.constant(mask)


def token_ce_sum_and_count(outputs, batch):
    losses = keras.losses.sparse_categorical_crossentropy(batch[1], outputs, from_logits=True)
    return tf.reduce_sum(losses * batch[2]), tf.reduce_sum(batch[2])


def skipped_updates(loss_fn, num_batches=30):
    weights = mixloop.build_model(token_lm, Policy.from_string("float32")).get_weights()
    step = make_step("mixed_float16", build_fn=token_lm, weights=weights, loss_fn=loss_fn,
                     optimizer=keras.optimizers.Adam(1e-3), loss_scale=DynamicLossScale(),
                     jit_compile=True)
    return sum(not bool(step(batch)["objectives"]["model"]["applied"]) for batch in token_lm_batches(num_batches))


def test_token_sum_and_weight_skips_no_more_updates_than_the_token_mean():
    pair = skipped_updates(token_ce_sum_and_count)
    mean = skipped_updates(lambda outputs, batch: tf.divide(*token_ce_sum_and_count(outputs, batch)))
    # What scaling the sum itself costs: the 16-bit backward sees 2,048 times a mean's gradients.
    plain_sum = skipped_updates(lambda outputs, batch: token_ce_sum_and_count(outputs, batch)[0])
    assert pair <= mean + 1
    assert plain_sum >= mean + 3, (plain_sum, mean)  # measured: 3 against 0


# Train metrics returned in a mixloop.Loss are weight-averaged over micro-batches.

def token_loss_with_metrics(outputs, batch):
    _, targets, mask = batch
    errors = tf.abs(outputs[..., 0] - targets)
    loss_sum, count = token_sum_and_count(outputs, batch)
    return mixloop.Loss(loss_sum, count, metrics={
        "abs_error": tf.reduce_sum(mask * errors) / count,  # a per-token mean of this micro-batch
        "large_error_rate": tf.reduce_sum(mask * tf.cast(errors > 1.0, tf.float32)) / count})


@JIT
def test_train_metrics_are_the_full_batch_token_means_whatever_the_accumulation(jit_compile):
    batch = masked_token_batch()
    weights = mixloop.build_model(sequence_model, Policy.from_string("float32")).get_weights()
    reference = mixloop.build_model(sequence_model, Policy.from_string("float32"))
    reference.set_weights(weights)
    errors = np.abs(reference(batch[0])[..., 0].numpy() - batch[1].numpy())
    expected = {"abs_error": (errors * TOKEN_MASK).sum() / TOKEN_MASK.sum(),
                "large_error_rate": ((errors > 1.0) * TOKEN_MASK).sum() / TOKEN_MASK.sum()}
    assert 0.0 < expected["large_error_rate"] < 1.0  # the rate can tell the weighting apart

    for num_micro_batches in (1, 2, 4):
        step = make_step(build_fn=sequence_model, weights=weights, loss_fn=token_loss_with_metrics,
                         accumulation_steps=num_micro_batches, jit_compile=jit_compile)
        metrics = step(batch)["objectives"]["model"]["metrics"]
        assert sorted(metrics) == ["abs_error", "large_error_rate"]
        for name, value in expected.items():
            assert float(metrics[name]) == pytest.approx(value, rel=1e-5), (name, num_micro_batches)


def test_a_per_example_loss_vector_is_a_one_line_contract_error():
    step = make_step(loss_fn=lambda outputs, batch: tf.square(outputs - batch[1])[:, 0])
    with pytest.raises(TypeError, match=r"compute_loss must return a scalar mean, \(loss_sum, "
                                        r"weight\) or mixloop.Loss\(value, weight, metrics\) of "
                                        r"scalars; the loss has shape \(8,\)"):
        step(regression_batch())


# XLA compiles the micro-batch loop's body, not the loop (TrainStep._compile): openxla's CPU backend
# runs a convolution's backward pass many times slower inside a compiled while loop.

@pytest.mark.parametrize("num_micro_batches, batch_loss", [(1, False), (4, False), (4, True)])
def test_with_xla_no_while_loop_is_inside_a_compiled_function(num_micro_batches, batch_loss):
    step = make_step(accumulation_steps=num_micro_batches, jit_compile=True, batch_loss=batch_loss,
                     loss_scale=DynamicLossScale(), overflow_retries=2)  # Nor the retry loop.
    batch = regression_batch()
    step(batch)
    step_graph = step.compiled.get_concrete_function(batch, tf.constant(0)).graph  # Attempt 0.
    compiled = [step_graph] if step.compiled._jit_compile else []
    if num_micro_batches > 1:
        for index, body in enumerate(step.gradient_source.bodies):
            assert body._jit_compile and not step.compiled._jit_compile
            concrete = body._list_all_concrete_functions_for_serialization()
            assert concrete, index  # Traced: the loop runs it.
            compiled += [function.graph for function in concrete]
    assert compiled  # Something compiles with XLA,
    for graph in compiled:  # and none of it holds a loop.
        op_types = {op.type for op in graph.get_operations()}
        op_types |= {node.op for f in graph.as_graph_def().library.function for node in f.node_def}
        assert not op_types & {"While", "StatelessWhile"}, op_types & {"While", "StatelessWhile"}


def test_a_batch_of_total_weight_zero_is_skipped_not_applied_as_nan():
    """A masked loss whose mask is all zero: (0, 0) averages to 0/0, which must count as non-finite."""
    def masked_sum(outputs, batch):
        mask = batch[1][:, 0] * 0.0
        return mixloop.Loss(tf.reduce_sum(outputs[:, 0] * mask), tf.reduce_sum(mask))

    step = make_step(loss_fn=masked_sum)
    before = state_of(step)
    report = step(regression_batch())["objectives"]["model"]
    assert not bool(report["applied"]) and not bool(report["grads_finite"])
    assert_bit_identical(before, state_of(step))
