"""Research Trainers: several objectives, actions, extra state and EMA through the whole run
(TensorBoard tags, checkpoints, resume, eval and export), on one and two replicas."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny_experiment
from helpers import events

import mixloop
from mixloop.errors import UserError
from mixloop.runner import guard
from mixloop.runner.actions import returned_metrics

OVERFLOW_STEPS = (3, 4, 5)  # 1-based updates whose batches make objective `b` overflow float16.


class TwoHeadTrainer(tiny_experiment.TinyTrainer):
    """TinyTrainer's data with two heads, two objectives (own Adam, own loss scale), an action every
    `model.action_every` updates that bumps a curriculum counter, and an eval-time text summary."""

    overflow_steps = OVERFLOW_STEPS

    def build_model(self):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu", name="body")(inputs)
        return keras.Model(inputs, {"a": keras.layers.Dense(3, name="a")(hidden),
                                    "b": keras.layers.Dense(3, name="b")(inputs)})

    def build_datasets(self):
        train, evaluation = super().build_datasets()
        # A third element, the batch's boost of b's loss: huge (float16 overflow) at OVERFLOW_STEPS.
        boosts = tf.data.Dataset.from_tensor_slices(
            [1e9 if step in self.overflow_steps else 1.0 for step in range(1, 1001)])
        zip_boost = lambda batch, boost: (*batch, tf.fill([tf.shape(batch[0])[0]], boost))
        train = tf.data.Dataset.zip((train.repeat(), boosts)).map(zip_boost)
        evaluation = evaluation.map(lambda x, y: (x, y, tf.ones_like(y, tf.float32)))
        return train, evaluation

    def build_objectives(self):
        a = keras.Sequential([self.model.get_layer("body"), self.model.get_layer("a")])
        return {"a": mixloop.Objective(a, keras.optimizers.Adam(1e-2)),
                "b": mixloop.Objective(self.model.get_layer("b"), keras.optimizers.Adam(1e-2))}

    def compute_loss(self, outputs, batch):
        x, y, boost = batch
        ce = lambda logits: tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        correct = tf.cast(tf.equal(tf.argmax(outputs["a"], -1, output_type=tf.int32), y), tf.float32)
        return {"a": mixloop.Loss(ce(outputs["a"]), metrics={"accuracy": tf.reduce_mean(correct)}),
                "b": ce(outputs["b"]) * boost[0]}

    def eval_metrics(self, outputs, batch):
        losses = mixloop.engine.loss.as_losses(self.compute_loss(outputs, batch), self.objectives)
        return {f"loss_{name}": loss.value for name, loss in losses.items()}

    def extra_state(self):
        self.curriculum = tf.Variable(0, dtype=tf.int64, trainable=False, name="curriculum")
        return {"curriculum": self.curriculum}

    def actions(self):
        self.action_steps = {"every": [], "eval": []}

        def bump(step):
            self.action_steps["every"].append(step)
            self.curriculum.assign_add(1)

        def sample(step):
            self.action_steps["eval"].append(step)
            tf.summary.text("sample", f"curriculum {int(self.curriculum.numpy())}", step=step)

        return [mixloop.Action(bump, every_steps=self.config.model.action_every),
                mixloop.Action(sample, at_eval=True)]


def make(workdir, trainer_class=TwoHeadTrainer, **overrides):
    config = tiny_experiment.get_config()
    config.model.action_every = 7
    config.train.accumulation_steps = 1
    config.deterministic = True
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    return trainer_class(config, str(workdir))


@pytest.mark.parametrize("distribution", ["one_device", "mirrored"])
def test_two_objectives_report_their_own_scales_and_skips(tmp_path, distribution):
    trainer = make(tmp_path, distribution=distribution, **{"train.num_steps": 20,
                                                           "precision.initial_scale": 2.0**15})
    trainer.train()
    train = events(str(tmp_path / "train"))
    assert {"loss/a", "loss/b", "loss_scale/a", "loss_scale/b", "skipped_total/a", "skipped_total/b",
            "learning_rate/a", "learning_rate/b", "accuracy"} <= set(train)
    assert [value for _, value in train["skipped_total/b"]] == [3.0, 3.0]
    assert [value for _, value in train["skipped_total/a"]] == [0.0, 0.0]
    assert train["loss_scale/a"][-1][1] == 2.0**15
    assert train["loss_scale/b"][-1][1] == 2.0**15 / 2**3  # Backed off once per overflow.
    assert trainer.objectives["b"].optimizer.iterations.numpy() == 20 - len(OVERFLOW_STEPS)
    assert trainer.objectives["a"].optimizer.iterations.numpy() == 20


def test_the_guard_names_the_objective_that_diverges(tmp_path):
    class AlwaysOverflowing(TwoHeadTrainer):
        overflow_steps = range(3, 1001)

    trainer = make(tmp_path, AlwaysOverflowing, **{"train.max_consecutive_skips": 4})
    with pytest.raises(guard.TrainingDiverged, match=r"training diverged at step 6 in objective 'b': "
                                                     r"4 updates in a row were skipped .* b/kernel"):
        trainer.train()
    assert trainer.run.state.skipped_totals() == {"a": 0, "b": 4}


def test_actions_run_at_their_cadence_and_write_into_tensorboard(tmp_path):
    trainer = make(tmp_path, **{"train.num_steps": 20, "eval.every_steps": 10})
    trainer.train()
    assert trainer.action_steps == {"every": [7, 14], "eval": [10, 20]}
    samples = events(str(tmp_path / "eval"))["sample"]
    assert samples == [(10, "curriculum 1"), (20, "curriculum 2")]


@pytest.mark.parametrize("distribution", ["auto", "mirrored"])
def test_extra_state_and_both_objectives_survive_a_stop_and_resume(tmp_path, distribution):
    straight = make(tmp_path / "straight", distribution=distribution, **{"train.num_steps": 30})
    straight.train()
    make(tmp_path / "resumed", distribution=distribution, **{"train.num_steps": 15}).train()
    resumed = make(tmp_path / "resumed", distribution=distribution, **{"train.num_steps": 30})
    resumed.train()
    assert int(resumed.curriculum.numpy()) == int(straight.curriculum.numpy()) == 4  # 7, 14, 21, 28
    assert resumed.action_steps["every"] == [21, 28]
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for name in ("a", "b"):
        assert (resumed.objectives[name].loss_scale.scale.numpy()
                == straight.objectives[name].loss_scale.scale.numpy())
        assert resumed.run.state.skipped_totals() == straight.run.state.skipped_totals() == {"a": 0, "b": 3}


@pytest.mark.parametrize("distribution", ["auto", "mirrored"])
def test_ema_weights_are_evaluated_exported_and_resumed(tmp_path, distribution):
    overrides = {"train.num_steps": 20, "train.ema_decay": 0.9, "precision.policy": "float32",
                 "distribution": distribution}
    trainer = make(tmp_path / "ema", tiny_experiment.TinyTrainer, **overrides)
    trainer.train()
    averages = trainer.run.train_step.ema["model"].averages
    trained = trainer.model.get_weights()
    assert not np.array_equal(averages[0].numpy(), trained[0])
    # Eval reads the EMA weights: the same numbers as a model holding them.
    with trainer.ema_weights():
        ema_weights = trainer.model.get_weights()
    np.testing.assert_array_equal(ema_weights[0], averages[0].numpy())
    exported = keras.saving.load_model(str(tmp_path / "ema" / "model.keras"))
    np.testing.assert_array_equal(exported.get_weights()[0], averages[0].numpy())
    for a, b in zip(trainer.model.get_weights(), trained):  # The trained weights are back.
        np.testing.assert_array_equal(a, b)
    # The averages are checkpointed.
    again = make(tmp_path / "ema", tiny_experiment.TinyTrainer, **overrides)
    again.run.restore()
    np.testing.assert_array_equal(again.run.train_step.ema["model"].averages[0].numpy(), averages[0].numpy())


class CadencedTrainer(TwoHeadTrainer):
    """TwoHeadTrainer whose objective b is updated every 3rd step only: of its overflowing steps
    3, 4 and 5, only step 3 is one of b's."""

    def build_objectives(self):
        objectives = super().build_objectives()
        b = objectives["b"]
        return {**objectives, "b": mixloop.Objective(b.layer, b.optimizer, every_steps=3)}


def optimizer_state(trainer):
    return {name: [v.numpy() for v in objective.optimizer.variables]
            for name, objective in trainer.objectives.items()}


@pytest.mark.parametrize("distribution", ["auto", "mirrored"])
def test_an_objective_every_3_steps_is_reported_and_resumes_bit_identical(tmp_path, distribution):
    # From a known scale (float16's default `auto` starts where a probe says, on one device).
    straight = make(tmp_path / "straight", CadencedTrainer, distribution=distribution,
                    **{"train.num_steps": 20, "precision.initial_scale": 2.0**15})
    straight.train()
    train = events(str(tmp_path / "straight" / "train"))
    assert train["updates/b"] == [(10, 3.0), (20, 3.0)]  # Steps 3, 6, 9 and 12, 15, 18.
    assert "updates/a" not in train and "updates" not in train
    assert [value for _, value in train["skipped_total/b"]] == [1.0, 1.0]  # Step 3 only.
    assert train["loss_scale/b"][-1][1] == 2.0**14
    assert straight.objectives["b"].optimizer.iterations.numpy() == 6 - 1
    assert straight.objectives["a"].optimizer.iterations.numpy() == 20

    make(tmp_path / "resumed", CadencedTrainer, distribution=distribution,
         **{"train.num_steps": 10, "precision.initial_scale": 2.0**15}).train()  # Stops between
    resumed = make(tmp_path / "resumed", CadencedTrainer, distribution=distribution,  # 9 and 12.
                   **{"train.num_steps": 20, "precision.initial_scale": 2.0**15})
    resumed.train()
    assert events(str(tmp_path / "resumed" / "train"))["updates/b"] == [(10, 3.0), (20, 3.0)]
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for name, values in optimizer_state(straight).items():
        for a, b in zip(values, optimizer_state(resumed)[name]):
            np.testing.assert_array_equal(a, b)
        assert (resumed.objectives[name].loss_scale.scale.numpy()
                == straight.objectives[name].loss_scale.scale.numpy())
    assert resumed.run.state.skipped_totals() == straight.run.state.skipped_totals() == {"a": 0, "b": 1}


class Noise(keras.layers.Layer):
    """Adds Gaussian noise in every call, eval's (`training=False`) too, as a VAE samples its latent:
    drawn from a `SeedGenerator` of its own, a random state the checkpoint holds."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(3)

    def call(self, inputs):
        return inputs + 0.5 * keras.random.normal(keras.ops.shape(inputs), dtype=self.compute_dtype,
                                                  seed=self.seed_generator)


class NoisyEvalTrainer(tiny_experiment.TinyTrainer):
    """TinyTrainer's data through a model with `Noise` after its hidden layer, and an eval-time
    action that runs the model once more (drawing noise too)."""

    def build_model(self):
        inputs = keras.Input((8,))
        hidden = Noise(name="noise")(keras.layers.Dense(16, activation="relu")(inputs))
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))

    def actions(self):
        return [mixloop.Action(self.run_the_model, at_eval=True)]

    def run_the_model(self, step):
        self.model(next(iter(self.eval_data))[0], training=False)


@pytest.mark.parametrize("distribution", ["auto", "mirrored"])
def test_eval_that_draws_noise_leaves_a_stopped_and_resumed_run_bit_identical(tmp_path, distribution):
    overrides = {"train.num_steps": 20, "eval.every_steps": 10, "distribution": distribution}
    straight = make(tmp_path / "straight", NoisyEvalTrainer, **overrides)
    straight_metrics = straight.train()
    # Stopped at 15, where the end of the run evaluates (and the action runs), then resumed.
    make(tmp_path / "resumed", NoisyEvalTrainer, **{**overrides, "train.num_steps": 15}).train()
    resumed = make(tmp_path / "resumed", NoisyEvalTrainer, **overrides)
    resumed_metrics = resumed.train()
    for a, b in zip(straight.model.variables, resumed.model.variables):  # The seed states too.
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert resumed_metrics["eval_loss"] == straight_metrics["eval_loss"]
    assert resumed_metrics["eval_accuracy"] == straight_metrics["eval_accuracy"]
    # Eval does draw: outside the controller's `random_states_kept` it moves the seed state.
    seed_state = straight.model.get_layer("noise").seed_generator.state
    before = seed_state.numpy()
    straight.evaluate()
    assert not np.array_equal(before, seed_state.numpy())
    with straight.random_states_kept():
        straight.evaluate()
    np.testing.assert_array_equal(before + [0, 2], seed_state.numpy())


class ScoringTrainer(tiny_experiment.TinyTrainer):
    """Actions that compute metrics: `fid` after each eval (a sample's score; here step / 4) and
    `weight_norm` every 5 updates."""

    def actions(self):
        return [mixloop.Action(self.score, at_eval=True), mixloop.Action(self.norm, every_steps=5)]

    def score(self, step):
        return {"fid": step / 4}

    def norm(self, step):
        return {"weight_norm": tf.linalg.global_norm(self.model.trainable_weights)}


def test_metrics_an_action_returns_join_the_eval_summary(tmp_path, caplog):
    trainer = make(tmp_path, ScoringTrainer, **{"train.num_steps": 20, "eval.every_steps": 10,
                                                "jit_compile": False, "precision.policy": "float32"})
    with caplog.at_level(logging.INFO, logger="absl"):
        metrics = trainer.train()

    assert metrics["eval_fid"] == 5.0 and "eval_loss" in metrics
    lines = [record.getMessage() for record in caplog.records]
    eval_lines = [line for line in lines if line.startswith("eval at step")]
    assert [line.split(":")[0] for line in eval_lines] == ["eval at step 10", "eval at step 20"]
    assert "accuracy " in eval_lines[0] and "  fid 2.5000  loss " in eval_lines[0]
    [finished] = [line for line in lines if line.startswith("Finished at step 20")]
    assert "fid 5.0000" in finished.partition(" Eval: ")[2]
    assert "weight_norm" not in finished  # An every-N action's metric goes to TensorBoard only.
    assert events(str(tmp_path / "eval"))["fid"] == [(10, 2.5), (20, 5.0)]
    assert [step for step, _ in events(str(tmp_path / "train"))["weight_norm"]] == [5, 10, 15, 20]


@pytest.mark.parametrize("returned, message", [
    ({"loss": 1.0}, "returned metric 'loss' at step 10, which the run reports already at that step; "
                    "rename it"),
    ({"loss_scale/a": 1.0}, "returned metric 'loss_scale/a' at step 10, which the framework writes "
                            "itself; rename it"),
    ({"fid": [1.0, 2.0]}, r"returned metric 'fid' at step 10: \[1.0, 2.0\] is not a real number"),
    ({"fid": "low"}, "returned metric 'fid' at step 10: 'low' is not a real number"),
    ({3: 1.0}, "returned metric 3 at step 10: a metric's name must be a non-empty string"),
])
def test_metrics_an_action_may_not_return_are_one_line(returned, message):
    action = mixloop.Action(lambda step: returned, at_eval=True)
    with pytest.raises(UserError, match="^action <lambda> \\(at eval\\) " + message):
        returned_metrics(action, returned, 10, taken=["loss"], reserved=["loss_scale"])


def test_what_else_an_action_returns_is_no_metric():
    action = mixloop.Action(lambda step: True, every_steps=1)
    assert returned_metrics(action, True, 1) == {} and returned_metrics(action, None, 1) == {}
    assert returned_metrics(action, {"fid": np.float32(0.5), "n": tf.constant(3)}, 1) == {
        "fid": 0.5, "n": 3.0}


class WeightedLossTrainer(tiny_experiment.TinyTrainer):
    """Reads its research state in compute_loss: a loss weight a curriculum could change."""

    def extra_state(self):
        self.loss_weight = tf.Variable(1.0, trainable=False, name="loss_weight")
        return {"loss_weight": self.loss_weight}

    def compute_loss(self, outputs, batch):
        return super().compute_loss(outputs, batch) * self.loss_weight


def test_compute_loss_may_read_extra_state(tmp_path):
    trainer = make(tmp_path, WeightedLossTrainer, **{"train.num_steps": 10,
                                                     "precision.policy": "float32"})
    trainer.loss_weight.assign(0.0)  # Zero gradients: Adam without weight decay stands still.
    initial = trainer.model.get_weights()
    trainer.train()
    for before, after in zip(initial, trainer.model.get_weights()):
        np.testing.assert_array_equal(before, after)


def test_research_hooks_that_would_fail_later_are_one_line_at_construction(tmp_path):
    class PlainNumberState(tiny_experiment.TinyTrainer):
        def extra_state(self):
            return {"count": 3}

    class OutsideObjective(tiny_experiment.TinyTrainer):
        def build_objectives(self):  # A layer built on its own, not part of self.model.
            stray = keras.layers.Dense(2)
            stray.build((None, 8))
            return {"model": mixloop.Objective(stray, keras.optimizers.SGD(0.1))}

    with pytest.raises(UserError, match=r"extra_state\(\)\['count'\] is a int"):
        make(tmp_path / "a", PlainNumberState)
    with pytest.raises(UserError, match=r"not in build_model\(\)'s model"):
        make(tmp_path / "b", OutsideObjective)


@pytest.mark.parametrize("arguments", [dict(fn=None, every_steps=5), dict(fn=print, every_steps=2.5),
                                       dict(fn=print, every_steps="5"), dict(fn=print)])
def test_a_bad_action_is_one_line_before_anything_is_written(tmp_path, arguments):
    class BadAction(tiny_experiment.TinyTrainer):
        def actions(self):
            return [mixloop.Action(**arguments)]

    trainer = make(tmp_path, BadAction)
    with pytest.raises(UserError, match="mixloop.Action needs a callable fn"):
        trainer.train()
    assert not (tmp_path / "config.json").exists()
