"""Keras's float8 layers trained by the step as `model.fit` trains them: the scale and amax-history
variables Keras overwrites with their "gradient" are never loss-scaled, weighted, summed, clipped
or averaged; micro-batches and replicas combine them by maximum; a skipped update leaves them."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.engine.layer_precision import building_under
from mixloop.runner import distribution

NUM_INPUTS, NUM_CLASSES, BATCH_SIZE, NUM_UPDATES = 16, 4, 32, 20


def float8_mlp(policy: str) -> keras.Model:
    """Two hidden Dense layers and an output Dense, all float8 (no float32 placement: the output is
    named `out`), from the test's seed."""
    keras.utils.set_random_seed(3)
    with building_under(mixloop.Policy.from_string(policy)):
        inputs = keras.Input((NUM_INPUTS,))
        x = keras.layers.Dense(32, activation="relu", name="hidden0")(inputs)
        x = keras.layers.Dense(32, activation="relu", name="hidden1")(x)
        model = keras.Model(inputs, keras.layers.Dense(NUM_CLASSES, name="out")(x))
    model.quantize("float8")
    return model


def data(num_examples=NUM_UPDATES * BATCH_SIZE, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_examples, NUM_INPUTS)).astype("float32")
    y = (np.argmax(x[:, :NUM_CLASSES], axis=1)).astype("int32")
    return x, y


def cross_entropy(outputs, batch):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch[1], outputs, from_logits=True))


def is_float8_variable(variable) -> bool:
    return bool(getattr(variable, "overwrite_with_gradient", False))


def mixloop_run(policy, x, y, *, batch_size=BATCH_SIZE, **step_kwargs):
    model = float8_mlp(policy)
    loss_scale = mixloop.DynamicLossScale() if policy == "mixed_float16" else None
    step = mixloop.TrainStep(model=model, optimizer=keras.optimizers.Adam(1e-2), loss_fn=cross_entropy,
                             policy=mixloop.Policy.from_string(policy), loss_scale=loss_scale, **step_kwargs)
    reports = [step((tf.constant(x[i:i + batch_size]), tf.constant(y[i:i + batch_size])))
               for i in range(0, len(x), batch_size)]
    return step, reports


def fit_run(policy, x, y, **compile_kwargs):
    """`model.fit` from the same weights on the same batches, cast to the compute dtype first as
    the step casts them (else the first layer's input amax differs by that rounding)."""
    x = x.astype(mixloop.Policy.from_string(policy).compute_dtype.as_numpy_dtype)
    model = float8_mlp(policy)
    model.compile(optimizer=keras.optimizers.Adam(1e-2, **compile_kwargs),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    history = model.fit(x, y, batch_size=BATCH_SIZE, shuffle=False, epochs=1, verbose=0)
    return model, history


def float8_variables(model):
    return {v.path: v.numpy() for v in model.trainable_variables if is_float8_variable(v)}


def test_the_float8_model_has_its_overwritten_variables():
    model = float8_mlp("float32")
    assert len(float8_variables(model)) == 18  # Six per Dense layer.
    assert model.get_layer("out").dtype_policy.name == "float8_from_float32"


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_float8_training_matches_model_fit(policy):
    x, y = data()
    step, reports = mixloop_run(policy, x, y)
    reference, _ = fit_run(policy, x, y)
    assert all(bool(r["objectives"]["model"]["applied"]) for r in reports)
    actual = {v.path: v.numpy() for v in step.model.trainable_variables}
    expected = {v.path: v.numpy() for v in reference.trainable_variables}
    assert actual.keys() == expected.keys()
    overwritten = float8_variables(step.model).keys()
    assert len(overwritten) == 18
    for path in actual:
        if path in overwritten:
            # The bar under a dynamic scale: within 1e-6 relative of model.fit's.
            np.testing.assert_allclose(actual[path], expected[path], rtol=1e-6, atol=0, err_msg=path)
        elif policy == "float32":
            np.testing.assert_array_equal(actual[path], expected[path], err_msg=path)
        else:
            np.testing.assert_allclose(actual[path], expected[path], rtol=1e-5, atol=1e-6, err_msg=path)
    # The amax histories moved: they hold this run's maxima, not their initial zeros, and no
    # loss scale divided them (the first layer's inputs are the data itself).
    history = step.model.get_layer("hidden0").inputs_amax_history.numpy()
    compute_dtype = mixloop.Policy.from_string(policy).compute_dtype.as_numpy_dtype
    last_batch_max = np.abs(x[-BATCH_SIZE:].astype(compute_dtype)).max()
    np.testing.assert_allclose(history[0], last_batch_max, rtol=1e-6)


def test_the_gradient_norm_and_clipping_leave_the_float8_variables_out():
    x, y = data()
    step, reports = mixloop_run("float32", x, y, clip_global_norm=1.0)
    reference, history = fit_run("float32", x, y, global_clipnorm=1.0)
    for actual, expected in zip(step.model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6, err_msg=actual.path)
    # The reported norm is the true gradient's: the same model without float8's "gradients".
    first = reports[0]["objectives"]["model"]
    model = float8_mlp("float32")
    variables = [v for v in model.trainable_variables if not is_float8_variable(v)]

    @tf.function
    def true_norm():
        with tf.GradientTape() as tape:
            loss = cross_entropy(model(tf.constant(x[:BATCH_SIZE]), training=True), (None, y[:BATCH_SIZE]))
        return tf.linalg.global_norm(tape.gradient(loss, variables))

    assert float(first["grad_norm"]) == pytest.approx(float(true_norm()), rel=1e-5)
    assert max(float(r["objectives"]["model"]["grad_norm"]) for r in reports) > 1.0  # Clipping acted.


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_accumulated_amax_is_the_maximum_over_the_micro_batches(jit_compile):
    x, y = data(BATCH_SIZE)
    x[:BATCH_SIZE // 4] *= 10.0  # The first micro-batch holds the largest input: not the last one.
    step, _ = mixloop_run("float32", x, y, accumulation_steps=4, jit_compile=jit_compile)
    micro_batches = np.split(x, 4)
    by_hand = max(np.abs(micro).max() for micro in micro_batches)
    assert by_hand > np.abs(micro_batches[-1]).max()
    np.testing.assert_array_equal(step.model.get_layer("hidden0").inputs_amax_history.numpy()[0], by_hand)

    # The output gradient's amax: per micro-batch, its own mean loss's gradient by the logits,
    # (softmax - one hot) / micro-batch size, computed here in NumPy from a float32 forward.
    model = float8_mlp("float32")
    grad_amaxes = []
    for micro_x, micro_y in zip(micro_batches, np.split(y, 4)):
        logits = model(micro_x, training=False).numpy().astype(np.float64)
        softmax = np.exp(logits - logits.max(1, keepdims=True))
        softmax /= softmax.sum(1, keepdims=True)
        softmax[np.arange(len(micro_y)), micro_y] -= 1.0
        grad_amaxes.append(np.abs(softmax / len(micro_y)).max())
    actual = step.model.get_layer("out").outputs_grad_amax_history.numpy()[0]
    np.testing.assert_allclose(actual, max(grad_amaxes), rtol=1e-5)
    assert max(grad_amaxes) != pytest.approx(grad_amaxes[-1], rel=1e-3)


def test_a_skipped_update_leaves_every_float8_variable_bit_identical():
    x, y = data(2 * BATCH_SIZE)
    x[BATCH_SIZE + 3, 0] = np.nan
    step, reports = mixloop_run("mixed_float16", x, y)
    assert [bool(r["objectives"]["model"]["applied"]) for r in reports] == [True, False]
    after_first, _ = mixloop_run("mixed_float16", x[:BATCH_SIZE], y[:BATCH_SIZE])
    for actual, expected in zip(step.model.variables, after_first.model.variables):
        np.testing.assert_array_equal(actual.numpy(), expected.numpy(), err_msg=actual.path, strict=True)


def test_an_overflowed_float16_backward_is_a_skip_and_the_amax_stays():
    x, y = data(BATCH_SIZE)
    step, reports = mixloop_run("mixed_float16", x, y, overflow_retries=0)
    before = float8_variables(step.model)
    step.objectives["model"].loss_scale._scale.assign(2.0**40)  # Overflows the float16 backward.
    report = step((tf.constant(x), tf.constant(y)))["objectives"]["model"]
    assert not bool(report["applied"])
    after = float8_variables(step.model)
    for path in before:
        np.testing.assert_array_equal(after[path], before[path], err_msg=path)


def test_two_replicas_take_the_maximum_amax_over_replicas():
    strategy = distribution.make_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2
    x, y = data(BATCH_SIZE)
    x[BATCH_SIZE // 2:] *= 10.0  # The second replica's half holds the largest input.
    with strategy.scope():
        model = float8_mlp("float32")
        step = mixloop.TrainStep(model=model, optimizer=keras.optimizers.Adam(1e-2), loss_fn=cross_entropy,
                                 policy=mixloop.Policy.from_string("float32"))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE)
    batch = next(iter(distribution.distribute(strategy, lambda: dataset, BATCH_SIZE)))
    report = step(batch)["objectives"]["model"]
    assert bool(report["applied"])
    # Each replica's backward starts from its own half's mean loss, as each micro-batch's does: the
    # two replicas are one device accumulating the same two halves, output-gradient amax included.
    single, _ = mixloop_run("float32", x, y, accumulation_steps=2)
    for replica_value in strategy.experimental_local_results(model.get_layer("hidden0").inputs_amax_history.value):
        np.testing.assert_array_equal(replica_value.numpy()[0], np.abs(x).max())
    for actual, expected in zip(model.trainable_variables, single.model.trainable_variables):
        values = strategy.experimental_local_results(actual.value)
        np.testing.assert_allclose(values[0].numpy(), values[1].numpy(), rtol=0, atol=0, err_msg=actual.path)
        # Summed in another order: Adam's normalized steps carry float32 rounding a little further.
        np.testing.assert_allclose(values[0].numpy(), expected.numpy(), rtol=1e-4, atol=1e-5, err_msg=actual.path)


def test_the_ema_of_weights_leaves_the_float8_variables_out():
    x, y = data(2 * BATCH_SIZE)
    step, _ = mixloop_run("float32", x, y, ema_decay=0.5)
    weights = [v for v in step.model.trainable_variables if not is_float8_variable(v)]
    assert len(step.ema["model"].averages) == len(weights) == 6
    live = float8_variables(step.model)
    with step.ema["model"].swapped_in():
        swapped = float8_variables(step.model)
        kernel = step.model.get_layer("hidden0").kernel.numpy()
    assert kernel.tolist() != step.model.get_layer("hidden0").kernel.numpy().tolist()  # Swapped.
    for path, value in live.items():
        np.testing.assert_array_equal(swapped[path], value, err_msg=path)


def test_the_two_passes_of_a_whole_batch_loss_train_float8_layers():
    x, y = data(BATCH_SIZE)
    x[:BATCH_SIZE // 2] *= 10.0
    step, reports = mixloop_run("mixed_bfloat16", x, y, accumulation_steps=2, batch_loss=True)
    assert bool(reports[0]["objectives"]["model"]["applied"])
    history = step.model.get_layer("hidden0").inputs_amax_history.numpy()
    np.testing.assert_array_equal(history[0], np.abs(x.astype(tf.bfloat16.as_numpy_dtype)).max())
    assert step.model.get_layer("out").outputs_grad_amax_history.numpy()[0] > 0


@pytest.mark.slow
def test_the_float8_mlp_trains_through_the_cli_with_float16_defaults_as_model_fit_does(tmp_path):
    """The issue's new user: tests/fixtures/float8_experiment.py in mixed_float16 with no precision flag (the
    probe, a dynamic scale) ends within 2% of `model.fit`'s eval loss from the same weights."""
    import cli_runs
    import float8_experiment

    from mixloop import cli

    run = cli_runs.run("mixloop.train", "--config=tests/fixtures/float8_experiment.py", f"--workdir={tmp_path / 'run'}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    finished = next(line for line in run.stderr.splitlines() if "Finished at step 200 of 200" in line)
    eval_loss = float(finished.split("Eval: ")[1].split("loss ")[1].rstrip("."))

    config = float8_experiment.get_config()
    trainer = cli.build_trainer(config, str(tmp_path / "fit"))  # The run's model, policy and seed.
    model = trainer.model
    model.compile(optimizer=mixloop.build_optimizer(config), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    train, evaluation = trainer.build_datasets()
    model.fit(train.repeat().take(config.train.num_steps), epochs=1, verbose=0)
    fit_loss = model.evaluate(evaluation, verbose=0)
    print(f"float8 MLP, mixed_float16 defaults: mixloop eval loss {eval_loss}, model.fit {fit_loss:.4f}")
    assert eval_loss == pytest.approx(fit_loss, rel=0.02), (eval_loss, fit_loss)


class NewValueOfTheSmallestInput(keras.layers.Layer):
    """A layer with a variable of its own that Keras overwrites with its "gradient": the square root
    of the smallest input it saw (NaN for a negative one), as float8's amax is a new value."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 1), initializer="ones", name="kernel")
        self.stat = self.add_weight(shape=(), initializer="zeros", name="stat", overwrite_with_gradient=True)

    def call(self, x):
        @tf.custom_gradient
        def measured(x, stat):
            def grad(dy):
                return dy, tf.sqrt(tf.reduce_min(x))
            return tf.identity(x), grad

        return tf.matmul(measured(x, self.stat), self.kernel)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("micro_batches", ["nan_then_finite", "both_nan"])
def test_a_nan_new_value_in_any_micro_batch_skips_the_update(jit_compile, micro_batches):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, NewValueOfTheSmallestInput(name="stat_layer")(inputs))
    step = mixloop.TrainStep(model=model, optimizer=keras.optimizers.SGD(0.1),
                             loss_fn=lambda outputs, batch: tf.reduce_mean(outputs),
                             policy=mixloop.Policy.from_string("float32"), accumulation_steps=2,
                             jit_compile=jit_compile)
    positive = np.full((2, 4), 4.0, np.float32)
    x = np.r_[-positive, positive if micro_batches == "nan_then_finite" else -positive]
    report = step((tf.constant(x),))["objectives"]["model"]
    assert not bool(report["applied"]) and not bool(report["grads_finite"])
    layer = model.get_layer("stat_layer")
    assert float(layer.stat.numpy()) == 0.0 and layer.kernel.numpy().tolist() == [[1.0]] * 4
    # Finite in both: the maximum of the two micro-batches' new values, sqrt(4) and sqrt(9).
    step((tf.constant(np.r_[positive, positive + 5.0]),))
    assert float(layer.stat.numpy()) == 3.0


def test_weight_decay_leaves_the_float8_variables_alone():
    x, y = data(BATCH_SIZE)
    batch = (tf.constant(x), tf.constant(y))
    model = float8_mlp("float32")
    step = mixloop.TrainStep(model=model, optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.5),
                             loss_fn=cross_entropy, policy=mixloop.Policy.from_string("float32"))
    step(batch)
    plain, _ = mixloop_run("float32", x, y)  # Adam without decay, one update from the same weights.
    assert not np.array_equal(model.get_layer("hidden0").kernel.numpy(),
                              plain.model.get_layer("hidden0").kernel.numpy())  # The decay acted.
    for path, value in float8_variables(plain.model).items():
        np.testing.assert_array_equal(float8_variables(model)[path], value, err_msg=path)


def test_an_overflow_retried_in_float16_leaves_the_float8_variables_as_a_run_started_lower():
    x, y = data(BATCH_SIZE)

    def run(initial_scale, retries):
        model = float8_mlp("mixed_float16")
        step = mixloop.TrainStep(model=model, optimizer=keras.optimizers.Adam(1e-2), loss_fn=cross_entropy,
                                 policy=mixloop.Policy.from_string("mixed_float16"),
                                 loss_scale=mixloop.DynamicLossScale(initial_scale=initial_scale),
                                 overflow_retries=retries)
        report = step((tf.constant(x), tf.constant(y)))["objectives"]["model"]
        return step, report

    retried, report = run(2.0**24, 12)  # Retried down from an overflowing scale until it fits.
    assert bool(report["applied"]) and int(report["retries"]) > 0
    started_there, _ = run(float(report["loss_scale"]), 0)
    for actual, expected in zip(retried.model.variables, started_there.model.variables):
        np.testing.assert_array_equal(actual.numpy(), expected.numpy(), err_msg=actual.path)


def test_an_objective_not_due_keeps_its_float8_variables():
    x, y = data(BATCH_SIZE)
    model = float8_mlp("float32")
    objectives = {"model": mixloop.Objective(model, keras.optimizers.Adam(1e-2), every_steps=2)}
    step = mixloop.TrainStep(model=model, loss_fn=cross_entropy, objectives=objectives,
                             policy=mixloop.Policy.from_string("float32"))
    before = float8_variables(model)
    report = step((tf.constant(x), tf.constant(y)))["objectives"]["model"]  # Step 1: not due.
    assert not bool(report["ran"]) and bool(report["grads_finite"])
    for path, value in float8_variables(model).items():
        np.testing.assert_array_equal(value, before[path], err_msg=path)
    assert bool(step((tf.constant(x), tf.constant(y)))["objectives"]["model"]["applied"])  # Step 2.
    assert float8_variables(model)["hidden0/inputs_amax_history"][0] == np.abs(x).max()


def test_a_nan_new_value_on_one_replica_skips_the_update_on_both():
    strategy = distribution.make_strategy("mirrored")
    with strategy.scope():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, NewValueOfTheSmallestInput(name="stat_layer")(inputs))
        step = mixloop.TrainStep(model=model, optimizer=keras.optimizers.SGD(0.1),
                                 loss_fn=lambda outputs, batch: tf.reduce_mean(outputs),
                                 policy=mixloop.Policy.from_string("float32"))
    positive = np.full((4, 4), 4.0, np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((np.r_[positive, -positive],)).batch(8)
    batch = next(iter(distribution.distribute(strategy, lambda: dataset, 8)))
    report = step(batch)["objectives"]["model"]
    assert not bool(report["applied"]) and not bool(report["grads_finite"])
    for value in strategy.experimental_local_results(model.get_layer("stat_layer").stat.value):
        assert float(value) == 0.0
