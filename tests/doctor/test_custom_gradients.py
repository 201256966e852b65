"""The precision probe, the doctor and the divergence cure on layers with custom gradients: Keras's
float8 layers (`model.quantize("float8")`) and the user's own `tf.custom_gradient` layers."""

import custom_gradient_experiment
import float8_experiment
import numpy as np
import pytest
import helpers

from mixloop.errors import UserError
from mixloop.runner import auto_precision
from mixloop.doctor.diagnosis import diagnose
from mixloop.tools.diagnose import format_report

FLOAT8_SCALES = ("scale", "amax_history")  # The names of the variables Keras overwrites.


@pytest.fixture(scope="module")
def float8_run(tmp_path_factory):
    return helpers.train(float8_experiment, "quick", tmp_path_factory.mktemp("float8"),
                      **{"train.num_steps": 10, "eval.every_steps": 10})


def test_the_probe_measures_the_float8_mlp_without_its_overwritten_variables(float8_run):
    assert float8_run.metrics is not None
    placed = helpers.lines_with(float8_run, "precision.float32_layers=auto: probed")
    assert len(placed) == 1 and "no layer moved" in placed[0]
    # The true gradients are ~0.1: the scales' new values (1.0) no longer hold the scale down.
    assert helpers.lines_with(float8_run, "the loss scale starts at 32768")


def test_the_doctor_leaves_overwritten_variables_out_of_gradient_statistics(float8_run):
    report = diagnose(float8_run.trainer.run, num_batches=1)
    assert [layer.path for layer in report.layers] == ["flatten", "dense0", "dense1", "logits"]
    overwritten = [v for v in report.variables if v.overwritten]
    assert {v.path.rpartition("/")[2] for v in overwritten} == {
        f"{kind}_{name}" for kind in ("inputs", "kernel", "outputs_grad") for name in FLOAT8_SCALES}
    assert all(v.max_abs == 0 and v.histogram == {} and v.relative_error is None
               and v.overflow_fraction == 0 for v in overwritten)
    gradients = [v for v in report.variables if not v.overwritten and v.dtype == "float16"]
    assert report.advice.largest_gradient == max(v.max_abs for v in gradients) < 0.5
    assert "overwritten" in format_report(report)


def test_a_non_finite_new_value_of_an_overwritten_variable_is_an_overflow(float8_run):
    trainer = float8_run.trainer
    variables = {v.path: v for v in trainer.model.variables}
    history, scale = variables["dense0/inputs_amax_history"], variables["dense0/inputs_scale"]
    saved = [history.numpy(), scale.numpy()]
    # An amax that is not finite makes Keras keep the old scale: its new value is then NaN.
    history.assign(saved[0] + float("inf"))
    scale.assign(float("nan"))
    try:
        report = diagnose(trainer.run, num_batches=1)
    finally:
        history.assign(saved[0])
        scale.assign(saved[1])
    scale = next(v for v in report.variables if v.path == "dense0/inputs_scale")
    assert scale.overwritten and scale.overflow_fraction == 1.0 and scale.max_abs == 0
    assert report.gradient_overflow_fraction > 0
    assert any("gradients overflow" in problem for problem in report.advice.problems)


def test_a_clipping_custom_gradient_is_measured_as_training_takes_it(tmp_path):
    run = helpers.train(custom_gradient_experiment, "clip", tmp_path, **helpers.AUTO)
    assert run.metrics is not None and helpers.lines_with(run, "probed 2 train batches")
    layers = {layer.path: layer for layer in diagnose(run.trainer.run, num_batches=1).layers}
    assert layers["custom"].max_abs_output_grad > custom_gradient_experiment.BOUND
    assert layers["hidden"].max_abs_output_grad <= np.float32(custom_gradient_experiment.BOUND)


def test_a_custom_gradient_eager_tensorflow_cannot_take_is_probed_traced(tmp_path):
    run = helpers.train(custom_gradient_experiment, "keras_variable", tmp_path, **helpers.AUTO)
    assert run.metrics is not None and helpers.lines_with(run, "probed 2 train batches")
    report = diagnose(run.trainer.run, num_batches=1)
    assert next(v for v in report.variables if v.path == "custom/gain").max_abs > 0


def test_a_failing_custom_gradient_is_one_line_naming_its_layer(tmp_path):
    trainer = helpers.make_trainer(custom_gradient_experiment, "raising", tmp_path, **helpers.AUTO)
    with pytest.raises(UserError, match=r"layer 'custom' \(RaisingGradient\) cannot be measured: "
                       r"its backward pass.*NotImplementedError: the backward pass of this layer is "
                       r"not written yet \(at .*custom_gradient_experiment.py:\d+\)"):
        diagnose(trainer.run, num_batches=1)
    with helpers.absl_messages() as log:
        auto_precision.start(trainer.run)  # The warning, and the run goes on unprobed.
    assert [m for m in log if "not probed" in m and "layer 'custom'" in m and "\n" not in m]
    with helpers.absl_messages() as log:
        assert auto_precision.heal(trainer.run) == ""
    assert [m for m in log if m.startswith("The healing probe failed (layer 'custom'")]
    assert "the precision probe of the weights it diverged at failed (layer 'custom'" in (
        auto_precision.cure(trainer.run))
