"""experiments/ddpm_digits.py and experiments/byol_digits.py: the quick runs through the CLI with
the metrics their eval-time actions return in the `Finished ...` line, the BYOL target as the
moving average of the online network, and DDPM's noise schedule."""

import importlib

import numpy as np
import pytest

from test_experiments import REPO, run_cli

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


@pytest.fixture
def experiments(monkeypatch):
    """Imports an experiment module as the CLI does: from the repository root."""
    monkeypatch.syspath_prepend(REPO)
    return lambda name: importlib.import_module(f"experiments.{name}")


def quick_run(experiment, workdir):
    """Runs experiments/`experiment`.py:quick through the CLI to its end: its stderr and {metric:
    value} from the eval part of its `Finished ...` line."""
    result = run_cli(f"--config=experiments/{experiment}.py:quick", f"--workdir={workdir}")
    assert result.returncode == 0, result.stderr[-3000:]
    line = [l for l in result.stderr.splitlines() if "Finished at step" in l][-1]
    words = line.split("Eval: ", 1)[1].rstrip(".").split()
    return result.stderr, dict(zip(words[::2], map(float, words[1::2])))


@pytest.mark.slow
def test_ddpm_quick_run_reports_its_samples_frechet_distance_when_it_finishes(tmp_path):
    stderr, metrics = quick_run("ddpm_digits", tmp_path)
    assert set(metrics) == {"loss", "frechet_distance", "confidence", "classes_covered"}, metrics
    # Above held-out real digits' 0.13, at most blank images' 15: 60 updates make no digits.
    assert 0.13 < metrics["frechet_distance"] < 15.0, metrics
    assert 0.0 < metrics["loss"] < 2.0, metrics  # Predicting zero noise scores 1.
    assert "eval at step 60: classes_covered" in stderr


@pytest.mark.slow
def test_byol_quick_run_reports_its_representations_accuracies_when_it_finishes(tmp_path):
    _, metrics = quick_run("byol_digits", tmp_path)
    assert set(metrics) == {"loss", "knn_accuracy", "few_label_accuracy", "spread"}, metrics
    assert 0.5 < metrics["knn_accuracy"] <= 1.0 and 0.1 < metrics["few_label_accuracy"] <= 1.0
    assert 0.0 <= metrics["loss"] <= 4.0 and metrics["spread"] > 0.0, metrics


def test_byol_with_bfloat16_master_weights_keeps_its_target_in_float32_and_trains(experiments,
                                                                                   tmp_path):
    """The documented lighter flags on BYOL (the campaign's TypeError at `follow_online`): the
    online network is stored in bfloat16, the target, which no optimizer trains, in float32, and
    `follow_online` reads the online weights cast up."""
    byol = experiments("byol_digits")
    config = byol.get_config("quick")
    config.precision.policy, config.precision.master_weights = "mixed_bfloat16", "bfloat16"
    config.jit_compile = False
    config.train.num_steps = 4
    trainer = byol.BYOLTrainer(config, str(tmp_path))
    online, target = (trainer.model.get_layer(name) for name in ("online", "target"))
    assert {v.dtype for v in online.trainable_weights} == {"bfloat16"}
    assert {v.dtype for v in target.weights if v.dtype != "int64"} <= {"float32"}
    before = [v.numpy() for v in target.weights]
    trainer.train()
    assert int(trainer.run.global_step.numpy()) == 4
    assert all(np.any(b != v.numpy()) for b, v in zip(before, target.weights) if v.trainable is False
               and v.dtype == "float32" and np.size(b) > 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_byol_target_is_the_moving_average_of_the_online_network(experiments, tmp_path, policy):
    """After each update the target's weights are decay * their old value + (1 - decay) * the
    online weights after that update, computed in NumPy, to 1e-6 relative; an update a float16
    overflow skips leaves both as they were."""
    byol = experiments("byol_digits")
    config = byol.get_config("quick")
    config.precision.policy = policy
    config.jit_compile = False  # Graph mode: compiles in a few seconds.
    trainer = byol.BYOLTrainer(config, str(tmp_path))
    online, target = (trainer.model.get_layer(name) for name in ("online", "target"))
    learned = [index for index, weight in enumerate(online.weights) if weight.trainable]
    values = lambda layer: [np.array(layer.weights[index].numpy(), np.float64) for index in learned]
    decay = config.model.target_decay
    expected = values(target)
    np.testing.assert_array_equal(expected[0], values(online)[0])  # It starts as a copy.
    for _ in range(4):
        before = values(online)
        trainer.run.train_loop(1)
        after = values(online)
        if any(not np.array_equal(a, b) for a, b in zip(after, before)):  # Applied, not skipped.
            expected = [decay * t + (1.0 - decay) * o for t, o in zip(expected, after)]
        for got, want in zip(values(target), expected):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert not np.allclose(values(target)[0], values(online)[0])  # It follows, some way behind.


def test_ddpm_cosine_schedule_runs_from_signal_to_noise(experiments):
    schedule = experiments("ddpm_digits").cosine_schedule(500)
    alpha_bar, beta = schedule["alpha_bar"], schedule["beta"]
    assert alpha_bar[0] > 0.9999 and alpha_bar[-1] < 1e-6  # x_0's noise is faint; x_T is all noise.
    assert np.all(np.diff(alpha_bar) < 0) and np.all((0 < beta) & (beta <= 0.999))
    np.testing.assert_allclose(alpha_bar, np.cumprod(schedule["alpha"]))
    previous = np.concatenate([[1.0], alpha_bar[:-1]])
    np.testing.assert_allclose(schedule["posterior_variance"][1:],
                               (beta * (1 - previous) / (1 - alpha_bar))[1:])
    assert schedule["posterior_variance"][0] == 0.0  # The last sampling step adds no noise.
