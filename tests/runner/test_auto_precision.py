"""Automatic precision: `precision.float32_layers=auto`, `initial_scale=auto` and `heal`, on the
planted problems of hot_experiment, a model with nothing to fix, bad data and resumed runs."""

import glob
import itertools
import json
import math
import os
import shutil
import signal

import cli_runs
import faulty_experiment
import hot_experiment
import pytest
import second_order_experiment
import slow_start_experiment
import tensorflow as tf
import tiny_experiment
from helpers import AUTO, absl_messages, lines_with, make_trainer, train

from mixloop.config import ConfigError, validate
from mixloop.engine.layer_precision import named_layers
from mixloop.runner import auto_precision, workdir
from mixloop.doctor.advice import initial_scale_keeping
from mixloop.doctor.diagnosis import diagnose_batches
from mixloop.tools.diagnose import diagnose_experiment

FIXTURES_DIR = cli_runs.FIXTURES_DIR
# The automatic settings are mixed_float16's defaults: a plain run turns them off.
PLAIN = {"precision.float32_layers": "", "precision.initial_scale": 2.0**15}
HEAL = {"precision.heal": True, "train.max_recoveries": 1}


# ----- Helpers. -----


def compute_dtypes(trainer):
    return {layer.name: layer.compute_dtype for layer in trainer.model.layers}


def float32_layers(trainer):
    """The non-input layers computing in float32 (logits does by name, whatever the settings)."""
    return sorted(name for name, dtype in compute_dtypes(trainer).items()
                  if dtype == "float32" and not name.startswith("input"))


def read_scalars(directory, tag):
    """The values of `tag` in the event files of `directory`, by step (a resumed run adds a file)."""
    values = []
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            values += [(event.step, float(tf.make_ndarray(v.tensor)))
                       for v in event.summary.value if v.tag == tag]
    return [value for _, value in sorted(values)]


def resume(run, module, variant, directory, **overrides):
    """Continues a copy of `run`'s finished workdir in `directory`, with `overrides`."""
    shutil.copytree(run.directory, directory)
    return train(module, variant, directory, **overrides)


# ----- A planted hot layer and a planted long-axis reduction. -----

@pytest.fixture(scope="module")
def hot_auto(tmp_path_factory):
    return train(hot_experiment, None, tmp_path_factory.mktemp("hot_auto"), **AUTO)


@pytest.fixture(scope="module")
def reduction_auto(tmp_path_factory):
    return train(hot_experiment, "reduction", tmp_path_factory.mktemp("reduction_auto"),
                 **AUTO, **{"train.num_steps": 10})


@pytest.mark.parametrize("variant, steps", [(None, 30), ("reduction", 10)])
def test_plain_mixed_float16_diverges_on_the_planted_problems(tmp_path, variant, steps):
    run = train(hot_experiment, variant, tmp_path, **PLAIN, **{"train.num_steps": steps})
    assert run.error is not None
    assert "training diverged at step 1: the float32 loss is nan" in str(run.error)


def test_the_divergence_names_the_layers_to_move_and_bfloat16(tmp_path):
    run = train(hot_experiment, None, tmp_path, **PLAIN)
    message = str(run.error)
    assert message.startswith("training diverged at step 1: the float32 loss is nan; ")
    assert ("; the precision probe of the weights it diverged at finds hot, squash overflowing "
            "float16: --config.precision.float32_layers='auto|hot|squash' computes them in "
            "float32 (the default 'auto' moves them before the first update), or "
            "--config.precision.policy=mixed_bfloat16 has float32's range") in message
    assert "\n" not in message
    assert not (tmp_path / "precision").exists()  # Advice only: nothing recorded or moved.


def test_a_divergence_the_probe_finds_nothing_for_points_at_the_doctor(tmp_path):
    run = train(hot_experiment, "growing", tmp_path, **PLAIN, **{"train.max_recoveries": 0,
                                                                 "checkpoint.every_steps": 0})
    message = str(run.error)
    assert "training diverged at step " in message
    # Past the divergence the gain is still growing: the probe of those weights finds the layers.
    assert "finds grow, shrink overflowing float16" in message or (
        "finds no layer overflowing float16 in the forward pass: python -m mixloop.diagnose with "
        "the same --config and --workdir shows the gradients" in message)
    assert "--config.precision.policy=mixed_bfloat16 has float32's range" in message


@pytest.mark.parametrize("fixture, planted, evidence, steps", [
    ("hot_auto", ["hot", "squash"], "exceed float16's largest finite value, 65504", 30),
    ("reduction_auto", ["pool"], "it turned finite inputs into 64 inf or NaN outputs", 10),
])
def test_auto_moves_exactly_the_planted_layers_and_trains(request, fixture, planted, evidence, steps):
    run = request.getfixturevalue(fixture)
    assert run.error is None
    assert int(run.trainer.run.global_step.numpy()) == steps
    assert run.trainer.run.state.skipped_totals()["model"] <= 1
    assert run.metrics["skipped_total"] <= 1
    assert math.isfinite(run.metrics["loss"])
    assert float32_layers(run.trainer) == sorted(planted + ["logits"])  # logits: by name.
    pinned = "|".join(planted)
    assert workdir.read_resolved(str(run.directory))["precision.float32_layers"] == pinned
    assert os.path.exists(run.directory / "precision" / "report-step-0.json")
    [line] = lines_with(run, "precision.float32_layers=auto: probed 2 train batches")
    assert f": {planted[0]} (float16): " in line and evidence in line
    assert f"--config.precision.float32_layers='{pinned}'" in line


def test_the_pinned_regex_gives_the_same_placement(tmp_path, hot_auto):
    pinned = workdir.read_resolved(str(hot_auto.directory))["precision.float32_layers"]
    trainer = make_trainer(hot_experiment, None, tmp_path, **{"precision.float32_layers": pinned})
    assert compute_dtypes(trainer) == compute_dtypes(hot_auto.trainer)
    assert compute_dtypes(trainer)["hot"] == "float32"


def test_an_explicit_regex_combines_with_auto(tmp_path):
    run = train(hot_experiment, None, tmp_path, **{"precision.float32_layers": "auto|body",
                                                   "train.num_steps": 10})
    assert run.error is None
    assert float32_layers(run.trainer) == ["body", "hot", "logits", "squash"]
    assert workdir.read_resolved(str(tmp_path)) == {"precision.float32_layers": "body|hot|squash"}


def test_auto_moves_the_finest_layers_of_nested_blocks(tmp_path):
    run = train(hot_experiment, "nested", tmp_path, **{"train.num_steps": 10})  # The defaults.
    assert run.error is None and run.metrics["skipped_total"] <= 1
    dtypes = {path: layer.compute_dtype for path, layer in named_layers(run.trainer.model).items()}
    assert dtypes["pooling/pool"] == dtypes["summing"] == dtypes["summing/mix"] == "float32"
    assert dtypes["pooling"] == dtypes["pooling/body"] == "float16"  # The block stays in 16 bits.
    [line] = lines_with(run, "precision.float32_layers=auto: probed 2 train batches")
    assert "pooling/pool (float16): it turned finite inputs into 64 inf or NaN outputs; " in line
    assert ("summing (float16): it turned finite inputs into 64 inf or NaN outputs; in its own "
            "ops, not in a sublayer (the smallest layer that holds them); ") in line
    assert "pooling (float16)" not in line
    pinned = workdir.read_resolved(str(tmp_path))["precision.float32_layers"]
    assert sorted(pinned.split("|")) == ["pooling/pool", "summing"]


def test_the_doctor_advises_the_finest_layers_without_their_blocks(tmp_path):
    doctor = make_trainer(hot_experiment, "nested", tmp_path, **PLAIN)
    [report] = diagnose_batches(doctor.run, ["model"], itertools.islice(doctor.run.make_train_iterator(0), 1))
    hot = {layer.path for layer in report.layers if layer.creates_non_finite}
    assert {"pooling", "pooling/pool", "summing"} <= hot  # The block is hot for its sublayer.
    assert sorted(report.advice.float32_layers) == ["pooling/pool", "summing"]
    assert not [problem for problem in report.advice.problems if problem.startswith("pooling (")]


# ----- A layer that overflows only after some training: healed mid-run. -----

@pytest.fixture(scope="module")
def growing_healed(tmp_path_factory):
    return train(hot_experiment, "growing", tmp_path_factory.mktemp("growing_healed"), **HEAL)


@pytest.fixture(scope="module")
def growing_float32(tmp_path_factory):
    return train(hot_experiment, "growing", tmp_path_factory.mktemp("growing_float32"),
                 **{"precision.policy": "float32"})


def test_the_growing_layer_diverges_without_healing(tmp_path):
    run = train(hot_experiment, "growing", tmp_path, **{"train.max_recoveries": 0})
    assert run.error is not None
    step = int(str(run.error).split("training diverged at step ")[1].split(":")[0])
    assert 30 < step <= 50  # 1.3**step * ~4 passes 65504 near step 40: it trains, then diverges.


def test_healing_moves_the_growing_layers_and_ends_near_float32(growing_healed, growing_float32):
    run = growing_healed
    assert run.error is None
    assert int(run.trainer.run.global_step.numpy()) == 80
    [heal] = lines_with(run, "Heal (recovery)")
    assert heal.startswith("Heal (recovery) 1 of 1: training diverged at step ")
    assert "Healing: probed 2 train batches" in heal
    assert "grow (float16): values up to" in heal and "shrink (float16): values up to" in heal
    assert "--config.precision.float32_layers='grow|shrink'" in heal
    assert not lines_with(run, "Recovery 1 of")
    assert float32_layers(run.trainer) == ["grow", "logits", "shrink"]
    assert workdir.read_resolved(str(run.directory))["precision.float32_layers"] == "grow|shrink"
    assert read_scalars(run.directory / "train", "heals") == [1.0]
    assert read_scalars(run.directory / "train", "recoveries") == [1.0]
    reference = growing_float32.metrics["eval_loss"]
    assert abs(run.metrics["eval_loss"] - reference) <= 0.01 * reference, (run.metrics, reference)


def test_bad_data_is_recovered_from_but_not_healed(tmp_path):
    with absl_messages() as log:
        trainer = make_trainer(faulty_experiment, None, tmp_path, **HEAL,
                               **{"data.nan_batches": [6]})
        trainer.train()
    assert int(trainer.run.global_step.numpy()) == 24
    assert [m for m in log if m.startswith("Recovery 1 of 1: training diverged at step 7")]
    assert not [m for m in log if "Heal" in m or "healing probe" in m]  # Not even tried.
    assert read_scalars(tmp_path / "train", "heals") == [0.0]
    assert float32_layers(trainer) == ["logits"]


def test_a_resumed_run_applies_the_recorded_layers_and_does_not_heal_again(tmp_path, growing_healed):
    # num_steps changes, so config.json is rewritten: the record must survive it.
    run = resume(growing_healed, hot_experiment, "growing", tmp_path / "resumed",
                 **HEAL, **{"train.num_steps": 100})
    assert run.error is None
    assert int(run.trainer.run.global_step.numpy()) == 100
    [applied] = lines_with(run, "as config.json records")
    assert applied.startswith("Automatic precision: grow, shrink compute in float32")
    assert not lines_with(run, "Heal") and not lines_with(run, "Recovery")
    assert run.metrics["skipped_total"] == 0
    assert workdir.read_resolved(str(tmp_path / "resumed"))["precision.float32_layers"] == (
        "grow|shrink")


def test_a_changed_config_keeps_the_resolved_record(tmp_path):
    config = tiny_experiment.get_config()
    workdir.write_config(str(tmp_path), config, 0)
    workdir.record_resolved(str(tmp_path), {"precision.float32_layers": "grow|shrink"})
    config.train.num_steps = 80
    workdir.write_config(str(tmp_path), config, 50)
    assert workdir.read_resolved(str(tmp_path)) == {"precision.float32_layers": "grow|shrink"}
    kept = json.loads((tmp_path / "config-step-50.json").read_text())
    assert kept["resolved"] == {"precision.float32_layers": "grow|shrink"}
    assert json.loads((tmp_path / "config.json").read_text())["train"]["num_steps"] == 80


# ----- Nothing to fix: the default placement and an unchanged step. -----

def traced_dtypes(trainer):
    """Sorted (op, dtype attributes) of every node of the traced train step, in its loop bodies too."""
    graph = tf.function(trainer.run.train_step.step).get_concrete_function(
        trainer.run._train_data.element_spec).graph.as_graph_def()
    nodes = list(graph.node) + [node for function in graph.library.function
                                for node in function.node_def]

    def typed(node):
        dtypes = []
        for key, value in sorted(node.attr.items()):
            dtypes += [(key, tf.as_dtype(value.type).name)] if value.type else []
            dtypes += [(key, tf.as_dtype(dtype).name) for dtype in value.list.type]
        return node.op, tuple(dtypes)

    return sorted(typed(node) for node in nodes)


def started_tiny(directory, module=tiny_experiment, variant=None, stop_requested=lambda: False,
                 **overrides):
    """A tiny trainer (`module`'s) after the controller's start: config.json written, then
    `start_precision(stop_requested)`."""
    trainer = make_trainer(module, variant, directory, **overrides)
    os.makedirs(directory)
    workdir.write_config(str(directory), trainer.config, 0)
    with absl_messages() as log:
        auto_precision.start(trainer.run, stop_requested)
    return trainer, log


def test_nothing_to_fix_keeps_the_placement_the_step_and_the_scale(tmp_path):
    plain, _ = started_tiny(tmp_path / "plain", **PLAIN)
    auto, log = started_tiny(tmp_path / "auto")  # The defaults: the probe places and scales.
    moved, _ = started_tiny(tmp_path / "moved", **{**PLAIN, "precision.float32_layers": "dense"})

    assert compute_dtypes(auto) == compute_dtypes(plain)
    assert [m for m in log if "3 or more doublings" in m and "no layer moved" in m]
    resolved = workdir.read_resolved(str(tmp_path / "auto"))
    assert "precision.float32_layers" not in resolved  # Nothing moved: nothing to pin.
    default_step = traced_dtypes(plain)
    assert traced_dtypes(auto) == default_step
    assert traced_dtypes(moved) != default_step  # The comparison sees a moved layer.
    assert float(plain.objectives["model"].loss_scale.scale.numpy()) == 2.0**15
    assert float(auto.objectives["model"].loss_scale.scale.numpy()) == resolved[
        "precision.initial_scale"]


def test_the_probe_measures_a_loss_that_runs_the_model_itself(tmp_path):
    """A MAML-style compute_loss over self.model: the float32 pass runs it on the twin."""
    trainer, log = started_tiny(tmp_path / "run", second_order_experiment)
    with open(tmp_path / "run" / "precision" / "report-step-0.json") as f:
        report = json.load(f)
    assert all(variable["max_abs"] > 0 for variable in report["variables"])
    scale = float(trainer.objectives["model"].loss_scale.scale.numpy())
    assert scale == report["advice"]["initial_scale"]
    assert [m for m in log if m.startswith(f"precision.initial_scale=auto: the loss scale starts "
                                           f"at {scale:g}")]


def test_a_loss_the_probe_cannot_measure_is_one_line_and_no_advice(tmp_path):
    trainer, log = started_tiny(tmp_path / "run", second_order_experiment, "stray")
    [line] = [m for m in log if "cannot measure" in m]
    assert line.startswith("Automatic precision: not probed, the precision probe cannot measure "
                           "objective 'model''s loss: compute_loss reaches the trainer's model")
    assert "\n" not in line
    assert float(trainer.objectives["model"].loss_scale.scale.numpy()) == 2.0**15
    assert not (tmp_path / "run" / "precision").exists()


def test_the_probe_asks_for_a_stop_in_each_pass_and_gives_up_with_everything_as_it_was(tmp_path):
    """A stop at the probe's asks (after the twin's build, before each pass, at each layer call,
    backward step and layer's statistics while a pass is traced): no layer moves, the weights are
    bit-identical, the loss scale and the data position as they were, nothing is recorded, and the
    run's own step traces as without a probe, and trains."""
    asks = itertools.count(1)
    started_tiny(tmp_path / "counted", stop_requested=lambda: next(asks) < 0)
    num_asks = next(asks) - 1
    # Beyond the 1 + 4 asks outside the passes (2 micro-batches, a float32 and a mixed pass each),
    # 11 in each pass's tracing: its 3 layer calls, 5 backward steps and 3 layers' statistics.
    assert num_asks == 1 + 4 * 2 + 2 * (3 + 5 + 3)
    plain, _ = started_tiny(tmp_path / "plain", **PLAIN)
    first_batch, plain_step = tf.nest.flatten(next(plain.run.train_iterator)), traced_dtypes(plain)
    # After the twin's build; at a layer call, a backward step and a layer's statistics in the
    # float32 pass's tracing; a layer call in the mixed pass's; before the last pass.
    for stop_at in [1, 4, 7, 12, 19, num_asks - 1]:
        asks = itertools.count(1)
        directory = tmp_path / f"stopped-at-{stop_at}"
        trainer, log = started_tiny(directory, stop_requested=lambda: next(asks) >= stop_at)

        [line] = [m for m in log if m.startswith("Automatic precision:")]
        assert line.startswith("Automatic precision: the probe gave up for the stop request after")
        assert line.endswith("s; no layer moves, nothing recorded")
        assert compute_dtypes(trainer) == compute_dtypes(plain)
        assert all((a.numpy() == b.numpy()).all()
                   for a, b in zip(trainer.model.variables, plain.model.variables))
        assert float(trainer.objectives["model"].loss_scale.scale.numpy()) == 2.0**15
        assert workdir.read_resolved(str(directory)) == {}
        assert not (directory / "precision").exists()
        assert all((a.numpy() == b.numpy()).all()  # The data position put back.
                   for a, b in zip(first_batch, tf.nest.flatten(next(trainer.run.train_iterator))))
        assert traced_dtypes(trainer) == plain_step
    trainer.run.train_loop(1)
    assert int(trainer.run.global_step.numpy()) == 1


@pytest.mark.slow
def test_sigterm_during_the_probe_gives_it_up_and_the_run_saves_step_0(tmp_path):
    """The probe's twin takes slow_start_experiment.TWIN_SECONDS to build; SIGTERM comes then, and
    the probe stops right after it: no placement line, nothing recorded, step 0 saved."""
    returncode, stderr = cli_runs.interrupted(
        "mixloop.train", f"--config={FIXTURES_DIR}/slow_start_experiment.py:probe",
        f"--workdir={tmp_path}", signal_number=signal.SIGTERM,
        after=slow_start_experiment.BUILDING_TWIN)

    assert returncode == 0, stderr
    assert "Automatic precision: the probe gave up for the stop request after" in stderr
    assert "probed 2 train batches" not in stderr and "initial_scale=auto" not in stderr
    assert "jit_compile=auto" not in stderr.partition("the probe gave up")[2]  # Not measured.
    assert f"Stopped by SIGTERM at step 0; checkpoint saved in {tmp_path}/checkpoints" in stderr
    assert cli_runs.checkpoint_steps(tmp_path) == [0]
    assert workdir.read_resolved(str(tmp_path)) == {}
    assert not (tmp_path / "precision").exists()
    assert not glob.glob(str(tmp_path / ".*-probe-*"))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_the_defaults_probe_nothing_outside_float16(tmp_path, policy):
    trainer, log = started_tiny(tmp_path / "run", **{"precision.policy": policy})
    assert not [m for m in log if "probed" in m or "initial_scale=auto" in m]
    assert not (tmp_path / "run" / "precision").exists()


# ----- initial_scale=auto. -----

SCALE_AUTO = {**AUTO, "precision.initial_scale": "auto", "precision.growth_interval": 5,
              "train.num_steps": 10}  # Two growths: the checkpoint's scale is 4 times the start.


@pytest.fixture(scope="module")
def hot_scaled(tmp_path_factory):
    return train(hot_experiment, None, tmp_path_factory.mktemp("hot_scaled"), **SCALE_AUTO)


def test_auto_initial_scale_is_the_doctors_advice(tmp_path, hot_scaled):
    doctor = make_trainer(hot_experiment, None, tmp_path)  # The same weights, the probe's batches:
    [report] = diagnose_batches(doctor.run, ["model"], itertools.islice(doctor.run.train_iterator, 2))
    advised = initial_scale_keeping(report, ["hot", "squash"])
    assert advised == report.advice.initial_scale
    # The rule: the largest power of two keeping the largest float16 gradient 2**3 below 65504.
    largest = report.advice.largest_gradient
    assert advised == 2.0**math.floor(math.log2(65504 / 2**3 / largest))

    run = hot_scaled
    assert run.error is None and run.metrics["skipped_total"] == 0
    [line] = lines_with(run, "precision.initial_scale=auto: the loss scale starts at")
    assert f"starts at {advised:g} (" in line
    assert workdir.read_resolved(str(run.directory))["precision.initial_scale"] == advised
    assert 1.0 <= advised <= 2.0**24 / 16  # Room for the four growths of this test and the next.
    assert read_scalars(run.directory / "train", "loss_scale")[-1] == 4 * advised


def test_a_resumed_run_keeps_the_checkpoints_scale(tmp_path, hot_scaled):
    advised = workdir.read_resolved(str(hot_scaled.directory))["precision.initial_scale"]
    run = resume(hot_scaled, hot_experiment, None, tmp_path / "resumed",
                 **{**SCALE_AUTO, "train.num_steps": 20})
    assert run.error is None
    assert not lines_with(run, "precision.initial_scale=auto")
    # From the checkpoint's 4 times the advice, two more growths; a restart would give 4 times.
    assert read_scalars(tmp_path / "resumed" / "train", "loss_scale")[-1] == 16 * advised


# ----- Config checks and the CLI. -----

@pytest.mark.parametrize("overrides, message", [
    ({"precision.float32_layers": "auto|log(its"}, "config.precision.float32_layers='auto|log(its'"),
    ({"precision.initial_scale": "x"}, "config.precision.initial_scale='x' is not allowed"),
    ({"precision.heal": True, "train.max_recoveries": 0},
     "config.precision.heal=True is not allowed: True needs train.max_recoveries of at least 1"),
])
def test_bad_automatic_settings_are_refused(overrides, message):
    config = tiny_experiment.get_config()
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        config[section][field] = value
    with pytest.raises(ConfigError) as raised:
        validate(config)
    assert message in str(raised.value)


def test_healing_with_several_replicas_is_refused_before_anything_is_written(tmp_path):
    workdir_path = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"precision.heal=True probes on one device, but "
                       r"config.distribution='mirrored' gives 2 replicas; run once with "
                       r"--config.distribution=one_device"):
        make_trainer(tiny_experiment, None, workdir_path, distribution="mirrored", **HEAL)
    assert not workdir_path.exists()


@pytest.mark.parametrize("distribution, reason", [
    ("mirrored", "the probe runs on one device and this run has 2 replicas"),
    # Its iterator is not in the checkpoint: the probe could not put the data position back.
    ("one_device", "the probe reads the run's next batches and puts its data position back, which "
                   "a checkpoint cannot hold here (generator data, or a strategy other than the "
                   "default), and an iterator of its own would change the run's data order"),
])
def test_the_default_probe_is_skipped_where_it_cannot_run_and_says_so(tmp_path, distribution,
                                                                      reason):
    trainer, log = started_tiny(tmp_path / "run", distribution=distribution)
    [line] = [m for m in log if m.startswith("Automatic precision: not probed")]
    assert f"not probed, {reason}; no layer moves and a dynamic loss scale starts at 32768" in line
    assert float(trainer.objectives["model"].loss_scale.scale.numpy()) == 2.0**15
    assert not (tmp_path / "run" / "precision").exists()


@pytest.mark.slow
def test_cli_places_and_scales_the_hot_experiment(tmp_path):
    result = cli_runs.run(
        "mixloop.train", f"--config={FIXTURES_DIR}/hot_experiment.py", f"--workdir={tmp_path}",
        "--config.precision.initial_scale=auto", "--config.precision.float32_layers=auto")
    assert result.returncode == 0, result.stderr
    assert "precision.float32_layers=auto: probed 2 train batches" in result.stderr
    assert "--config.precision.float32_layers='hot|squash'" in result.stderr
    assert "precision.initial_scale=auto: the loss scale starts at" in result.stderr
    resolved = json.loads((tmp_path / "config.json").read_text())["resolved"]
    assert resolved["precision.float32_layers"] == "hot|squash"


def test_the_doctor_diagnoses_a_workdir_with_its_recorded_placement(hot_auto):
    [report] = diagnose_experiment(hot_auto.trainer.config, str(hot_auto.directory), num_batches=1)

    dtypes = {layer.path: layer.compute_dtype for layer in report.layers}
    assert dtypes["hot"] == dtypes["squash"] == "float32" and dtypes["body"] == "float16"
    assert report.advice.float32_layers == [] and report.step == hot_auto.trainer.config.train.num_steps
