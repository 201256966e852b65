"""experiments/gan_digits.py: the sample-quality judge on known inputs, the sample grid, and the
quick run through the CLI with two objectives, each skipping and backing off on its own."""

import importlib

import numpy as np
import pytest
import tensorflow as tf

from test_experiments import REPO, last_eval, run_cli


@pytest.fixture
def gan(monkeypatch):
    """The experiment module, imported as the CLI imports it: from the repository root."""
    monkeypatch.syspath_prepend(REPO)
    return importlib.import_module("experiments.gan_digits")


@pytest.fixture
def split(gan):
    """(train images, train labels, held-out images) as the experiment splits them, in [0, 1]."""
    images, labels = importlib.import_module("experiments.digits").load_digits_arrays()
    config = gan.get_config()
    order = np.random.default_rng(config.data.split_seed).permutation(len(labels))
    eval_index, train_index = np.split(order, [config.data.num_eval])
    return images[train_index], labels[train_index], images[eval_index]


def test_judge_tells_real_digits_from_noise_blanks_and_one_class(gan, split):
    train_images, train_labels, held_out = split
    judge = gan.DigitJudge(train_images, train_labels)
    rng = np.random.default_rng(0)

    real = judge(held_out)
    assert real["frechet_distance"] < 0.2
    assert real["confidence"] > 0.95 and real["classes_covered"] == 10

    noise = judge(rng.uniform(0.0, 1.0, (512, 8, 8, 1)))
    assert noise["frechet_distance"] > 5.0 and noise["confidence"] < 0.7

    blank = judge(np.zeros((512, 8, 8, 1)))
    assert blank["frechet_distance"] > 10.0 and blank["classes_covered"] == 1

    zeros = judge(train_images[train_labels == 0])  # Perfect digits, but a single class.
    assert zeros["confidence"] > 0.99 and zeros["classes_covered"] == 1
    assert zeros["frechet_distance"] > 20 * real["frechet_distance"]


def test_frechet_distance_of_diagonal_gaussians_is_the_closed_form(gan):
    mean_a, mean_b = np.array([0.0, 1.0, 0.0]), np.array([2.0, 1.0, 0.0])
    var_a, var_b = np.array([4.0, 1.0, 0.0]), np.array([1.0, 9.0, 0.0])  # Singular, as digits' are.
    expected = 4.0 + np.sum((np.sqrt(var_a) - np.sqrt(var_b)) ** 2)  # 4 + 1 + 4
    assert gan.frechet_distance(mean_a, np.diag(var_a), mean_b, np.diag(var_b)) == pytest.approx(expected)
    assert gan.frechet_distance(mean_a, np.diag(var_a), mean_a, np.diag(var_a)) == pytest.approx(0.0, abs=1e-12)


def test_sample_grid_places_each_digit_in_its_framed_tile(gan):
    images = np.arange(64, dtype=np.float64)[:, None, None, None] * np.ones((64, 8, 8, 1)) / 64
    grid = gan.sample_grid(images)
    tile = 9 * gan.GRID_ZOOM  # An 8x8 digit with a one-pixel border, zoomed.
    assert grid.shape == (1, 8 * tile, 8 * tile, 1)
    row, column = 2, 5
    top, left = row * tile, column * tile
    assert grid[0, top, left, 0] == 0.5  # The border.
    digit = grid[0, top + gan.GRID_ZOOM: top + tile, left + gan.GRID_ZOOM: left + tile, 0]
    np.testing.assert_array_equal(digit, (row * 8 + column) / 64)


@pytest.mark.slow
def test_quick_run_trains_both_objectives_with_their_own_loss_scales(tmp_path):
    """Started at 2**24, each loss scale halves on its own objective's overflows only: every skipped
    update is one halving (no growth within 200 updates) and every other update reaches the
    objective's optimizer. (Without retries, whose halvings land on updates that are applied.)"""
    initial_scale = 2.0**24
    result = run_cli("--config=experiments/gan_digits.py:quick", f"--workdir={tmp_path}",
                     f"--config.precision.initial_scale={initial_scale}",
                     "--config.precision.overflow_retries=0")
    assert result.returncode == 0, result.stderr[-3000:]

    checkpoint = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(tmp_path / "checkpoints")))
    value = lambda key: checkpoint.get_tensor(f"{key}/.ATTRIBUTES/VARIABLE_VALUE")
    assert value("state/global_step") == 200
    for name in ("generator", "discriminator"):
        skipped = int(value(f"state/skips/{name}/skipped_total"))
        assert 1 <= skipped <= 20, (name, skipped)
        assert value(f"objectives/{name}/optimizer_variables/0") == 200 - skipped  # Applied updates.
        assert value(f"objectives/{name}/loss_scale/_scale") == initial_scale / 2**skipped

    metrics = last_eval(result.stderr)
    assert 0.0 < metrics["frechet_distance"] < 15.0  # Below blank images' 15.
    assert 0.0 < metrics["confidence"] <= 1.0 and 1 <= metrics["classes_covered"] <= 10
    for name in ("discriminator_loss", "generator_loss"):
        assert np.isfinite(metrics[name]), metrics
    assert 0.0 <= metrics["real_accuracy"] <= 1.0 and 0.0 <= metrics["fake_accuracy"] <= 1.0

    samples = [tf.make_ndarray(value.tensor) for path in (tmp_path / "eval").glob("events.*")
               for event in tf.compat.v1.train.summary_iterator(str(path))
               for value in event.summary.value if value.tag == "samples"]
    assert len(samples) == 2  # After each of the two evals.
    side = str(8 * 9 * 4).encode()
    assert list(samples[-1][:2]) == [side, side]  # Width, height of the PNG.
