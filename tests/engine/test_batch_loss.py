"""A loss over the whole global batch (NT-Xent) under accumulation and replicas: GradCache's two
passes give the gradient of one device's whole-batch step to float32 rounding, under a dynamic loss
scale, with the same random draws in both passes; plain accumulation gives another loss."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop import errors as mixloop_errors
from mixloop.runner import distribution

BATCH, FEATURES = 32, 8


def two_views_model(*, dropout=0.0, batch_norm=False):
    """A model factory: one encoder applied to two views, {"z1": [B, 4], "z2": [B, 4]}."""

    def build():
        views = [keras.Input((FEATURES,)), keras.Input((FEATURES,))]
        layers = [keras.layers.Dense(16, activation="tanh")]
        layers += [keras.layers.BatchNormalization()] if batch_norm else []
        layers += [keras.layers.Dropout(dropout)] if dropout else []
        encoder = keras.Sequential([*layers, keras.layers.Dense(4)], name="encoder")
        return keras.Model(views, {"z1": encoder(views[0]), "z2": encoder(views[1])})

    return build


def nt_xent(outputs, batch, temperature=0.5):
    """SimCLR's loss: each of the 2B projections must pick its other view among the 2B - 1 others."""
    z = tf.math.l2_normalize(tf.concat([outputs["z1"], outputs["z2"]], 0), axis=1)
    n = tf.shape(outputs["z1"])[0]
    logits = tf.matmul(z, z, transpose_b=True) / temperature - 1e9 * tf.eye(2 * n)
    labels = tf.concat([tf.range(n, 2 * n), tf.range(0, n)], 0)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


def views(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=(BATCH, FEATURES)).astype("float32") for _ in range(2))


def initial_weights(build_fn):
    keras.utils.set_random_seed(1)
    return mixloop.build_model(build_fn, mixloop.Policy.from_string("float32")).get_weights()


def make_step(strategy, build_fn, *, policy="float32", initial_scale=2.0**10, **step_kwargs):
    """A TrainStep with SGD(1) (its update is minus the gradient) from `initial_weights`."""
    policy = mixloop.Policy.from_string(policy)
    with strategy.scope():
        model = mixloop.build_model(build_fn, policy)
        model.set_weights(initial_weights(build_fn))
        return mixloop.TrainStep(model=model, optimizer=keras.optimizers.SGD(1.0), loss_fn=nt_xent,
                                 policy=policy, input_fn=lambda batch: batch,
                                 loss_scale=mixloop.DynamicLossScale(initial_scale=initial_scale),
                                 **step_kwargs)


def update_of(strategy, step, data):
    """One step on `data` as one global batch (sharded as the Trainer does): (the change of every
    trainable variable, the report)."""
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(BATCH)
    batch = next(iter(distribution.distribute(strategy, lambda: dataset, BATCH)))
    before = [v.numpy() for v in step.model.trainable_variables]
    report = step(batch)["objectives"]["model"]
    return ([v.numpy() - b for v, b in zip(step.model.trainable_variables, before)],
            {key: value.numpy() for key, value in report.items() if key != "metrics"})


def relative_gap(actual, expected):
    gap = max(np.max(np.abs(a - e)) for a, e in zip(actual, expected))
    return gap / max(np.max(np.abs(e)) for e in expected)


STRATEGIES = {"one replica": tf.distribute.get_strategy,
              "two replicas": lambda: distribution.make_strategy("mirrored")}


def reference_update(build_fn=two_views_model(), policy="float32"):
    """One device, the whole batch at once: the update every other way must reproduce."""
    strategy = tf.distribute.get_strategy()
    return update_of(strategy, make_step(strategy, build_fn, policy=policy), views())


@pytest.mark.parametrize("strategy_name", STRATEGIES)
@pytest.mark.parametrize("accumulation_steps", [1, 4])
def test_the_two_passes_give_the_whole_batch_gradient_to_float32_rounding(strategy_name,
                                                                         accumulation_steps):
    expected, expected_report = reference_update()
    strategy = STRATEGIES[strategy_name]()
    update, report = update_of(strategy, make_step(strategy, two_views_model(), batch_loss=True,
                                                   accumulation_steps=accumulation_steps), views())
    assert relative_gap(update, expected) < 1e-6  # Measured 1.5e-7 to 1.9e-7.
    assert report["loss"] == pytest.approx(expected_report["loss"], rel=1e-6)
    assert report["weight"] == 1.0 and report["applied"]
    assert report["loss_scale"] == 2.0**10


def test_without_batch_loss_each_micro_batch_and_replica_has_a_loss_of_its_own():
    """What docs/recipes.md says plain accumulation does: NT-Xent over 8 pairs per micro-batch, a lower
    loss (fewer negatives) and another gradient."""
    expected, expected_report = reference_update()
    strategy = distribution.make_strategy("mirrored")
    update, report = update_of(strategy, make_step(strategy, two_views_model(), accumulation_steps=2),
                               views())
    assert report["loss"] < expected_report["loss"] - 0.5
    assert relative_gap(update, expected) > 0.1


def test_xla_compiles_the_two_passes_bodies_to_the_same_gradient():
    expected, _ = reference_update()
    strategy = tf.distribute.get_strategy()
    update, _ = update_of(strategy, make_step(strategy, two_views_model(), batch_loss=True,
                                              accumulation_steps=4, jit_compile=True), views())
    assert relative_gap(update, expected) < 1e-6


@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_in_float16_the_two_passes_match_the_whole_batch_to_float16_rounding(strategy_name):
    expected, expected_report = reference_update(policy="mixed_float16")
    strategy = STRATEGIES[strategy_name]()
    update, report = update_of(strategy, make_step(strategy, two_views_model(), policy="mixed_float16",
                                                   batch_loss=True, accumulation_steps=4), views())
    # Each micro-batch's weight gradient is summed in float16 over its 8 rows, the whole batch's
    # over 32: they differ by float16 roundings (unit roundoff 4.9e-4; measured 7e-4).
    assert relative_gap(update, expected) < 4e-3
    assert report["loss"] == pytest.approx(expected_report["loss"], rel=1e-6)


def test_an_overflow_in_the_second_pass_skips_the_update_and_backs_off_the_scale():
    strategy = tf.distribute.get_strategy()
    step = make_step(strategy, two_views_model(), policy="mixed_float16", initial_scale=2.0**24,
                     batch_loss=True, accumulation_steps=4)
    update, report = update_of(strategy, step, views())
    assert not report["grads_finite"] and not report["applied"]
    assert all(not np.any(change) for change in update)
    assert float(step.objectives["model"].loss_scale.scale) == 2.0**23


def test_the_second_pass_draws_the_first_pass_dropout_and_statistics_move_once():
    """With dropout and BatchNorm, the gradient is the whole batch's loss's over the micro-batch
    forwards as the first pass drew them (one tape over all four, from the same seed state), and the
    BatchNorm statistics end where plain accumulation leaves them."""
    build = two_views_model(dropout=0.5, batch_norm=True)
    strategy = tf.distribute.get_strategy()
    step = make_step(strategy, build, batch_loss=True, accumulation_steps=4)
    plain = make_step(strategy, build, accumulation_steps=4)

    reference = mixloop.build_model(build, mixloop.Policy.from_string("float32"))
    reference.set_weights(initial_weights(build))
    for variable, value in zip(reference.variables, step.model.variables):  # The seed states.
        variable.assign(value)
    micro_batches = [tuple(view[i * 8:(i + 1) * 8] for view in views()) for i in range(4)]
    with tf.GradientTape() as tape:
        pieces = [reference(micro_batch, training=True) for micro_batch in micro_batches]
        outputs = {key: tf.concat([piece[key] for piece in pieces], 0) for key in ("z1", "z2")}
        loss = nt_xent(outputs, None)
    expected = [-g.numpy() for g in tape.gradient(loss, reference.trainable_variables)]

    update, report = update_of(strategy, step, views())
    update_of(strategy, plain, views())
    assert relative_gap(update, expected) < 1e-5
    assert report["loss"] == pytest.approx(float(loss), rel=1e-6)
    for ours, theirs in zip(step.model.non_trainable_weights, plain.model.non_trainable_weights):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6, err_msg=ours.path)
    # The dropout seed moved once per micro-batch and view, as plain accumulation moves it.
    [seed], [plain_seed] = [[v for v in s.model.variables if "seed_generator" in v.path]
                            for s in (step, plain)]
    assert int(seed.numpy()[1]) == int(plain_seed.numpy()[1]) == 4 * 2


def with_batch_mean_output(build_fn=two_views_model()):
    """`build_fn`'s model with a third output, the batch mean of z1 (shape [4]: not batch-shaped)."""

    def build():
        model = build_fn()
        views_in = model.inputs
        produced = model(views_in)
        mean = keras.layers.Lambda(lambda z: tf.reduce_mean(z, 0), name="mean")(produced["z1"])
        return keras.Model(views_in, {**produced, "mean": mean})

    return build


@pytest.mark.parametrize("strategy_name, accumulation_steps, joined", [
    ("one replica", 2, "joined over 2 micro-batches,"),
    ("two replicas", 1, "joined over 2 replicas,")])
def test_an_output_that_is_not_batch_shaped_is_refused_at_trace_time(strategy_name,
                                                                    accumulation_steps, joined):
    """A batch mean joined over micro-batches ([4] twice: [8]) would be another loss's input."""
    strategy = STRATEGIES[strategy_name]()
    step = make_step(strategy, with_batch_mean_output(), batch_loss=True,
                     accumulation_steps=accumulation_steps)
    rows = BATCH // 2
    with pytest.raises(mixloop_errors.UserError) as raised:
        update_of(strategy, step, views())
    assert mixloop_errors.message_of(raised.value) == (
        f"train.batch_loss: model output mean has shape (4,), whose first dimension is not the "
        f"micro-batch size {rows}; the loss over the whole batch would read it {joined} "
        "laid end to end; make every model output batch-shaped ([batch, ...]: take a statistic "
        "over the batch, such as a mean, in compute_loss instead), or set train.batch_loss=False")


def test_an_output_of_unknown_rows_is_checked_when_the_step_runs():
    """Without a static batch dimension the rule is an assertion in the step."""
    strategy = tf.distribute.get_strategy()
    step = make_step(strategy, with_batch_mean_output(), batch_loss=True, accumulation_steps=2)
    batch = next(iter(tf.data.Dataset.from_tensor_slices(views()).batch(BATCH)))  # Rows unknown.
    compiled = tf.function(step.step, input_signature=[
        tf.nest.map_structure(lambda t: tf.TensorSpec([None, FEATURES], t.dtype), batch)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"train.batch_loss: model output mean "
                       r"has shape \(4,\), whose first dimension is not the micro-batch size; "):
        compiled(batch)
