"""Several objectives in one step: their own variables, optimizers and float16 loss scales, one
forward pass, one all-reduce; and the EMA of the weights against a NumPy reference."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.engine.loss import LossContractError
from mixloop.errors import UserError
from mixloop.runner import distribution

OVERFLOW = 1e9  # Multiplies objective b's loss: finite in float32, its float16 backward overflows.
NUM_STEPS, BATCH = 6, 8
OVERFLOW_STEPS = (1, 2)  # Updates (0-based) whose batches make b overflow.


def two_headed_model():
    """One input, two heads: `a` and `b`, each an objective's only layer."""
    inputs = keras.Input((4,))
    return keras.Model(inputs, {"a": keras.layers.Dense(2, name="a")(inputs),
                                "b": keras.layers.Dense(2, name="b")(inputs)})


def two_losses(outputs, batch):
    """Objective a: squared error. Objective b: squared error times the batch's `boost`, with a
    train metric each."""
    x, y, boost = batch
    error_a = tf.reduce_mean(tf.square(outputs["a"] - y))
    error_b = tf.reduce_mean(tf.square(outputs["b"] - y))
    return {"a": mixloop.Loss(error_a, metrics={"error_a": error_a}),
            "b": mixloop.Loss(error_b * boost[0], metrics={"error_b": error_b})}


def batches(overflow=OVERFLOW):
    rng = np.random.default_rng(3)
    for step in range(NUM_STEPS):
        boost = overflow if step in OVERFLOW_STEPS else 1.0
        yield (rng.normal(size=(BATCH, 4)).astype("float32"), rng.normal(size=(BATCH, 2)).astype("float32"),
               np.full([BATCH], boost, "float32"))


def build_two_objective_step(strategy, ema_decay=0.0, accumulation_steps=1, overflow_retries=0,
                             loss_fn=two_losses):
    keras.utils.set_random_seed(5)
    policy = mixloop.Policy.from_string("mixed_float16")
    with strategy.scope():
        model = mixloop.build_model(two_headed_model, policy)
        objectives = {
            name: mixloop.Objective(model.get_layer(name), keras.optimizers.SGD(0.1),
                                    mixloop.DynamicLossScale(initial_scale=2.0**10, growth_interval=1000))
            for name in ("a", "b")}
        return mixloop.TrainStep(model=model, objectives=objectives, loss_fn=loss_fn, policy=policy,
                                 accumulation_steps=accumulation_steps, ema_decay=ema_decay,
                                 overflow_retries=overflow_retries)


def run(strategy, step, overflow=OVERFLOW):
    """Runs the step over `batches(overflow)` (distributed as the Trainer does); returns each
    update's reports as NumPy and the weights of both heads after each update."""
    dataset = tf.data.Dataset.from_generator(
        lambda: batches(overflow), output_signature=(tf.TensorSpec([BATCH, 4]), tf.TensorSpec([BATCH, 2]),
                                   tf.TensorSpec([BATCH])))
    reports, weights = [], []
    for batch in distribution.distribute(strategy, lambda: dataset, BATCH):
        reports.append(tf.nest.map_structure(lambda v: v.numpy(), step(batch)))
        weights.append({name: [v.numpy() for v in objective.variables]
                        for name, objective in step.objectives.items()})
    return reports, weights


STRATEGIES = {"one replica": lambda: tf.distribute.get_strategy(),
              "two replicas": lambda: distribution.make_strategy("mirrored")}


@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_an_overflow_in_one_objective_skips_only_its_update_and_backs_off_only_its_scale(strategy_name):
    strategy = STRATEGIES[strategy_name]()
    step = build_two_objective_step(strategy)
    initial_b = [v.numpy() for v in step.objectives["b"].variables]
    reports, weights = run(strategy, step)

    a = [r["objectives"]["a"] for r in reports]
    b = [r["objectives"]["b"] for r in reports]
    assert [bool(r["applied"]) for r in a] == [True] * NUM_STEPS
    assert [bool(r["applied"]) for r in b] == [True, False, False, True, True, True]
    assert [float(r["loss_scale"]) for r in a] == [2.0**10] * NUM_STEPS
    assert [float(r["loss_scale"]) for r in b] == [2.0**10, 2.0**10, 2.0**9, 2.0**8, 2.0**8, 2.0**8]
    assert float(step.objectives["b"].loss_scale.scale) == 2.0**8
    # b's weights stand still through its skips; a's move on every update.
    for before, after in zip(weights[0]["b"], weights[2]["b"]):
        np.testing.assert_array_equal(before, after)
    assert not np.array_equal(weights[0]["a"][0], weights[2]["a"][0])
    assert not np.array_equal(initial_b[0], weights[0]["b"][0])
    # The optimizers count applied updates only.
    assert step.objectives["a"].optimizer.iterations.numpy() == NUM_STEPS
    assert step.objectives["b"].optimizer.iterations.numpy() == NUM_STEPS - len(OVERFLOW_STEPS)
    assert step.nonfinite_variable_paths("b") == ["b/kernel", "b/bias"]
    assert step.nonfinite_variable_paths("a") == []
    # Each objective's metrics come with its own report.
    assert set(a[0]["metrics"]) == {"error_a"} and set(b[0]["metrics"]) == {"error_b"}
    np.testing.assert_allclose(b[0]["metrics"]["error_b"], b[0]["loss"], rtol=1e-6)


@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_a_step_where_another_objective_applied_its_update_is_not_retried(strategy_name):
    """Retrying b's overflow would apply a's update twice: b skips as without retries, on one
    replica and on two (where the retry loop holds the all-reduce)."""
    strategy = STRATEGIES[strategy_name]()
    reports, weights = run(strategy, build_two_objective_step(strategy, overflow_retries=2))
    plain_reports, plain_weights = run(strategy, build_two_objective_step(strategy))

    for name in ("a", "b"):
        assert [int(r["objectives"][name]["retries"]) for r in reports] == [0] * NUM_STEPS
        assert ([bool(r["objectives"][name]["applied"]) for r in reports]
                == [bool(r["objectives"][name]["applied"]) for r in plain_reports])
        for update, plain_update in zip(weights, plain_weights):
            for after, plain_after in zip(update[name], plain_update[name]):
                np.testing.assert_array_equal(after, plain_after)
    assert [bool(r["objectives"]["b"]["applied"]) for r in reports] == [True, False, False, True, True, True]


def both_boosted(outputs, batch):
    """Both objectives' squared errors times the batch's boost."""
    x, y, boost = batch
    return {name: mixloop.Loss(tf.reduce_mean(tf.square(outputs[name] - y)) * boost[0])
            for name in ("a", "b")}


def test_a_step_where_every_objective_overflowed_is_retried_on_one_replica_and_on_two():
    """A boost of 100 overflows both heads at 2**10; at a lower scale a's backward fits first and
    b's does not: a is applied there, b skipped as without retries (its first scale reported, one
    back-off). On two replicas the retry loop holds the all-reduce (each replica's half batch
    overflows at its own scales, so the attempts may differ from one replica's)."""
    for make_strategy in STRATEGIES.values():
        strategy = make_strategy()
        step = build_two_objective_step(strategy, overflow_retries=2, loss_fn=both_boosted)
        reports, _ = run(strategy, step, overflow=100.0)
        a, b = reports[1]["objectives"]["a"], reports[1]["objectives"]["b"]
        retries = int(a["retries"])
        assert retries >= 1 and bool(a["applied"]) and float(a["loss_scale"]) == 2.0**(10 - retries)
        assert (int(b["retries"]), bool(b["applied"]), float(b["loss_scale"])) == (retries, False, 2.0**10)
        assert int(step.global_step.numpy()) == NUM_STEPS  # One step a batch, retries or not.
        applied = sum(bool(r["objectives"]["a"]["applied"]) for r in reports)
        assert int(step.objectives["a"].optimizer.iterations.numpy()) == applied


def test_objective_a_trains_exactly_as_it_would_alone():
    """b's overflows leave a's update sequence bit-identical to a step with a alone."""
    strategy = tf.distribute.get_strategy()
    _, both = run(strategy, build_two_objective_step(strategy))

    keras.utils.set_random_seed(5)
    policy = mixloop.Policy.from_string("mixed_float16")
    model = mixloop.build_model(two_headed_model, policy)
    alone = mixloop.TrainStep(
        model=model, loss_fn=lambda outputs, batch: two_losses(outputs, batch)["a"], policy=policy,
        objectives={"a": mixloop.Objective(model.get_layer("a"), keras.optimizers.SGD(0.1),
                                           mixloop.DynamicLossScale(initial_scale=2.0**10, growth_interval=1000))})
    _, single = run(strategy, alone)
    for update_both, update_single in zip(both, single):
        for x, y in zip(update_both["a"], update_single["a"]):
            np.testing.assert_array_equal(x, y)


def cadence_batches(num_steps, overflow_steps):
    """(x, y, boost) batches, b's loss boosted into a float16 overflow at the 1-based `overflow_steps`."""
    rng = np.random.default_rng(4)
    for step in range(1, num_steps + 1):
        yield (tf.constant(rng.normal(size=(BATCH, 4)), tf.float32),
               tf.constant(rng.normal(size=(BATCH, 2)), tf.float32),
               tf.fill([BATCH], OVERFLOW if step in overflow_steps else 1.0))


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_an_objective_every_3_steps_runs_its_backward_and_moves_its_state_at_steps_3_6_9_only(
        accumulation_steps):
    """b (every_steps=3) overflows at step 4, where it does not run (nothing happens), and at step 6,
    where it does (skipped, its scale backs off); its backward, update, optimizer iterations and
    scale move at steps 3, 6 and 9 only, while a trains on every step."""
    backward_passes = tf.Variable(0, dtype=tf.int64)

    @tf.custom_gradient
    def counted(x):  # The identity, whose backward pass counts itself.
        def grad(dy):
            with tf.control_dependencies([backward_passes.assign_add(1)]):
                return tf.identity(dy)
        return tf.identity(x), grad

    def loss_fn(outputs, batch):
        return two_losses({"a": outputs["a"], "b": counted(outputs["b"])}, batch)

    keras.utils.set_random_seed(5)
    policy = mixloop.Policy.from_string("mixed_float16")
    model = mixloop.build_model(two_headed_model, policy)
    # b's scale doubles after each applied update of its own, so it shows when b ran.
    b_scale = mixloop.DynamicLossScale(initial_scale=2.0**10, growth_interval=1)
    step = mixloop.TrainStep(model=model, loss_fn=loss_fn, policy=policy,
                             accumulation_steps=accumulation_steps, objectives={
        "a": mixloop.Objective(model.get_layer("a"), keras.optimizers.SGD(0.1),
                               mixloop.DynamicLossScale(initial_scale=2.0**10)),
        "b": mixloop.Objective(model.get_layer("b"), keras.optimizers.SGD(0.1), b_scale, every_steps=3)})
    b = step.objectives["b"]
    seen = []
    for batch in cadence_batches(10, overflow_steps=(4, 6)):
        weights = [v.numpy() for v in b.variables]
        report = step(batch)["objectives"]
        seen.append(dict(ran=bool(report["b"]["ran"]), applied=bool(report["b"]["applied"]),
                         moved=not np.array_equal(weights[0], b.variables[0].numpy()),
                         iterations=int(b.optimizer.iterations.numpy()),
                         scale=float(b.loss_scale.scale.numpy()),
                         backward_passes=int(backward_passes.numpy()),
                         a_applied=bool(report["a"]["applied"])))
    column = lambda key: [update[key] for update in seen]
    assert column("ran") == [False, False, True, False, False, True, False, False, True, False]
    assert column("applied") == [False, False, True, False, False, False, False, False, True, False]
    assert column("moved") == column("applied")
    assert column("iterations") == [0, 0, 1, 1, 1, 1, 1, 1, 2, 2]
    assert column("scale") == [2.0**10] * 2 + [2.0**11] * 3 + [2.0**10] * 3 + [2.0**11] * 2
    # b's backward runs once per micro-batch on its steps only; a's on every step.
    assert column("backward_passes") == [accumulation_steps * n for n in
                                         [0, 0, 1, 1, 1, 2, 2, 2, 3, 3]]
    assert column("a_applied") == [True] * 10
    assert step.objectives["a"].optimizer.iterations.numpy() == 10
    assert int(step.global_step.numpy()) == 10


def test_every_steps_must_be_a_whole_number_of_at_least_one():
    sgd = keras.optimizers.SGD(0.1)
    for every in (0, 2.5, True):
        assert f"every_steps={every!r}; it must be a whole number" in one_line_error(
            lambda layers: {"a": mixloop.Objective(layers["a"], sgd, every_steps=every)})


def collective_ops(step, strategy):
    dataset = tf.data.Dataset.from_generator(
        batches, output_signature=(tf.TensorSpec([BATCH, 4]), tf.TensorSpec([BATCH, 2]),
                                   tf.TensorSpec([BATCH])))
    batch = next(iter(distribution.distribute(strategy, lambda: dataset, BATCH)))
    step(batch)
    graph = step.compiled.get_concrete_function(batch).graph
    return [op.type for op in graph.get_operations() if op.type.startswith("Collective")]


def test_two_objectives_communicate_no_more_than_one():
    """Both objectives' gradients and sums go in the step's one all-reduce call: the graph holds
    exactly the collective ops of a one-objective step over the same variables (TensorFlow packs
    one call into a few ops)."""
    strategy = distribution.make_strategy("mirrored")
    two = collective_ops(build_two_objective_step(strategy), strategy)
    policy = mixloop.Policy.from_string("mixed_float16")
    strategy = distribution.make_strategy("mirrored")
    with strategy.scope():
        model = mixloop.build_model(two_headed_model, policy)
        one = collective_ops(mixloop.TrainStep(
            model=model, optimizer=keras.optimizers.SGD(0.1), policy=policy,
            loss_fn=lambda outputs, batch: sum(loss.value for loss in two_losses(outputs, batch).values())),
            strategy)
    assert two and two == one


def test_a_dict_without_every_objective_is_one_line_naming_the_keys():
    strategy = tf.distribute.get_strategy()
    step = build_two_objective_step(
        strategy, loss_fn=lambda outputs, batch: {"a": two_losses(outputs, batch)["a"]})
    with pytest.raises(LossContractError, match=r"keys \['a', 'b'\]; got \['a'\]"):
        step(next(batches()))


@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_ema_follows_applied_updates_only_as_numpy_computes_it(strategy_name):
    strategy = STRATEGIES[strategy_name]()
    decay = 0.75
    step = build_two_objective_step(strategy, ema_decay=decay)
    initial = {name: [v.numpy() for v in objective.variables]
               for name, objective in step.objectives.items()}
    reports, weights = run(strategy, step)

    for name in ("a", "b"):
        expected = initial[name]
        for report, after in zip(reports, weights):
            if report["objectives"][name]["applied"]:
                expected = [np.float32(decay) * average + np.float32(1 - decay) * value
                            for average, value in zip(expected, after[name])]
        for average, value in zip(step.ema[name].averages, expected):
            np.testing.assert_allclose(average.numpy(), value, rtol=1e-6, atol=1e-7)


def test_a_skipped_update_leaves_the_ema_bit_identical():
    strategy = tf.distribute.get_strategy()
    step = build_two_objective_step(strategy, ema_decay=0.5)
    seen = []
    for batch in batches():
        step(batch)
        seen.append([v.numpy() for v in step.ema["b"].averages])
    for before, after in zip(seen[0], seen[2]):  # Updates 1 and 2 of b were skipped.
        np.testing.assert_array_equal(before, after)
    assert not np.array_equal(seen[2][0], seen[3][0])


def test_the_ema_swaps_in_and_back_out():
    step = build_two_objective_step(tf.distribute.get_strategy(), ema_decay=0.5)
    for batch in batches():
        step(batch)
    trained = [v.numpy() for v in step.objectives["a"].variables]
    with step.ema["a"].swapped_in():
        for variable, average in zip(step.objectives["a"].variables, step.ema["a"].averages):
            np.testing.assert_array_equal(variable.numpy(), average.numpy())
    for variable, value in zip(step.objectives["a"].variables, trained):
        np.testing.assert_array_equal(variable.numpy(), value)


def one_line_error(objectives, loss_fn=two_losses):
    policy = mixloop.Policy.from_string("float32")
    model = mixloop.build_model(two_headed_model, policy)
    layers = {name: model.get_layer(name) for name in ("a", "b")}
    with pytest.raises(UserError) as raised:
        mixloop.TrainStep(model=model, objectives=objectives(layers), loss_fn=loss_fn, policy=policy)
    return str(raised.value)


def test_objectives_that_would_fail_deep_in_keras_are_one_line():
    sgd = keras.optimizers.SGD(0.1)
    assert "objective name 'gen/1' is not allowed" in one_line_error(
        lambda layers: {"gen/1": mixloop.Objective(layers["a"], sgd)})
    assert "share one optimizer instance" in one_line_error(
        lambda layers: {"a": mixloop.Objective(layers["a"], sgd), "b": mixloop.Objective(layers["b"], sgd)})
    assert "returned no objective" in one_line_error(lambda layers: {})
    assert "not a mixloop.Objective" in one_line_error(lambda layers: {"a": layers["a"]})
    assert "has optimizer=None, not a Keras optimizer" in one_line_error(
        lambda layers: {"a": mixloop.Objective(layers["a"], None)})


def test_a_dict_from_a_single_objective_loss_is_one_line():
    policy = mixloop.Policy.from_string("float32")
    model = mixloop.build_model(two_headed_model, policy)
    step = mixloop.TrainStep(model=model, optimizer=keras.optimizers.SGD(0.1), policy=policy,
                             loss_fn=lambda outputs, batch: {"loss": two_losses(outputs, batch)["a"].value})
    with pytest.raises(LossContractError, match="a dict is for several objectives"):
        step(next(batches()))


# An update that is not a gradient: a momentum target network (BYOL, MoCo) as `after_update`.

DECAY = 0.9  # The target's momentum: target <- DECAY * target + (1 - DECAY) * online.


def online_and_target_model():
    """One input, two towers of the same shape: `online` (trained) and `target` (followed)."""
    inputs = keras.Input((4,))
    return keras.Model(inputs, {"online": keras.layers.Dense(2, name="online")(inputs),
                                "target": keras.layers.Dense(2, name="target")(inputs)})


def online_predicts_target(outputs, batch):
    """The online tower predicts the target's output plus y (no gradient into the target), times
    the batch's boost."""
    x, y, boost = batch
    error = outputs["online"] - tf.stop_gradient(outputs["target"]) - y
    return tf.reduce_mean(tf.square(error)) * boost[0]


def momentum_target_step(strategy, policy="mixed_float16", **step_kwargs):
    """A step training `online` whose `after_update` moves `target` toward it and counts its calls
    in `step.after_update_calls`; the target starts as a copy of the online tower."""
    keras.utils.set_random_seed(5)
    policy = mixloop.Policy.from_string(policy)
    with strategy.scope():
        model = mixloop.build_model(online_and_target_model, policy)
        online, target = model.get_layer("online"), model.get_layer("target")
        target.set_weights(online.get_weights())
        target.trainable = False
        calls = tf.Variable(0, dtype=tf.int64, trainable=False)

        def follow_online():
            calls.assign_add(1)
            for t, o in zip(target.weights, online.weights):
                t.assign(DECAY * t + (1.0 - DECAY) * o)

        objective = mixloop.Objective(
            online, keras.optimizers.SGD(0.1),
            mixloop.DynamicLossScale(initial_scale=2.0**10, growth_interval=1000),
            after_update=follow_online)
        step = mixloop.TrainStep(model=model, objectives={"model": objective},
                                 loss_fn=online_predicts_target, policy=policy, **step_kwargs)
    step.after_update_calls = calls
    return step


def run_following(strategy, step, overflow=OVERFLOW):
    """Runs the step over `batches(overflow)`; returns each update's report and, after it, the
    online and the target weights (the target's of every replica) as NumPy."""
    dataset = tf.data.Dataset.from_generator(
        lambda: batches(overflow), output_signature=(tf.TensorSpec([BATCH, 4]), tf.TensorSpec([BATCH, 2]),
                                                     tf.TensorSpec([BATCH])))
    online, target = step.model.get_layer("online"), step.model.get_layer("target")
    reports, seen = [], []
    for batch in distribution.distribute(strategy, lambda: dataset, BATCH):
        reports.append(tf.nest.map_structure(lambda v: v.numpy(), step(batch)["objectives"]["model"]))
        seen.append({"online": [v.numpy() for v in online.weights],
                     "target": [[copy.numpy() for copy in strategy.experimental_local_results(v.value)]
                                for v in target.weights]})
    return reports, seen


def expected_target(initial, reports, seen):
    """The EMA formula in NumPy (float32, as the step computes it) over the online weights after
    each applied update."""
    expected = initial
    for report, after in zip(reports, seen):
        if report["applied"]:
            expected = [np.float32(DECAY) * t + np.float32(1.0 - DECAY) * o
                        for t, o in zip(expected, after["online"])]
    return expected


@pytest.mark.parametrize("strategy_name", STRATEGIES)
@pytest.mark.parametrize("accumulation_steps", [1, 4])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_a_momentum_target_follows_the_float32_online_weights_once_per_update(
        policy, accumulation_steps, strategy_name):
    """after_update runs once per update (not per micro-batch), on the float32 master weights
    (an autocast 16-bit read would be ~1e-4 off), and leaves every replica's copy the same."""
    strategy = STRATEGIES[strategy_name]()
    step = momentum_target_step(strategy, policy, accumulation_steps=accumulation_steps)
    initial = [v.numpy() for v in step.model.get_layer("target").weights]
    reports, seen = run_following(strategy, step, overflow=1.0)

    assert [bool(r["applied"]) for r in reports] == [True] * NUM_STEPS
    assert int(step.after_update_calls.numpy()) == NUM_STEPS
    for actual, expected in zip(seen[-1]["target"], expected_target(initial, reports, seen)):
        for copy in actual:  # One per replica, each the formula's.
            np.testing.assert_allclose(copy, expected, rtol=1e-7, atol=0)
    # The target moved by more than rounding: each update's step is seen.
    assert np.abs(seen[-1]["target"][0][0] - initial[0]).max() > 1e-3


@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_a_skipped_update_leaves_the_target_bit_identical(strategy_name):
    """Updates 2 and 3 overflow in float16 and are skipped: after_update does not run, and the
    target stays bit for bit; it follows the applied updates only."""
    strategy = STRATEGIES[strategy_name]()
    step = momentum_target_step(strategy, accumulation_steps=2)
    initial = [v.numpy() for v in step.model.get_layer("target").weights]
    reports, seen = run_following(strategy, step)

    assert [bool(r["applied"]) for r in reports] == [True, False, False, True, True, True]
    assert int(step.after_update_calls.numpy()) == NUM_STEPS - len(OVERFLOW_STEPS)
    for before, after in zip(seen[0]["target"], seen[2]["target"]):
        np.testing.assert_array_equal(before, after)
    for actual, expected in zip(seen[-1]["target"], expected_target(initial, reports, seen)):
        for copy in actual:
            np.testing.assert_allclose(copy, expected, rtol=1e-7, atol=0)


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_after_update_inside_an_xla_step(accumulation_steps):
    """Compiled by XLA (the whole step, or the micro-batch bodies and not the loop), after_update
    runs for the applied updates only; XLA rounds the multiply-add its own way (1.8e-7 measured
    over 4 updates, within two float32 roundings of NumPy's)."""
    strategy = tf.distribute.get_strategy()
    step = momentum_target_step(strategy, accumulation_steps=accumulation_steps, jit_compile=True)
    initial = [v.numpy() for v in step.model.get_layer("target").weights]
    reports, seen = run_following(strategy, step)

    assert [bool(r["applied"]) for r in reports] == [True, False, False, True, True, True]
    assert int(step.after_update_calls.numpy()) == NUM_STEPS - len(OVERFLOW_STEPS)
    for actual, expected in zip(seen[-1]["target"], expected_target(initial, reports, seen)):
        np.testing.assert_allclose(actual[0], expected, rtol=2.5e-7, atol=0)


def test_a_retried_overflow_runs_after_update_once():
    """A boost of 300 overflows at 2**10 (updates 2 and 3); a retry at a backed-off scale applies
    each update, and after_update runs for that applied attempt only."""
    strategy = tf.distribute.get_strategy()
    step = momentum_target_step(strategy, overflow_retries=5)
    initial = [v.numpy() for v in step.model.get_layer("target").weights]
    reports, seen = run_following(strategy, step, overflow=300.0)

    assert [int(r["retries"]) > 0 for r in reports] == [i in OVERFLOW_STEPS for i in range(NUM_STEPS)]
    assert all(bool(r["applied"]) for r in reports)
    assert int(step.after_update_calls.numpy()) == NUM_STEPS
    for actual, expected in zip(seen[-1]["target"], expected_target(initial, reports, seen)):
        np.testing.assert_allclose(actual[0], expected, rtol=1e-7, atol=0)


def test_an_after_update_that_is_not_callable_is_one_line():
    sgd = keras.optimizers.SGD(0.1)
    assert "objective 'a' has after_update=3; it must be a function of no arguments" in one_line_error(
        lambda layers: {"a": mixloop.Objective(layers["a"], sgd, after_update=3)})
