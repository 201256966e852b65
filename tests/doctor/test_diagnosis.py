"""The precision doctor: planted problems found and cured, its files, `python -m mixloop.diagnose`."""

import functools
import glob
import json
import math
import os
import sys

import cli_runs
import hot_experiment
import keras
import numpy as np
import pytest
import second_order_experiment
import tensorflow as tf
import tiny_experiment

import mixloop
from mixloop.cli import import_trainer
from mixloop.engine.objective import SINGLE
from mixloop.engine.micro_step import forward
from mixloop.errors import UserError
from mixloop.doctor.memory import PARTS, LighterOption, PersistentState
from mixloop.tools import diagnose as diagnose_cli
from mixloop.doctor.diagnosis import diagnose, diagnose_objectives
from mixloop.doctor.report import DtypeRange

FIXTURES_DIR = cli_runs.FIXTURES_DIR
FLOAT16 = DtypeRange.of(tf.float16)
LOUD_FACTOR = 1e3  # Multiplies the loud model's loss, so its gradients overflow float16 at 2^15.


class LoudTrainer(hot_experiment.FaintTrainer):
    """The faint experiment's MLP with a loss 1e3 times the plain one: gradients up to about 1e3,
    which overflow float16 at the default loss scale 2^15 from a forward pass that fits."""

    def compute_loss(self, outputs, batch):
        return LOUD_FACTOR * hot_experiment.HotTrainer.compute_loss(self, outputs, batch)


class ZeroGradientTrainer(hot_experiment.HotTrainer):
    """Gradients that are zero in exact arithmetic: the bias of `centered`, which batch normalization
    subtracts again, and the kernel of `fed_zeros`, whose inputs are all zero."""

    def build_model(self):
        inputs = keras.Input((8,))
        centered = keras.layers.Dense(16, name="centered")(inputs)
        normalized = keras.layers.BatchNormalization(name="norm")(centered)
        zeros = keras.layers.Rescaling(0.0, name="zeros")(inputs)
        fed_zeros = keras.layers.Dense(4, name="fed_zeros")(zeros)
        x = keras.layers.Concatenate(name="both")([normalized, fed_zeros])
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))


class TwoHeadTrainer(hot_experiment.FaintTrainer):
    """Two objectives on the faint experiment's data: `a`, the body and head `a`, with the plain loss,
    and `b`, head `b` alone, with a loss LOUD_FACTOR times as large, whose gradients alone overflow
    float16 at the default loss scale 2^15."""

    def build_model(self):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu", name="body")(inputs)
        return keras.Model(inputs, {"a": keras.layers.Dense(3, name="a")(hidden),
                                    "b": keras.layers.Dense(3, name="b")(hidden)})

    def build_objectives(self):
        a = keras.Sequential([self.model.get_layer("body"), self.model.get_layer("a")])
        return {"a": mixloop.Objective(a, keras.optimizers.Adam(1e-3)),
                "b": mixloop.Objective(self.model.get_layer("b"), keras.optimizers.Adam(1e-3))}

    def compute_loss(self, outputs, batch):
        loss = lambda logits: hot_experiment.HotTrainer.compute_loss(self, logits, batch)
        return {"a": loss(outputs["a"]), "b": LOUD_FACTOR * loss(outputs["b"])}


class AddNoise(keras.layers.Layer):
    """Adds unit Gaussian noise, in training as `keras.layers.GaussianNoise` does but from its own
    `SeedGenerator` (a GAN's noise, say), which the doctor does not switch to inference mode."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1)

    def call(self, x):
        return x + keras.random.normal(keras.ops.shape(x), dtype=self.compute_dtype,
                                       seed=self.seed_generator)


class NoisyTrainer(hot_experiment.FaintTrainer):
    """The faint experiment's MLP, with the plain loss, reading its inputs with noise added."""

    def build_model(self):
        inputs = keras.Input((8,))
        x = keras.layers.Dense(16, activation="relu", name="body")(AddNoise(name="noise")(inputs))
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))

    compute_loss = hot_experiment.HotTrainer.compute_loss


def make_trainer(module, workdir, arg=None, **overrides):
    """The experiment's Trainer, with `overrides` given as {"section.field": value}."""
    config = module.get_config(arg)
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    return import_trainer(config.trainer)(config, str(workdir))


@pytest.fixture(scope="module")
def hot_report(tmp_path_factory):
    return diagnose(make_trainer(hot_experiment, tmp_path_factory.mktemp("hot")).run, num_batches=2)


def test_dtype_ranges_count_in_powers_of_two():
    float16 = DtypeRange.of(tf.float16)
    assert (float16.max_finite, float16.min_normal, float16.min_subnormal) == (65504, 2.0**-14, 2.0**-24)
    assert DtypeRange.of(tf.bfloat16).min_normal == 2.0**-126
    assert float16.headroom_bits(65504 / 8) == 3.0
    assert float16.eps == 2.0**-10 and DtypeRange.of(tf.bfloat16).eps == 2.0**-7
    # 1.0 * 2**12 leaves 65504 / 4096 = 15.99 = 3.99 doublings; 2**13 would leave fewer than 3.
    assert float16.safe_log2_scale(1.0, margin_bits=3) == 12
    assert float16.safe_log2_scale(65504 / 8, margin_bits=3) == 0
    # Bin k holds [2**k, 2**(k+1)); float16 rounds magnitudes up to 2**-25 to zero.
    histogram = {-27: 1, -26: 1, -25: 1, 0: 1}
    assert float16.zero_fraction(histogram) == 0.5
    assert float16.zero_fraction(histogram, log2_scale=1) == 0.25
    assert float16.zero_fraction(histogram, log2_scale=-1) == 0.75


def test_a_hot_layer_is_reported_as_overflowing_and_advised_to_float32(hot_report):
    layers = {layer.path: layer for layer in hot_report.layers}
    hot, squash = layers["hot"], layers["squash"]

    assert hot.max_abs_output > 65504 and hot.headroom_bits == math.log2(65504 / hot.max_abs_output)
    assert hot.creates_non_finite and hot.non_finite_outputs > 0
    # `squash` reads hot's values (its inputs overflow float16 too) but did not create the infs.
    assert squash.max_abs_input == hot.max_abs_output and not squash.creates_non_finite
    assert [p.split(" ")[0] for p in hot_report.advice.problems] == ["hot", "squash"]
    assert hot_report.advice.float32_layers == ["hot", "squash"]
    assert hot_report.advice.float32_layers_regex == "hot|squash"
    assert hot_report.advice.bfloat16_safe
    assert hot_report.advice.bfloat16_headroom_bits > 100


def test_faint_gradients_underflow_until_the_advised_scale_is_applied(tmp_path):
    report = diagnose(make_trainer(hot_experiment, tmp_path, "faint").run, num_batches=2)
    assert report.loss_scale == 1.0
    assert report.gradient_zero_fraction > 0.99
    assert "gradients underflow at loss scale 1" in report.advice.problems[0]
    advice = report.advice
    assert math.log2(advice.initial_scale).is_integer()
    # The largest power of two that keeps MARGIN_BITS = 3 doublings below float16's largest value.
    assert advice.initial_scale * advice.largest_gradient * 2**3 <= 65504
    assert advice.initial_scale * advice.largest_gradient * 2**4 > 65504
    assert advice.overrides == {"precision.loss_scale": "dynamic",
                                "precision.initial_scale": advice.initial_scale,
                                "precision.max_scale": advice.initial_scale}

    cured = diagnose(make_trainer(hot_experiment, tmp_path, "faint", **advice.overrides).run, num_batches=2)
    assert cured.loss_scale == advice.initial_scale
    assert cured.gradient_zero_fraction < 0.01
    assert cured.gradient_zero_fraction == pytest.approx(advice.initial_scale_zero_fraction)
    assert all(v.mixed_zero_fraction < 0.01 for v in cured.variables)
    assert cured.advice.problems == []


def test_gradients_that_the_default_scale_keeps_start_at_it_though_a_higher_start_is_safe(tmp_path):
    # Gradients near 3e-9: 2^15 keeps them, 2^41 would leave 3 doublings below 65504.
    report = diagnose(make_trainer(hot_experiment, tmp_path, "faint", **{"model.loss_factor": 1e-8}).run,
                      num_batches=2)
    assert report.gradient_zero_fraction > 0.99  # At the faint experiment's loss scale of 1.
    assert 65504 / (report.advice.largest_gradient * 2**3) > 2.0**40
    assert report.advice.initial_scale == 2.0**15
    assert report.advice.initial_scale_zero_fraction < 0.01


def test_the_advice_cures_a_run_that_skipped_every_step(tmp_path, hot_report):
    # Plain float16 (the automatic settings, its defaults, would apply the advice themselves).
    before = make_trainer(hot_experiment, tmp_path / "before", **{
        "precision.float32_layers": "", "precision.initial_scale": 2.0**15})
    # The divergence guard stops a run as soon as the float32 loss is NaN.
    with pytest.raises(UserError, match="diverged at step 1: the float32 loss is nan"):
        before.train()
    assert before.run.state.skipped_totals() == {SINGLE: int(before.run.global_step.numpy())} == {SINGLE: 1}

    after = make_trainer(hot_experiment, tmp_path / "after", **hot_report.advice.overrides)
    after.train()
    assert after.run.state.skipped_totals() == {SINGLE: 0}
    assert float(after.objectives[SINGLE].loss_scale.scale) == hot_report.advice.initial_scale


def test_a_healthy_model_has_no_problems_and_is_left_bit_identical(tmp_path):
    trainer = make_trainer(tiny_experiment, tmp_path)
    variables = [v.numpy() for v in trainer.model.variables]
    report = diagnose(trainer.run, num_batches=2)

    assert report.num_micro_batches == 4  # accumulation_steps=2, as the train step splits them.
    assert [layer.compute_dtype for layer in report.layers] == ["float16", "float16", "float32"]
    assert report.advice.problems == [] and report.advice.float32_layers == []
    assert report.gradient_zero_fraction == 0 and report.gradient_overflow_fraction == 0
    assert max(v.relative_error for v in report.variables) < 0.05
    for before, after in zip(variables, trainer.model.variables):
        np.testing.assert_array_equal(before, after.numpy())


def largest_16bit_gradient(report):
    return max([v.max_abs for v in report.variables if v.dtype == "float16"]
               + [l.max_abs_output_grad for l in report.layers if l.compute_dtype == "float16"])


def test_gradients_that_overflow_at_the_loss_scale_are_compared_at_a_lower_one(tmp_path):
    report = diagnose(make_trainer(hot_experiment, tmp_path, trainer=f"{__name__}.LoudTrainer").run,
                      num_batches=2)

    # The overflow at the examined scale stays a finding of its own.
    assert report.loss_scale == 2.0**15
    assert report.gradient_overflow_fraction > 0.5
    assert report.advice.problems[0].startswith("gradients overflow at loss scale 32768")
    # The largest power of two that leaves the largest 16-bit gradient a doubling below 65504.
    comparison = report.comparison_scale
    assert math.log2(comparison).is_integer() and comparison < report.loss_scale
    assert 65504 / 4 < largest_16bit_gradient(report) * comparison <= 65504 / 2
    # Every gradient is compared, within a few float16 roundings of float32's.
    assert all(v.relative_error < 4 * FLOAT16.eps for v in report.variables)
    assert all(v.mixed_zero_fraction == 0 for v in report.variables)
    text = diagnose_cli.format_report(report)
    assert (f"loss scale 2^15 = 32768, mixed pass at loss scale 2^{math.log2(comparison):.0f} = "
            f"{comparison:g}") in text


def test_gradients_zero_in_exact_arithmetic_get_an_absolute_error_only(tmp_path):
    report = diagnose(make_trainer(hot_experiment, tmp_path, trainer=f"{__name__}.ZeroGradientTrainer").run,
                      num_batches=2)
    variables = {v.path: v for v in report.variables}
    kernel, bias, fed_zeros = (variables[path] for path in
                               ("centered/kernel", "centered/bias", "fed_zeros/kernel"))

    # float32 leaves rounding noise from the batch norm's cancellation, float16 thousands of times more.
    assert 0 < bias.max_abs < 1e-6 * kernel.max_abs
    assert bias.relative_error is None
    assert 0 < bias.absolute_error < FLOAT16.eps * kernel.max_abs
    # Zero times anything is zero in both passes.
    assert fed_zeros.max_abs == 0 and fed_zeros.num_values == 0
    assert fed_zeros.absolute_error == 0 and fed_zeros.relative_error is None
    # The others are compared as usual.
    assert all(v.relative_error < 4 * FLOAT16.eps for v in report.variables
               if v.path not in ("centered/bias", "fed_zeros/kernel"))
    row = next(line for line in diagnose_cli.format_report(report).splitlines()
               if line.startswith("centered/bias "))
    assert row.endswith(f"{bias.absolute_error:.2e}         -")


def test_a_diagnosis_leaves_every_layer_call_as_it_found_it(tmp_path):
    """The doctor wraps each layer's `call` while it records; a layer whose instance already has its
    own `call` (layer_precision's hand-back inside subclassed layers) must get that one back."""
    trainer = make_trainer(hot_experiment, tmp_path, "faint")
    body = trainer.model.get_layer("body")
    own_call = body.call
    object.__setattr__(body, "call", functools.wraps(own_call)(lambda *a, **k: own_call(*a, **k)))
    instance_call = body.call
    diagnose(trainer.run, num_batches=1)

    assert body.__dict__["call"] is instance_call
    assert "call" not in trainer.model.get_layer("logits").__dict__


def test_only_the_objective_whose_gradients_overflow_is_reported_so(tmp_path):
    trainer = make_trainer(hot_experiment, tmp_path, trainer=f"{__name__}.TwoHeadTrainer")
    variables = [v.numpy() for v in trainer.model.variables]
    a, b = diagnose_objectives(trainer.run, ["a", "b"], num_batches=2)

    assert (a.objective, b.objective, a.objectives) == ("a", "b", ["a", "b"])
    assert [v.path for v in a.variables] == ["body/kernel", "body/bias", "a/kernel", "a/bias"]
    assert [v.path for v in b.variables] == ["b/kernel", "b/bias"]
    assert a.loss_scale == b.loss_scale == 2.0**15
    assert a.advice.problems == [] and a.gradient_overflow_fraction == 0
    assert a.comparison_scale == a.loss_scale
    assert b.gradient_overflow_fraction > 0.5
    assert b.advice.problems[0].startswith("objective 'b': gradients overflow at loss scale 32768")
    assert len(b.advice.problems) == 1
    # b is compared below its loss scale, its head's gradient within a few roundings of float32's.
    assert b.comparison_scale < b.loss_scale
    assert all(v.relative_error < 4 * FLOAT16.eps for v in b.variables)
    # b's advised scale is smaller than a's by about the factor between their losses, 2^10.
    assert 8 <= math.log2(a.advice.initial_scale / b.advice.initial_scale) <= 12
    text = diagnose_cli.format_report(b)
    assert text.startswith("Precision report: test_diagnosis.TwoHeadTrainer, objective 'b' at step 0")
    assert "the largest gradient of objective 'b' left in float16" in text
    assert "mixloop.DynamicLossScale(initial_scale=" in text
    for before, after in zip(variables, trainer.model.variables):
        np.testing.assert_array_equal(before, after.numpy())


def test_each_objective_of_several_sees_the_same_batches_and_must_be_named(tmp_path):
    trainer = make_trainer(hot_experiment, tmp_path, trainer=f"{__name__}.TwoHeadTrainer")
    alone = diagnose(trainer.run, num_batches=1, objective="b")
    trainer = make_trainer(hot_experiment, tmp_path, trainer=f"{__name__}.TwoHeadTrainer")
    _, together = diagnose_objectives(trainer.run, ["a", "b"], num_batches=1)
    assert together == alone

    with pytest.raises(UserError, match=r"several objectives, \['a', 'b'\]; name the one"):
        diagnose(trainer.run)
    with pytest.raises(UserError, match=r"unknown objective 'c'; the trainer's objectives are \['a', 'b'\]"):
        diagnose(trainer.run, objective="c")


def test_every_pass_draws_the_noise_of_the_models_seed_generator_alike(tmp_path):
    trainer = make_trainer(hot_experiment, tmp_path, trainer=f"{__name__}.NoisyTrainer")
    trainer.model(tf.zeros([1, 8]), training=True)  # The seed state moves on from the twin's initial one.
    report = diagnose(trainer.run, num_batches=2)
    assert all(v.relative_error < 4 * FLOAT16.eps for v in report.variables)


def test_a_float32_policy_has_nothing_to_compare(tmp_path):
    trainer = make_trainer(tiny_experiment, tmp_path, **{"precision.policy": "float32"})
    with pytest.raises(UserError, match="computes in float32"):
        diagnose(trainer.run)


def test_a_loss_that_runs_the_model_itself_is_measured_on_the_float32_twin(tmp_path):
    """MAML's inner step over `self.model` inside compute_loss: the float32 pass runs it on the twin."""
    trainer = make_trainer(second_order_experiment, tmp_path / "mixed")
    model, policy = trainer.model, trainer.policy
    report = diagnose(trainer.run, num_batches=1)

    assert trainer.model is model and trainer.policy is policy
    # The float32 gradients are those of the second-order loss in float32, by hand.
    reference = make_trainer(second_order_experiment, tmp_path / "float32",
                             **{"precision.policy": "float32"})
    reference.model.set_weights(model.get_weights())
    largest = np.zeros(len(report.variables))
    features, labels = next(reference.run.train_iterator)  # The batch the doctor read, in two halves.
    for micro_batch in zip(tf.split(features, 2), tf.split(labels, 2)):
        with tf.GradientTape() as tape:
            loss = reference.compute_loss(forward(reference.model, reference.policy, micro_batch[0],
                                                  training=True), micro_batch)
        grads = tape.gradient(loss, reference.model.trainable_variables)
        largest = np.maximum(largest, [np.abs(g.numpy()).max() for g in grads])
    np.testing.assert_allclose([v.max_abs for v in report.variables], largest, rtol=1e-5)
    assert all(v.relative_error < 0.01 for v in report.variables)
    assert report.advice.initial_scale is not None
    assert "not needed" not in diagnose_cli.format_report(report)


def test_a_loss_that_runs_the_model_past_self_model_is_not_measured(tmp_path):
    trainer = make_trainer(second_order_experiment, tmp_path, "stray")
    model, policy = trainer.model, trainer.policy
    with pytest.raises(UserError) as raised:
        diagnose(trainer.run, num_batches=1)

    assert str(raised.value).startswith(
        "the precision probe cannot measure objective 'model''s loss: compute_loss reaches the "
        "trainer's model (dense/kernel, dense/bias, logits/kernel) other than through self.model")
    assert "\n" not in str(raised.value)
    assert trainer.model is model and trainer.policy is policy  # Put back on the error too.


class PolicyReadingTrainer(tiny_experiment.TinyTrainer):
    """A loss that differs between the doctor's passes on purpose: zero in float32 (it reads
    `self.policy`), so its float32 gradients are all zero and its mixed ones are not."""

    def compute_loss(self, outputs, batch):
        factor = 0.0 if self.policy.compute_dtype == tf.float32 else 1.0
        return factor * super().compute_loss(outputs, batch)


def test_float32_gradients_all_zero_where_the_mixed_are_not_are_not_measured(tmp_path):
    trainer = make_trainer(tiny_experiment, tmp_path, trainer=f"{__name__}.PolicyReadingTrainer")
    with pytest.raises(UserError, match="cannot measure objective 'model''s loss: its gradients are "
                                        "all zero in the float32 pass but not in the mixed one"):
        diagnose(trainer.run, num_batches=1)


class ZeroLossTrainer(tiny_experiment.TinyTrainer):
    """A loss whose gradients are zero in exact arithmetic, in both passes."""

    def compute_loss(self, outputs, batch):
        return 0.0 * tf.reduce_mean(outputs)


def test_zero_float16_gradients_advise_no_scale_and_never_call_it_not_needed(tmp_path):
    report = diagnose(make_trainer(tiny_experiment, tmp_path, trainer=f"{__name__}.ZeroLossTrainer").run,
                      num_batches=1)
    assert report.advice.initial_scale is None
    text = diagnose_cli.format_report(report)
    assert "not needed" not in text
    assert ("initial scale:    none measured: no gradient left in float16 is nonzero in the probed "
            "batches, so no scale can be read from them") in text


def read_histograms(directory):
    """{tag: (left edges, right edges, counts)} of the histogram summaries in `directory`."""
    found = {}
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "histograms":
                    found[value.tag] = tf.make_ndarray(value.tensor).T
    return found


def test_json_and_tensorboard_outputs_are_readable(tmp_path, hot_report, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # As if matplotlib were not installed.
    written = diagnose_cli.write_outputs(hot_report, str(tmp_path))

    assert written == [str(tmp_path / "report.json"), str(tmp_path)]
    assert capsys.readouterr().err.startswith("warning: matplotlib is not installed")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["advice"]["float32_layers_regex"] == "hot|squash"
    assert data["layers"][0]["path"] == "hot" and data["variables"][0]["relative_error"] == "inf"

    histograms = read_histograms(tmp_path)
    assert {"log2_gradient/hot/kernel", "log2_gradient_16bit/unscaled",
            "log2_gradient_16bit/scaled"} <= set(histograms)
    left, right, counts = histograms["log2_gradient_16bit/unscaled"]
    assert np.all(right - left == 1) and np.all(left == np.round(left))  # One bin per power of two.
    assert counts.sum() == sum(v.num_values for v in hot_report.variables if v.dtype == "float16")
    scaled_left, _, scaled_counts = histograms["log2_gradient_16bit/scaled"]
    np.testing.assert_array_equal(scaled_left, left + 15)  # Loss scale 2**15.
    np.testing.assert_array_equal(scaled_counts, counts)


def test_png_output_is_an_image(tmp_path, hot_report):
    image = pytest.importorskip("matplotlib.image")
    assert diagnose_cli.write_histogram_png(hot_report, str(tmp_path / "histogram.png"))
    assert image.imread(tmp_path / "histogram.png").shape == (720, 1200, 4)


def state(*per_parameter, num_parameters=1_000_000):
    """A PersistentState of `num_parameters` with these bytes per parameter by part."""
    return PersistentState(num_parameters, {part: round(b * num_parameters)
                                            for part, b in zip(PARTS, per_parameter)})


def test_the_memory_section_gives_each_lighter_setting_its_flag_and_what_it_saves():
    options = [
        LighterOption({"precision.master_weights": "bfloat16"}, state(2, 8, 4, 0),
                      needs={"precision.policy": "mixed_bfloat16"}),
        LighterOption({"optimizer.state_dtype": "int8"}, state(4, 2.05, 4, 0)),
        LighterOption({"train.accumulation_dtype": "bfloat16"}, state(4, 8, 2, 0)),
        LighterOption({"optimizer.state_dtype": "int8", "train.accumulation_dtype": "bfloat16"},
                      state(4, 2.05, 2, 0)),
    ]
    lines = diagnose_cli.format_memory(state(4, 8, 4, 0), options).splitlines()

    assert lines[0].startswith("Memory: ")
    assert "not accuracy measured" in lines[1] and lines[3].endswith("docs/memory.md.")
    assert lines[4:] == [
        "  memory: 1,000,000 parameters; persistent state 16.00 B/param (weights 4.00, optimizer "
        "state 8.00, accumulators 4.00, EMA 0.00) = 16.0 MB",
        "  --config.precision.master_weights=bfloat16: weights 4.00 -> 2.00 B/param (saves 2.00); "
        "14.00 B/param in all = 14.0 MB; needs --config.precision.policy=mixed_bfloat16",
        "  --config.optimizer.state_dtype=int8:        optimizer state 8.00 -> 2.05 B/param (saves "
        "5.95); 10.05 B/param in all = 10.1 MB",
        "  --config.train.accumulation_dtype=bfloat16: accumulators 4.00 -> 2.00 B/param (saves "
        "2.00); 14.00 B/param in all = 14.0 MB",
        "  all together:                               16.00 -> 8.05 B/param (saves 7.95) = 8.05 MB",
        "  to apply:                                   --config.optimizer.state_dtype=int8 "
        "--config.train.accumulation_dtype=bfloat16",
    ]
    assert diagnose_cli.format_memory(state(2, 2.05, 2, 0), []).endswith(
        "= 6.05 MB\n  nothing lighter: every storage setting this run can take is on")


def run_cli(*args):
    return cli_runs.run("mixloop.diagnose", *args)


@pytest.mark.slow
def test_cli_diagnoses_the_latest_checkpoint_and_leaves_the_workdir(tmp_path):
    workdir, output = tmp_path / "run", tmp_path / "diagnosis"
    make_trainer(tiny_experiment, workdir, **{"train.num_steps": 10}).train()
    before = cli_runs.snapshot(workdir)
    result = run_cli(f"--config={FIXTURES_DIR}/tiny_experiment.py", f"--workdir={workdir}", "--steps=2",
                     f"--output={output}")

    assert result.returncode == 0, result.stderr
    assert "Precision report: tiny_experiment.TinyTrainer at step 10" in result.stdout
    assert "Problems:\n  none" in result.stdout
    # The memory section closes the output: mixed_float16, Adam, two micro-batches.
    memory_section = result.stdout[result.stdout.index("\n\nMemory: "):]
    assert ("  memory: 195 parameters; persistent state 16.00 B/param (weights 4.00, optimizer "
            "state 8.00, accumulators 4.00, EMA 0.00) = 3.12 kB") in memory_section
    assert ("  to apply:                                   --config.optimizer.state_dtype=bfloat16 "
            "--config.train.accumulation_dtype=bfloat16\n") in memory_section
    assert json.loads((output / "report.json").read_text())["step"] == 10
    assert cli_runs.snapshot(workdir) == before


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--steps=0"], "flag --steps=0"),
    (["--loss_scale=-1"], "flag --loss_scale=-1.0: must be positive and finite"),
    (["--config.precision.policy=float32"], "precision.policy='float32' computes in float32"),
    (["--objective=generator"], "unknown objective 'generator'; the trainer's objectives are ['model']"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, args, message):
    workdir = tmp_path / "never"
    result = run_cli(f"--config={FIXTURES_DIR}/hot_experiment.py", f"--workdir={workdir}", *args)

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert not workdir.exists()
