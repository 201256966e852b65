"""The doctor's FP8 column (runner/float8_report.py): float8's flushed and saturated shares of each
Dense layer's values, checked by hand against the values the doctor recorded; the advice; the column
through `python -m mixloop.diagnose`."""

import os

import cli_runs
import float8_experiment
import hot_experiment
import keras
import numpy as np
import pytest
import helpers
from test_diagnosis import FIXTURES_DIR, make_trainer

from mixloop.doctor import float8_column as float8_report
from mixloop.doctor.diagnosis import diagnose
from mixloop.tools.diagnose import format_report

# The formats' limits, written out rather than read from ml_dtypes as the module reads them.
E4M3_MAX, E4M3_SMALLEST = 448.0, 2.0**-9
E5M2_MAX, E5M2_SMALLEST = 57344.0, 2.0**-16
# The gain on all but the first output of `quiet`: their gradients come out 1e-15 times the first's,
# below E5M2's reach of 2^-33 (about 1e-10) under the largest, while bfloat16 keeps them.
QUIET = 1e-15


@keras.saving.register_keras_serializable(package="test_float8_report")
class FeatureGains(keras.layers.Layer):
    """Multiplies feature j of its inputs by the constant gains[j]."""

    def __init__(self, gains, **kwargs):
        super().__init__(**kwargs)
        self.gains = list(gains)

    def call(self, inputs):
        return inputs * keras.ops.convert_to_tensor(self.gains, inputs.dtype)

    def get_config(self):
        return {**super().get_config(), "gains": self.gains}


class QuietGradientTrainer(hot_experiment.HotTrainer):
    """The hot task through a healthy Dense, then `quiet`, two of whose three outputs (the logits)
    are multiplied by QUIET after it, so that their gradients are QUIET times the third's."""

    def build_model(self):
        inputs = keras.Input((8,))
        x = keras.layers.Dense(16, activation="relu", name="healthy")(inputs)
        x = keras.layers.Dense(3, name="quiet")(x)
        return keras.Model(inputs, FeatureGains([1.0, QUIET, QUIET], name="gains")(x))


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    """The report on the quiet model in mixed_bfloat16, and what each Dense's tally recorded:
    {layer name: (inputs, output gradients, kernel)}."""
    trainer = make_trainer(hot_experiment, tmp_path_factory.mktemp("quiet"),
                           trainer=f"{__name__}.QuietGradientTrainer",
                           **{"precision.policy": "mixed_bfloat16"})
    recorded = {}
    add = float8_report.Float8Tally.add

    def recording_add(tally, inputs, output_grads):
        entry = recorded.setdefault(tally.layer.name, ([], [], np.asarray(tally.layer.kernel)))
        entry[0].extend(inputs)
        entry[1].extend(output_grads)
        add(tally, inputs, output_grads)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(float8_report.Float8Tally, "add", recording_add)
        report = diagnose(trainer.run, num_batches=2)
    return report, recorded


def by_hand(arrays, fmt_max, smallest):
    """(flushed, saturated) of the nonzero values at the scale a fresh history sets: amax / max."""
    magnitudes = np.abs(np.concatenate([a.ravel() for a in arrays]).astype(np.float64))
    magnitudes = magnitudes[magnitudes != 0]
    scaled = magnitudes / magnitudes.max() * fmt_max  # x / scale, exact at the largest value.
    return np.mean(scaled <= smallest / 2), np.mean(scaled > fmt_max)


def test_shares_flush_at_half_the_smallest_subnormal_and_saturate_above_the_max():
    # At scale 1 (top 448): 2^-10 ties to zero, 2^-9 and 448 are kept, 449 is clipped.
    values = [np.array([2.0**-10, 2.0**-9, 0.0, 448.0, -449.0], np.float32)]
    assert float8_report.shares(values, E4M3_MAX, "float8_e4m3fn") == (0.25, 0.25)
    assert float8_report.shares(values, 2 * E5M2_MAX, "float8_e5m2") == (0.0, 0.0)  # Scale 2.
    assert float8_report.shares([np.zeros(3)], 1.0, "float8_e5m2") == (0.0, 0.0)


def test_the_fp8_column_matches_a_hand_count_of_the_recorded_values(quiet_run):
    report, recorded = quiet_run
    layers = {layer.path: layer for layer in report.layers}
    assert layers["gains"].float8 is None  # Not a Dense.
    for name in ("healthy", "quiet"):
        inputs, output_grads, kernel = recorded[name]
        fp8 = layers[name].float8
        forward = [by_hand(inputs, E4M3_MAX, E4M3_SMALLEST), by_hand([kernel], E4M3_MAX, E4M3_SMALLEST)]
        assert not fp8.own_scales
        assert (fp8.forward_flushed, fp8.forward_saturated) == tuple(map(max, zip(*forward)))
        assert (fp8.backward_flushed, fp8.backward_saturated) == by_hand(output_grads, E5M2_MAX,
                                                                        E5M2_SMALLEST)
    assert layers["quiet"].float8.backward_flushed > 0.5  # Two outputs in three.
    assert layers["healthy"].float8.backward_flushed < 0.01
    assert layers["healthy"].float8.forward_saturated == layers["quiet"].float8.forward_saturated == 0


def test_the_advice_keeps_the_quiet_layer_in_16_bits_and_names_the_healthy_one(quiet_run):
    report, _ = quiet_run
    advice = report.advice.float8
    assert (advice.unfit, advice.fit, advice.regex) == (["quiet"], ["healthy"], "healthy")
    text = format_report(report)
    assert "FP8, keep 16-bit: quiet (backward flushes more than 1.0% or forward saturates)" in text
    assert "--config.precision.float8_layers=healthy" in text


@pytest.mark.slow
def test_cli_prints_the_fp8_column_of_the_float8_mlp_at_its_own_scales(tmp_path):
    # Trained first, so that its amax histories hold values and the doctor reads its own scales.
    helpers.train(float8_experiment, "quick", tmp_path, **{"train.num_steps": 10, "eval.every_steps": 10})
    config = os.path.join(FIXTURES_DIR, "float8_experiment.py")
    result = cli_runs.run("mixloop.diagnose", f"--config={config}:quick", f"--workdir={tmp_path}",
                          "--steps=1")

    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()
            if line.split()[:1] in (["dense0"], ["dense1"], ["logits"], ["flatten"])}
    assert all(" *fwd " in rows[name] and " bwd " in rows[name]
               for name in ("dense0", "dense1", "logits"))
    assert rows["flatten"].endswith(" -")
    assert "  FP8, keep 16-bit: " in result.stdout
