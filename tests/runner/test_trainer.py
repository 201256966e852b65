"""The Trainer in-process: workdir contents, TensorBoard tags, resume equivalence, export."""

import cli_runs
import glob
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny_experiment

import mixloop
from mixloop.config import ConfigError
from mixloop.engine.loss_scale import DynamicLossScale, NoLossScale
from mixloop.errors import UserError
from mixloop.runner.precision_setup import make_loss_scale, make_policy
from mixloop.runner import compile_mode

TRAIN_TAGS = {"loss", "loss_scale", "skipped_steps", "skipped_total", "grad_norm", "learning_rate",
              "steps_per_sec", "examples_per_sec"}


def read_events(directory):
    """{tag: [(step, value), ...]} from the event files in `directory`."""
    scalars = {}
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                number = float(tf.make_ndarray(value.tensor))
                scalars.setdefault(value.tag, []).append((event.step, number))
    return scalars


def make_trainer(workdir, **overrides):
    config = tiny_experiment.get_config()
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    return tiny_experiment.TinyTrainer(config, str(workdir))


def test_train_writes_the_workdir(tmp_path):
    trainer = make_trainer(tmp_path)
    metrics = trainer.train()

    assert int(trainer.run.global_step.numpy()) == 40
    assert metrics["eval_accuracy"] > 0.5  # Three balanced classes: chance is 1/3.
    assert set(os.listdir(tmp_path)) >= {"config.json", "checkpoints", "train", "eval", "model.keras"}
    saved_steps = sorted(int(p.split("-")[-1].split(".")[0])
                         for p in glob.glob(str(tmp_path / "checkpoints" / "ckpt-*.index")))
    assert saved_steps == [20, 40]

    train_events = read_events(tmp_path / "train")
    assert TRAIN_TAGS <= set(train_events)
    assert [step for step, _ in train_events["loss"]] == [10, 20, 30, 40]
    # float16's default initial_scale=auto: where the probe put it, recorded in config.json.
    started = json.load(open(tmp_path / "config.json"))["resolved"]["precision.initial_scale"]
    assert train_events["loss_scale"][-1][1] == started
    assert {"loss", "accuracy"} <= set(read_events(tmp_path / "eval"))


def test_export_is_float32_with_the_trained_weights(tmp_path):
    trainer = make_trainer(tmp_path, **{"train.num_steps": 10})
    trainer.train()
    exported = keras.models.load_model(tmp_path / "model.keras")

    assert {v.dtype for v in exported.trainable_variables} == {"float32"}
    assert exported.get_layer("logits").compute_dtype == "float32"
    assert all(layer.compute_dtype == "float32" for layer in exported.layers)
    for saved, trained in zip(exported.get_weights(), trainer.model.get_weights()):
        np.testing.assert_array_equal(saved, trained)


def test_resumed_run_is_bit_identical(tmp_path):
    """20 steps, stop, resume to 40 == 40 steps straight (dropout, shuffling and loss scale included)."""
    deterministic = {"deterministic": True}
    straight = make_trainer(tmp_path / "straight", **deterministic)
    straight.train()

    make_trainer(tmp_path / "resumed", **deterministic, **{"train.num_steps": 20}).train()
    resumed = make_trainer(tmp_path / "resumed", **deterministic)
    resumed.train()

    assert int(resumed.run.global_step.numpy()) == 40
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(straight.objectives["model"].optimizer.variables,
                    resumed.objectives["model"].optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_finished_run_does_nothing_more(tmp_path):
    make_trainer(tmp_path, **{"train.num_steps": 10}).train()
    again = make_trainer(tmp_path, **{"train.num_steps": 10})
    again.train()
    assert int(again.run.global_step.numpy()) == 10
    assert int(again.objectives["model"].optimizer.iterations.numpy()) == 10


def test_auto_policy_on_cpu_is_float32_and_says_why():
    policy, reason = make_policy("auto")
    assert policy.compute_dtype == tf.float32
    assert "auto chose float32" in reason and "CPU" in reason


@pytest.mark.parametrize("policy, expected", [
    ("mixed_float16", DynamicLossScale), ("mixed_bfloat16", NoLossScale), ("float32", NoLossScale),
])
def test_dynamic_loss_scale_only_where_float16_needs_it(policy, expected):
    config = tiny_experiment.get_config().precision
    assert type(make_loss_scale(config, make_policy(policy)[0])) is expected


def test_one_device_strategy_trains_and_resumes(tmp_path):
    trainer = make_trainer(tmp_path, distribution="one_device", **{"train.num_steps": 10})
    trainer.train()
    resumed = make_trainer(tmp_path, distribution="one_device", **{"train.num_steps": 20})
    resumed.train()
    assert int(resumed.run.global_step.numpy()) == 20


def test_accumulation_must_split_each_replica_slice(tmp_path):
    with pytest.raises(ConfigError, match=r"batch_size=32 does not split into 2 replica\(s\) x 32"):
        make_trainer(tmp_path, distribution="mirrored", **{"train.accumulation_steps": 32})


def test_xla_with_replicas_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="jit_compile=True is not supported with more than one"):
        make_trainer(tmp_path, distribution="mirrored", jit_compile=True)


@pytest.mark.parametrize("jit_compile, num_replicas, expected", [
    ("auto", 1, None), ("auto", 2, False), (True, 1, True), (False, 1, False), (False, 2, False),
])
def test_xla_is_as_configured_measured_with_one_replica_and_off_with_two(jit_compile, num_replicas,
                                                                          expected):
    assert compile_mode.configured(jit_compile, num_replicas)[0] is expected


def test_a_short_default_run_compiles_with_xla_on_one_device_and_without_on_two(tmp_path):
    one = make_trainer(tmp_path / "one", **{"precision.policy": "float32"})  # No rule keeps XLA out.
    two = make_trainer(tmp_path / "two", distribution="mirrored")
    assert one.run.jit_compile is None and not two.run.jit_compile
    one.train()
    two.train()
    # Two micro-batches: with XLA, the loop's body is what XLA compiles.
    assert one.run.jit_compile and one.run.train_step.gradient_source.bodies[0]._jit_compile
    assert not two.run.jit_compile and not two.run.train_step.compiled._jit_compile


class MetricTrainer(tiny_experiment.TinyTrainer):
    """The tiny experiment with a train metric beside its loss."""

    metric_name = "accuracy"
    eval_metrics = mixloop.Trainer.eval_metrics  # the default: the loss and the train metrics

    def compute_loss(self, outputs, batch):
        correct = tf.equal(tf.argmax(outputs, -1, output_type=tf.int32), batch[1])
        return mixloop.Loss(super().compute_loss(outputs, batch),
                            metrics={self.metric_name: tf.reduce_mean(tf.cast(correct, tf.float32))})


def train_metric_run(workdir, **overrides):
    config = tiny_experiment.get_config()
    config.precision.policy = "float32"
    config.model.dropout = 0.0  # Replicas draw their own dropout masks.
    config.deterministic = True
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    trainer = MetricTrainer(config, str(workdir))
    trainer.train()
    return read_events(workdir / "train")


def test_a_train_metric_is_written_and_logged_the_same_whatever_accumulation_and_replicas(tmp_path, caplog):
    caplog.set_level("INFO")
    runs = {name: train_metric_run(tmp_path / name, **overrides) for name, overrides in {
        "k2": {}, "k1": {"train.accumulation_steps": 1}, "k4": {"train.accumulation_steps": 4},
        "mirrored": {"distribution": "mirrored"}}.items()}
    reference = runs["k2"]["accuracy"]
    assert [step for step, _ in reference] == [10, 20, 30, 40]
    assert 0.4 < reference[-1][1] <= 1.0 and reference[-1][1] > reference[0][1]
    for name, events in runs.items():
        np.testing.assert_allclose([v for _, v in events["accuracy"]], [v for _, v in reference],
                                   rtol=1e-5, err_msg=name)
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 40/40")]
    assert progress and f"accuracy {reference[-1][1]:.4f}" in progress[0]
    assert {"loss", "accuracy"} <= set(read_events(tmp_path / "k2" / "eval"))


def test_a_train_metric_named_like_a_built_in_tag_is_refused(tmp_path):
    class ClashingTrainer(MetricTrainer):
        metric_name = "loss_scale"

    with pytest.raises(UserError, match="compute_loss returns a metric named 'loss_scale', which the "
                                        "framework writes itself; rename it"):
        ClashingTrainer(tiny_experiment.get_config(), str(tmp_path))


def test_a_learning_rate_changed_for_the_resumed_run_takes_effect(tmp_path, caplog):
    caplog.set_level("INFO")
    make_trainer(tmp_path, **{"train.num_steps": 20}).train()
    resumed = make_trainer(tmp_path, **{"optimizer.learning_rate": 2e-2})
    resumed.run.restore()
    optimizer = resumed.objectives["model"].optimizer
    assert float(optimizer.learning_rate) == pytest.approx(2e-2)
    assert int(optimizer.iterations.numpy()) == 20  # The rest of the optimizer's state is restored.
    assert "learning rate 0.02 from the config (the checkpoint had 0.01)" in caplog.text
    resumed.train()
    learning_rates = dict(read_events(str(tmp_path / "train"))["learning_rate"])
    assert learning_rates[20] == pytest.approx(1e-2) and learning_rates[40] == pytest.approx(2e-2)


class UnevenEvalTrainer(tiny_experiment.TinyTrainer):
    """Eval batches of 64 and then 1 example: 65 examples."""

    def build_datasets(self):
        train, _ = super().build_datasets()
        features = np.arange(65 * 8, dtype="float32").reshape(65, 8) / 100.0
        labels = np.zeros(65, "int32")
        return train, tf.data.Dataset.from_tensor_slices((features, labels)).batch(64)

    def eval_metrics(self, outputs, batch):
        return {"first_feature": tf.reduce_mean(batch[0][:, 0])}


def test_eval_weights_each_batch_by_its_examples(tmp_path):
    trainer = UnevenEvalTrainer(tiny_experiment.get_config(), str(tmp_path))
    expected = np.mean(np.arange(65 * 8, dtype="float32").reshape(65, 8)[:, 0] / 100.0)
    assert trainer.evaluate()["first_feature"] == pytest.approx(expected, rel=1e-6)


def test_the_readme_snippet_reads_the_train_scalars(tmp_path):
    make_trainer(tmp_path, **{"train.num_steps": 20}).train()
    readme = open(os.path.join(cli_runs.REPO, "README.md")).read()
    snippet = readme.split("<!-- snippet: read-scalars -->\n```python\n")[1].split("```")[0]
    namespace = {}
    exec(snippet.replace('"runs/charlm/train"', repr(str(tmp_path / "train"))), namespace)
    assert namespace["loss"] == read_events(str(tmp_path / "train"))["loss"]


class RareObjectiveTrainer(tiny_experiment.TinyTrainer):
    """TinyTrainer whose one objective is updated every 1000 steps."""

    def build_objectives(self):
        return {"model": mixloop.Objective(self.model, mixloop.build_optimizer(
            self.config, every_steps=1000), every_steps=1000)}


def test_an_objective_that_never_updates_in_the_run_is_warned_of_in_one_line(tmp_path, caplog):
    caplog.set_level("WARNING")
    config = tiny_experiment.get_config()  # 40 steps.
    config.precision.policy = "float32"
    RareObjectiveTrainer(config, str(tmp_path))
    assert [r.getMessage() for r in caplog.records if "never updates" in r.getMessage()] == [
        "Objective 'model' never updates in this run: every_steps=1000 is more than "
        "train.num_steps=40; lower its every_steps or raise train.num_steps"]


# A researcher's names and the framework's: the framework's machinery lives in `trainer.run`, so a
# subclass's own `state`, `export` or `checkpoints` is its own; the few names the framework lends
# the subclass are refused in one line at construction when the subclass takes them.

class OwnNamesTrainer(tiny_experiment.TinyTrainer):
    """Attributes and methods named as the framework's machinery once was (no longer a clash)."""

    def build_model(self):
        self.state = "the researcher's own"
        self.checkpoints = []
        return super().build_model()

    def export(self):
        return "the researcher's export"


def test_a_researchers_own_state_and_export_do_not_touch_the_run(tmp_path):
    trainer = OwnNamesTrainer(tiny_experiment.get_config(), str(tmp_path / "run"))
    trainer.train()
    assert int(trainer.run.global_step.numpy()) == 40
    assert trainer.state == "the researcher's own" and trainer.export() == "the researcher's export"
    assert os.path.exists(tmp_path / "run" / "model.keras")  # The run's export still ran.


class DefinesPolicy(tiny_experiment.TinyTrainer):
    policy = "mixed_float16"


class DefinesTrain(tiny_experiment.TinyTrainer):
    def train(self):
        return {}


class AssignsModel(tiny_experiment.TinyTrainer):
    def build_model(self):
        self.model = super().build_model()
        return self.model


@pytest.mark.parametrize("trainer_class, line", [
    (DefinesPolicy, "DefinesPolicy defines 'policy', a name mixloop's Trainer keeps for the run's "
                    "precision policy (a mixloop.Policy); give yours another name (e.g. self.my_policy)"),
    (DefinesTrain, "DefinesTrain defines 'train', a name mixloop's Trainer keeps for mixloop's own "
                   "Trainer.train; give yours another name (e.g. self.my_train)"),
    (AssignsModel, "AssignsModel assigns 'model', a name mixloop's Trainer keeps for the model "
                   "build_model() returned, as the run placed it; give yours another name"),
], ids=["class attribute", "method", "assigned in a hook"])
def test_a_subclass_taking_a_framework_name_is_one_line_at_construction(tmp_path, trainer_class, line):
    config = tiny_experiment.get_config()
    with pytest.raises(UserError) as raised:
        trainer_class(config, str(tmp_path))
    assert str(raised.value).startswith(line)
    assert not os.listdir(tmp_path)  # Refused before the run wrote anything.
