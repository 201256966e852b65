"""The research recipes, run as written: every snippet of docs/recipes.md is read from the page,
executed against a tiny model, and what the text under it promises is checked.

A snippet is a fenced block preceded by `<!-- recipe: NAME -->`. A Python one runs in a namespace
holding only `keras`, `tf`, `mixloop` and the names the page says it assumes (`MyTrainer`, or
`trainer` and `inputs`), so a snippet that needs anything else fails here; tracebacks point at its
lines in docs/recipes.md.
"""

import cli_runs
import json
import logging
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
import tiny_experiment
from helpers import events

ROOT = cli_runs.REPO
PAGE = os.path.join(ROOT, "docs", "recipes.md")
RECIPES = ("train-metric", "objectives", "cadence", "gradient-penalty", "batch-loss", "ema",
           "ema-weights", "target-network", "weight-clipping", "actions", "action-metrics",
           "extra-state", "noise", "float32-state", "schedule", "frozen")
_RECIPE = re.compile(r"<!-- recipe: (?P<name>[\w-]+) -->\n```(?P<language>\w+)\n(?P<code>.*?)^```",
                     re.S | re.M)


def recipes() -> dict[str, tuple[str, str, int]]:
    """{name: (language, code, line of its first code line)} of the page's recipes."""
    with open(PAGE, encoding="utf-8") as file:
        text = file.read()
    return {match["name"]: (match["language"], match["code"],
                            text.count("\n", 0, match.start("code")) + 1)
            for match in _RECIPE.finditer(text)}


def run_recipe(name: str, **assumed) -> dict:
    """Executes the Python recipe `name` beside `assumed` names; returns its namespace."""
    language, code, line = recipes()[name]
    assert language == "python", f"recipe {name} is {language}, not python"
    namespace = {"keras": keras, "tf": tf, "mixloop": mixloop, **assumed}
    exec(compile("\n" * (line - 1) + code, PAGE, "exec"), namespace)
    return namespace


class MyTrainer(tiny_experiment.TinyTrainer):
    """The recipes' `MyTrainer`: tiny_experiment's three-class data, an MLP with a layer named
    `hidden`, a mean loss, and the default `eval_metrics`."""

    eval_metrics = mixloop.Trainer.eval_metrics

    def build_model(self):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))


class TinyGAN(keras.Model):
    """A generator (4 noise values -> 8 "pixels") and a discriminator (8 -> 16 -> 1 logit); it also
    returns the samples and, per example, a random mix in [0, 1] (a gradient penalty's)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="tanh")], name="generator")
        self.discriminator = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)],
            name="discriminator")
        self.seed_generator = keras.random.SeedGenerator(0)

    def call(self, inputs, training=False):
        real, noise = inputs
        fake = self.generator(noise, training=training)
        # In float32 under every policy: the same draws in float16 and float32 runs.
        mix = keras.random.uniform((keras.ops.shape(real)[0], 1), dtype="float32",
                                   seed=self.seed_generator)
        return {"real_logits": self.discriminator(real, training=training),
                "fake_logits": self.discriminator(fake, training=training), "fake": fake, "mix": mix}


class MyGANTrainer(MyTrainer):
    """The objectives recipe's `MyTrainer`: a TinyGAN on (real, noise) batches, no eval set."""

    def build_model(self):
        model = TinyGAN(name="gan")
        model((np.zeros((1, 8), np.float32), np.zeros((1, 4), np.float32)))
        return model

    def build_datasets(self):
        rng = np.random.default_rng(0)
        real = np.tanh(rng.normal(1.0, 0.5, size=(512, 8))).astype(np.float32)
        noise = rng.normal(size=(512, 4)).astype(np.float32)
        train = tf.data.Dataset.from_tensor_slices((real, noise)).batch(32, drop_remainder=True)
        return train, None

    def model_inputs(self, batch):
        return batch


class MyTwoTowerTrainer(MyTrainer):
    """The target-network recipe's `MyTrainer`: two MLPs alike, `online` and `target`; the online
    one classifies and predicts the target's logits (no gradient into the target)."""

    def build_model(self):
        inputs = keras.Input((8,))
        towers = {name: keras.Sequential([keras.layers.Dense(16, activation="tanh"),
                                          keras.layers.Dense(3)], name=name)
                  for name in ("online", "target")}
        return keras.Model(inputs, {name: tower(inputs) for name, tower in towers.items()})

    def compute_loss(self, outputs, batch):
        online, target = outputs["online"], tf.stop_gradient(outputs["target"])
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            batch[1], online, from_logits=True) + tf.reduce_sum(tf.square(online - target), -1))

    def eval_metrics(self, outputs, batch):
        return {"loss": self.compute_loss(outputs, batch)}


class MyTwoViewTrainer(MyTrainer):
    """The batch-loss recipe's `MyTrainer`: the two halves of each example's features are its two
    views, one encoder projects each."""

    def build_model(self):
        inputs = keras.Input((8,))
        encoder = keras.Sequential([keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)],
                                   name="encoder")
        return keras.Model(inputs, {"z1": encoder(inputs[:, :4]), "z2": encoder(inputs[:, 4:])})


def overflowing(trainer_class: type, objective: str = "", at_update: int = 3) -> type:
    """`trainer_class` whose loss (or loss `objective` of a dict) is 1e9 times larger at update
    `at_update` (1-based): finite in float32, an overflow in a float16 backward."""

    class Overflowing(trainer_class):
        def compute_loss(self, outputs, batch):
            losses = super().compute_loss(outputs, batch)
            boost = tf.where(tf.equal(self.global_step, at_update - 1), 1e9, 1.0)
            return {**losses, objective: losses[objective] * boost} if objective else losses * boost

    return Overflowing


def make(trainer_class: type, workdir, **overrides) -> mixloop.Trainer:
    """A `trainer_class` on tiny_experiment's config, float32, 10 updates, overridden by `overrides`
    ({"section.field": value}, or {"field": value} for a top-level one)."""
    config = tiny_experiment.get_config()
    config.precision.policy = "float32"
    config.train.num_steps = 10
    config.train.log_every_steps = 5
    config.eval.every_steps = 10
    config.checkpoint.every_steps = 10
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        with config.ignore_type():  # jit_compile: True, False or "auto".
            (config[section] if section else config)[field] = value
    return trainer_class(config, str(workdir))


def values(found: dict, tag: str) -> list:
    return [value for _, value in found[tag]]


def test_the_page_holds_every_recipe():
    assert sorted(recipes()) == sorted(RECIPES)


def test_train_metric_reaches_tensorboard_the_progress_line_and_eval(tmp_path, caplog):
    trainer_class = run_recipe("train-metric", MyTrainer=MyTrainer)["AccuracyTrainer"]
    trainer = make(trainer_class, tmp_path, **{"train.num_steps": 20, "train.log_every_steps": 10})
    caplog.set_level(logging.INFO)
    trainer.train()
    train, evaluation = events(str(tmp_path / "train")), events(str(tmp_path / "eval"))
    assert [step for step, _ in train["accuracy"]] == [10, 20]
    assert all(0.0 <= value <= 1.0 for value in values(train, "accuracy"))
    assert values(train, "accuracy")[-1] > 0.5  # Three classes: chance is about 1/3.
    assert 0.5 < values(evaluation, "accuracy")[-1] <= 1.0
    assert re.search(r"step 20/20 .*accuracy \d\.\d{4}", caplog.text)


def test_objectives_train_apart_with_their_own_scales_skips_and_tags(tmp_path):
    namespace = run_recipe("objectives", MyTrainer=MyGANTrainer)
    trainer_class = overflowing(namespace["GANTrainer"], objective="discriminator")
    # From a known scale (float16's default, `auto`, starts each where a probe says).
    trainer = make(trainer_class, tmp_path, **{"precision.policy": "mixed_float16",
                                               "precision.initial_scale": 2.0**15})
    players = (trainer.model.generator, trainer.model.discriminator)
    initial = [layer.get_weights() for layer in players]
    trainer.train()
    train = events(str(tmp_path / "train"))
    assert {f"{tag}/{name}" for name in ("generator", "discriminator")
            for tag in ("loss", "loss_scale", "skipped_steps", "skipped_total", "grad_norm",
                        "learning_rate")} <= set(train)
    assert values(train, "skipped_total/discriminator") == [1.0, 1.0]
    assert values(train, "skipped_total/generator") == [0.0, 0.0]
    assert values(train, "loss_scale/discriminator")[-1] == 2.0**14  # Backed off once.
    assert values(train, "loss_scale/generator")[-1] == 2.0**15
    assert int(trainer.objectives["discriminator"].optimizer.iterations.numpy()) == 9
    assert int(trainer.objectives["generator"].optimizer.iterations.numpy()) == 10
    for layer, before in zip(players, initial):
        assert not np.array_equal(layer.get_weights()[0], before[0])


def test_the_generator_every_5_steps_runs_at_steps_5_and_10_only(tmp_path):
    gan_trainer = run_recipe("objectives", MyTrainer=MyGANTrainer)["GANTrainer"]
    trainer_class = run_recipe("cadence", GANTrainer=gan_trainer)["WGANTrainer"]
    trainer = make(trainer_class, tmp_path, **{"precision.policy": "mixed_float16",
                                               "optimizer.schedule": "cosine"})
    generator = trainer.model.generator
    initial = generator.get_weights()
    trainer.train()
    objectives = trainer.objectives
    assert int(objectives["generator"].optimizer.iterations.numpy()) == 2
    assert int(objectives["discriminator"].optimizer.iterations.numpy()) == 10
    assert not np.array_equal(generator.get_weights()[0], initial[0])
    train = events(str(tmp_path / "train"))
    assert train["updates/generator"] == [(5, 1.0), (10, 1.0)]
    assert "updates/discriminator" not in train
    # The generator's cosine schedule runs over its own 10 // 5 = 2 updates: half-way at step 5
    # after 1 update, as the discriminator's after 5 of its 10.
    halfway = values(train, "learning_rate/discriminator")[0]
    assert halfway == pytest.approx(0.5 * trainer.config.optimizer.learning_rate)
    assert values(train, "learning_rate/generator") == pytest.approx([halfway, 0.0], abs=1e-9)


def test_a_batch_loss_under_accumulation_trains_as_the_whole_batch_does(tmp_path):
    trainer_class = run_recipe("batch-loss", MyTrainer=MyTwoViewTrainer)["ContrastiveTrainer"]
    runs = {}
    for k, batch_loss in [(1, False), (4, True), (4, False)]:
        trainer = make(trainer_class, tmp_path / f"{k}-{batch_loss}", **{
            "train.accumulation_steps": k, "train.batch_loss": batch_loss, "train.num_steps": 3,
            "train.log_every_steps": 1, "precision.policy": "mixed_float16",
            "optimizer.name": "sgd", "optimizer.learning_rate": 0.1})
        trainer.train()
        runs[k, batch_loss] = (trainer.model.get_weights(),
                               values(events(str(tmp_path / f"{k}-{batch_loss}" / "train")), "loss"))
    whole, two_passes, plain = runs[1, False], runs[4, True], runs[4, False]
    # float16 forwards of 8 rows against 32: the same to float16 rounding, in the loss and weights.
    np.testing.assert_allclose(two_passes[1], whole[1], rtol=2e-3)
    for a, b in zip(two_passes[0], whole[0]):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-4)
    # From the same initial weights, each micro-batch of 8 pairs picks among 15 candidates, not 63:
    # an easier task, a loss about log(63/15) = 1.4 nats lower (measured 1.6).
    assert plain[1][0] < whole[1][0] - 1.0


def test_the_gradient_penalty_trains_in_float16_as_in_float32(tmp_path):
    gan_trainer = run_recipe("objectives", MyTrainer=MyGANTrainer)["GANTrainer"]
    wgan_trainer = run_recipe("cadence", GANTrainer=gan_trainer)["WGANTrainer"]
    trainer_class = run_recipe("gradient-penalty", WGANTrainer=wgan_trainer)["WGANGPTrainer"]
    critics = {}
    for policy in ("float32", "mixed_float16"):
        # The penalty's second-order backward is larger than a mean loss's: at the default 2**15
        # the critic's first two updates overflow and are skipped while its scale backs off.
        trainer = make(trainer_class, tmp_path / policy, **{"precision.policy": policy,
                                                            "precision.initial_scale": 2.0**10,
                                                            "optimizer.name": "sgd",
                                                            "optimizer.learning_rate": 0.05,
                                                            "train.num_steps": 1,
                                                            "jit_compile": False})
        initial = trainer.model.discriminator.get_weights()
        trainer.train()
        assert trainer.run.state.skipped_totals() == {"generator": 0, "discriminator": 0}
        critics[policy] = [after - before for after, before
                           in zip(trainer.model.discriminator.get_weights(), initial)]
    # The critic's update, the penalty's second-order term included, agrees to float16's rounding.
    largest = max(np.max(np.abs(change)) for change in critics["float32"])
    for change16, change32 in zip(critics["mixed_float16"], critics["float32"]):
        np.testing.assert_allclose(change16, change32, rtol=0, atol=1e-2 * largest)


def test_ema_is_evaluated_exported_checkpointed_and_swapped_in(tmp_path):
    language, command, _ = recipes()["ema"]
    assert language == "sh"
    assert os.path.isfile(os.path.join(ROOT, re.search(r"--config=(\S+)", command)[1]))
    flags = dict(re.findall(r"--config\.([\w.]+)=(\S+)", command))
    assert list(flags) == ["train.ema_decay"]
    decay = float(flags["train.ema_decay"])

    class Recorded(MyTrainer):
        def actions(self):
            self.trained, self.seen_at_eval = [], []
            return [mixloop.Action(lambda step: self.trained.append(self.model.get_weights()),
                                   every_steps=1),
                    mixloop.Action(lambda step: self.seen_at_eval.append(self.model.get_weights()),
                                   at_eval=True)]

    trainer = make(Recorded, tmp_path, **{"train.ema_decay": decay})
    average = trainer.model.get_weights()
    trainer.train()
    for weights in trainer.trained:  # average <- decay * average + (1 - decay) * weight, in float32
        average = [np.float32(decay) * a + np.float32(1.0 - decay) * w
                   for a, w in zip(average, weights)]
    trained = trainer.model.get_weights()
    assert len(trainer.trained) == 10 and not np.allclose(average[0], trained[0])
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for ema, at_eval in zip(average, trainer.seen_at_eval[-1]):  # Eval-time actions see it.
        close(ema, at_eval)
    exported = keras.saving.load_model(str(tmp_path / "model.keras"))
    for ema, weight in zip(average, exported.get_weights()):
        close(ema, weight)

    inputs = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    ema_logits = run_recipe("ema-weights", trainer=trainer, inputs=inputs)["ema_logits"]
    np.testing.assert_allclose(ema_logits, exported(inputs), rtol=1e-5, atol=1e-6)
    for now, before in zip(trainer.model.get_weights(), trained):  # The trained weights are back.
        np.testing.assert_array_equal(now, before)

    resumed = make(Recorded, tmp_path, **{"train.ema_decay": decay})
    resumed.run.restore()
    with resumed.ema_weights():
        for ema, restored in zip(average, resumed.model.get_weights()):
            close(ema, restored)


def test_actions_write_text_at_eval_and_scalars_every_100_updates(tmp_path):
    trainer_class = run_recipe("actions", MyTrainer=MyTrainer)["SampleTrainer"]
    trainer = make(trainer_class, tmp_path, **{
        "train.num_steps": 100, "train.steps_per_loop": 50, "train.log_every_steps": 50,
        "eval.every_steps": 50, "checkpoint.every_steps": 100})
    trainer.train()
    predictions = events(str(tmp_path / "eval"))["predictions"]
    assert [step for step, _ in predictions] == [50, 100]
    assert all(re.fullmatch(r"\[[0-2 ]+\] for labels \[[0-2 ]+\]", text) for _, text in predictions)
    norm = np.sqrt(sum(np.sum(np.square(w)) for w in trainer.model.get_weights()))
    [(step, written)] = events(str(tmp_path / "train"))["weight_norm"]
    assert step == 100
    np.testing.assert_allclose(written, norm, rtol=1e-5)


def test_an_eval_time_actions_metric_joins_the_eval_summary(tmp_path, caplog):
    trainer_class = run_recipe("action-metrics", MyTrainer=MyTrainer)["ScoredTrainer"]
    trainer = make(trainer_class, tmp_path, jit_compile=False)
    with caplog.at_level(logging.INFO, logger="absl"):
        metrics = trainer.train()
    count = metrics["eval_classes_predicted"]
    assert count in (1.0, 2.0, 3.0)
    messages = [record.getMessage() for record in caplog.records]
    assert [m for m in messages if m.startswith("eval at step 10:")
            and f"classes_predicted {count:.4f}" in m]
    assert [m for m in messages if m.startswith("Finished at step 10")
            and f"classes_predicted {count:.4f}" in m.partition(" Eval: ")[2]]
    assert events(str(tmp_path / "eval"))["classes_predicted"] == [(10, count)]


DECAY, NUM_UPDATES = 0.99, 100  # The recipe's running mean: its decay, and the updates measured.


class Float16RunningMean(keras.layers.Layer):
    """The recipe's running mean as it reads without it: a plain weight, updated in float16."""

    def build(self, input_shape):
        self.mean = self.add_weight(shape=input_shape[-1:], initializer="zeros", trainable=False)

    def call(self, inputs, training=False):
        if training:
            self.mean.assign(DECAY * self.mean + (1 - DECAY) * tf.reduce_mean(inputs, axis=0))
        return inputs


class ValueReader(keras.layers.Layer):
    """Records the dtypes its call reads a plain weight in: itself and its `value`."""

    def build(self, input_shape):
        self.weight = self.add_weight(shape=(), initializer="ones")

    def call(self, inputs):
        self.read = (tf.convert_to_tensor(self.weight).dtype.name, self.weight.value.dtype.name)
        return inputs


def running_mean(layer: keras.layers.Layer, batches: np.ndarray) -> np.ndarray:
    """`layer`'s running mean after it is called in training on each of `batches`."""
    for batch in batches:
        layer(tf.constant(batch), training=True)
    return layer.mean.numpy()


def formula(batches: np.ndarray) -> np.ndarray:
    """The running mean of `batches`' feature means in float64."""
    mean = np.zeros(batches.shape[-1])
    for batch in batches.astype(np.float64):
        mean = DECAY * mean + (1 - DECAY) * batch.mean(0)
    return mean


def test_state_kept_float32_follows_its_formula_where_a_16_bit_read_drifts():
    running_mean_class = run_recipe("float32-state")["RunningMean"]
    batches = (0.3 + 0.05 * np.random.default_rng(0).normal(size=(NUM_UPDATES, 4, 256))).astype(
        np.float32)
    keras.config.set_dtype_policy("mixed_float16")
    try:
        reader = ValueReader()
        reader(tf.ones([1]))
        assert reader.read == ("float16", "float16")  # Autocast: `value` too.
        assert tf.convert_to_tensor(reader.weight).dtype == tf.float32  # Outside a call: float32.
        layers = {"plain": Float16RunningMean(), "no_autocast": running_mean_class(),
                  "float32": running_mean_class(dtype="float32")}
        means = {name: running_mean(layer, batches) for name, layer in layers.items()}
    finally:
        keras.config.set_dtype_policy("float32")
    exact, rounded_inputs = formula(batches), formula(batches.astype(np.float16))
    per_update = np.abs(formula(batches[:-1]) - exact).mean()
    np.testing.assert_allclose(means["float32"], exact, rtol=1e-6)
    np.testing.assert_allclose(means["no_autocast"], rounded_inputs, rtol=1e-6)
    drift = np.abs(means["plain"] - exact).max()
    assert drift > per_update and drift > 1e-2 * np.abs(exact).min()  # The docs' 2.6e-3 and 1.4%.


def test_extra_state_survives_a_stop_and_resume(tmp_path):
    trainer_class = run_recipe("extra-state", MyTrainer=MyTrainer)["CurriculumTrainer"]
    first = make(trainer_class, tmp_path, **{"train.num_steps": 10})
    first.train()
    assert int(first.curriculum.numpy()) == 2  # Steps 5 and 10.
    resumed = make(trainer_class, tmp_path, **{"train.num_steps": 20})
    assert int(resumed.curriculum.numpy()) == 0
    resumed.train()
    assert int(resumed.run.global_step.numpy()) == 20
    assert int(resumed.curriculum.numpy()) == 4  # Restored to 2, then steps 15 and 20.
    again = make(trainer_class, tmp_path, **{"train.num_steps": 20})
    again.run.restore()
    assert int(again.curriculum.numpy()) == 4


def test_noise_at_eval_leaves_a_stopped_and_resumed_run_bit_identical(tmp_path):
    trainer_class = run_recipe("noise", MyTrainer=MyTrainer)["NoisyTrainer"]
    straight = make(trainer_class, tmp_path / "straight", **{"eval.every_steps": 10})
    straight_metrics = straight.train()
    make(trainer_class, tmp_path / "resumed", **{"train.num_steps": 5}).train()  # Evaluates at 5.
    resumed = make(trainer_class, tmp_path / "resumed", **{"eval.every_steps": 10})
    resumed_metrics = resumed.train()
    for a, b in zip(straight.model.variables, resumed.model.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert resumed_metrics["eval_loss"] == straight_metrics["eval_loss"]
    state = [v for v in straight.model.variables if "seed_generator" in v.path]
    # Drawn once per micro-batch of the 10 updates, not at the evals.
    assert len(state) == 1
    assert int(state[0].numpy()[1]) == 10 * straight.config.train.accumulation_steps


def test_schedule_advances_once_per_applied_update(tmp_path):
    namespace = run_recipe("schedule", MyTrainer=MyTrainer)
    schedule = namespace["InverseSqrt"](1e-3, warmup_steps=100)
    trainer = make(overflowing(namespace["ScheduledTrainer"]), tmp_path,
                   **{"precision.policy": "mixed_float16"})
    trainer.train()
    [objective] = trainer.objectives.values()
    assert int(objective.optimizer.iterations.numpy()) == 9  # Update 3 skipped.
    train = events(str(tmp_path / "train"))
    assert values(train, "skipped_total") == [1.0, 1.0]
    # Updates 1, 2, 4, 5 applied by step 5; 9 by step 10.
    assert values(train, "learning_rate") == [float(schedule(4)), float(schedule(9))]
    assert float(objective.optimizer.learning_rate) == float(schedule(9))


def test_frozen_layer_is_untouched_but_checkpointed_and_exported(tmp_path):
    trainer_class = run_recipe("frozen", MyTrainer=MyTrainer)["FineTuneTrainer"]
    trainer = make(trainer_class, tmp_path, **{"optimizer.weight_decay": 0.1})
    hidden, logits = trainer.model.get_layer("hidden"), trainer.model.get_layer("logits")
    initial = {"hidden": hidden.get_weights(), "logits": logits.get_weights()}
    trainer.train()
    for now, before in zip(hidden.get_weights(), initial["hidden"]):
        np.testing.assert_array_equal(now, before)
    assert not np.array_equal(logits.get_weights()[0], initial["logits"][0])
    [objective] = trainer.objectives.values()
    frozen_shapes = {tuple(w.shape) for w in initial["hidden"]}  # (8, 16) and (16,): only hidden's.
    assert not frozen_shapes & {tuple(v.shape) for v in objective.optimizer.variables}  # No slots.
    saved = tf.train.list_variables(trainer.run.checkpoints.latest_checkpoint)
    model_entries = [name for name, _ in saved
                     if name.startswith("model_variables/") and name.endswith("VARIABLE_VALUE")]
    assert len(model_entries) == len(trainer.model.variables) == 4
    exported = keras.saving.load_model(str(tmp_path / "model.keras"))
    exported_hidden = exported.get_layer("hidden").get_weights()
    np.testing.assert_array_equal(exported_hidden[0], initial["hidden"][0])


def test_a_momentum_target_follows_each_applied_update_and_resumes_bit_identical(tmp_path):
    """In mixed_float16 with 2 micro-batches and an overflow at update 3: after each update the
    target is the EMA formula over the online weights of the updates applied (NumPy, float32), and
    a run stopped at 3 and resumed ends bit-identical to a straight one."""
    trainer_class = overflowing(run_recipe("target-network", MyTrainer=MyTwoTowerTrainer)[
        "MomentumTargetTrainer"], at_update=3)

    class Recorded(trainer_class):
        def actions(self):
            self.seen = []
            return [mixloop.Action(self.record, every_steps=1)]

        def record(self, step):
            self.seen.append((int(self.objectives["model"].optimizer.iterations.numpy()),
                              [v.numpy() for v in self.model.get_layer("online").weights],
                              [v.numpy() for v in self.model.get_layer("target").weights]))

    settings = {"precision.policy": "mixed_float16", "precision.initial_scale": 2.0**15,
                "train.accumulation_steps": 2, "train.num_steps": 6, "eval.every_steps": 6,
                "checkpoint.every_steps": 3, "jit_compile": False,
                "precision.float32_layers": ""}  # No probe: it is not what this tests.
    straight = make(Recorded, tmp_path / "straight", **settings)
    expected = [v.numpy() for v in straight.model.get_layer("online").weights]
    straight.train()
    applied = 0
    for iterations, online, target in straight.seen:
        if iterations > applied:  # An applied update: the target took one step toward online.
            expected = [np.float32(0.99) * t + np.float32(1.0 - 0.99) * o
                        for t, o in zip(expected, online)]
        applied = iterations
        for actual, formula in zip(target, expected):
            np.testing.assert_allclose(actual, formula, rtol=1e-7, atol=0)
    assert [iterations for iterations, _, _ in straight.seen] == [1, 2, 2, 3, 4, 5]

    make(Recorded, tmp_path / "resumed", **{**settings, "train.num_steps": 3}).train()
    resumed = make(Recorded, tmp_path / "resumed", **settings)
    resumed.train()
    for a, b in zip(straight.model.variables, resumed.model.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_the_precision_probe_measures_a_target_network_frozen_in_build_objectives(tmp_path):
    """The probe's float32 twin comes from `build_model` alone: without the model's trainable flags
    its non-trainable variables did not pair with the model's (the target's kernel took a bias's
    values: a ValueError at start)."""
    class NormalizedTowers(MyTwoTowerTrainer):  # Non-trainable state: BatchNorm's statistics.
        def build_model(self):
            inputs = keras.Input((8,))
            towers = {name: keras.Sequential([keras.layers.Dense(16), keras.layers.BatchNormalization(),
                                              keras.layers.Dense(3)], name=name)
                      for name in ("online", "target")}
            return keras.Model(inputs, {name: tower(inputs) for name, tower in towers.items()})

    trainer_class = run_recipe("target-network", MyTrainer=NormalizedTowers)["MomentumTargetTrainer"]
    trainer = make(trainer_class, tmp_path, **{"precision.policy": "mixed_float16",
                                               "train.num_steps": 2, "jit_compile": False})
    trainer.train()  # float32_layers and initial_scale "auto": the probe runs first.
    report = json.loads((tmp_path / "precision" / "report-step-0.json").read_text())
    gradients = {v["path"]: v["max_abs"] for v in report["variables"]}
    assert gradients and all(not path.startswith("target/") for path in gradients)
    assert all(value > 0 for value in gradients.values())


def test_weight_clipping_keeps_the_critic_in_its_box_and_leaves_the_generator(tmp_path):
    gan_trainer = run_recipe("objectives", MyTrainer=MyGANTrainer)["GANTrainer"]
    trainer_class = run_recipe("weight-clipping", GANTrainer=gan_trainer)["ClippedCriticTrainer"]
    trainer = make(trainer_class, tmp_path, **{"precision.policy": "mixed_bfloat16"})
    trainer.train()
    critic = [v.numpy() for v in trainer.model.discriminator.trainable_weights]
    assert max(np.abs(w).max() for w in critic) == np.float32(0.01)  # Clipped, in float32.
    assert max(np.abs(v.numpy()).max() for v in trainer.model.generator.trainable_weights) > 0.1


@pytest.mark.parametrize("decay", [0.99, 0.999])
def test_the_target_network_stays_float32_under_bfloat16_master_weights(tmp_path, decay):
    """The recipe with `precision.master_weights="bfloat16"`: the target, which no optimizer
    trains, keeps float32, and its after_update reads the online weights cast up, so after 60
    updates it is the float32 average of the bfloat16 online weights, every value moved."""
    language, code, line = recipes()["target-network"]
    assert "decay = 0.99\n" in code
    namespace = {"keras": keras, "tf": tf, "mixloop": mixloop, "MyTrainer": MyTwoTowerTrainer}
    exec(compile("\n" * (line - 1) + code.replace("decay = 0.99\n", f"decay = {decay}\n"), PAGE,
                 "exec"), namespace)

    class Recorded(namespace["MomentumTargetTrainer"]):
        def actions(self):
            self.online_after = []
            return [mixloop.Action(lambda step: self.online_after.append(
                [v.numpy().astype(np.float32) for v in self.model.get_layer("online").weights]),
                every_steps=1)]

    trainer = make(Recorded, tmp_path, **{
        "precision.policy": "mixed_bfloat16", "precision.master_weights": "bfloat16",
        "optimizer.name": "adam", "train.num_steps": 60, "eval.every_steps": 60,
        "checkpoint.every_steps": 60, "jit_compile": False})
    target = trainer.model.get_layer("target")
    assert all(v.dtype == "float32" for v in target.weights)
    assert all(v.dtype == "bfloat16" for v in trainer.model.get_layer("online").weights)
    start = [v.numpy() for v in target.weights]
    trainer.train()
    expected = [value.copy() for value in start]
    for online in trainer.online_after:  # Every update applies in bfloat16 (no loss scale).
        expected = [np.float32(decay) * t + np.float32(1.0 - decay) * o for t, o in zip(expected, online)]
    for initial, average, actual in zip(start, expected, [v.numpy() for v in target.weights]):
        movement = np.linalg.norm(average - initial)
        assert np.linalg.norm(actual - average) <= 1e-5 * movement  # Float32 rounding, not bfloat16's.
        assert np.mean(actual == initial) < 0.05  # Every value moved.
