"""The shipped experiments run end to end through the CLI in their quick variants."""

import importlib
import os
import re
import sys

import cli_runs
import numpy as np
import pytest

from mixloop.errors import UserError

REPO = cli_runs.REPO

pytestmark = pytest.mark.slow


def run_cli(*args):
    return cli_runs.run("mixloop.train", *args, cwd=REPO)


def last_eval(stderr):
    """{metric: value} from the last 'eval at step N: name value ...' line."""
    line = [l for l in stderr.splitlines() if "eval at step" in l][-1]
    words = line.split(": ", 2)[-1].split()
    return dict(zip(words[::2], map(float, words[1::2])))


def test_charlm_quick(tmp_path):
    result = run_cli("--config=experiments/charlm.py:quick", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = last_eval(result.stderr)
    assert metrics["bits_per_char"] == pytest.approx(metrics["loss"] / 0.6931472, rel=1e-4)
    assert "unigram" in result.stderr
    assert (tmp_path / "model.keras").exists()


def test_digits_quick(tmp_path):
    result = run_cli("--config=experiments/digits.py:quick", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert 0.0 <= last_eval(result.stderr)["accuracy"] <= 1.0


def test_bert_mlm_quick(tmp_path):
    pytest.importorskip("keras_hub")
    result = run_cli("--config=experiments/bert_mlm.py:quick", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    unigram = float(re.search(r"unigram entropy ([0-9.]+) nats/byte", result.stderr).group(1))
    metrics = last_eval(result.stderr)
    # Below the unigram entropy of the bytes: the backbone reads the context around each mask.
    assert metrics["loss"] < unigram - 0.1, (metrics, unigram)
    assert 0.0 < metrics["accuracy"] <= 1.0
    assert (tmp_path / "model.keras").exists()


def test_vit_digits_quick(tmp_path):
    pytest.importorskip("keras_hub")
    result = run_cli("--config=experiments/vit_digits.py:quick", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "precision.float32_layers=auto: probed 2 train batches" in result.stderr
    assert last_eval(result.stderr)["accuracy"] > 0.15  # Chance is 0.1 (30 updates: 0.24).
    assert (tmp_path / "model.keras").exists()


def test_reversal_examples_reverse_each_sequence_and_teacher_force_it(monkeypatch):
    monkeypatch.syspath_prepend(REPO)  # Imported as the CLI imports it: from the repository root.
    from experiments.t5_reverse import NUM_SPECIAL, PAD, START, reversal_examples

    arrays = reversal_examples(64, num_symbols=5, seq_len=8, rng=np.random.default_rng(0))
    for row in range(64):
        length = int(arrays["encoder_padding_mask"][row].sum())
        sequence = arrays["encoder_token_ids"][row, :length]
        assert 4 <= length <= 8 and (sequence >= NUM_SPECIAL).all()
        assert (arrays["encoder_token_ids"][row, length:] == PAD).all()
        assert list(arrays["targets"][row, :length]) == list(sequence[::-1])
        assert (arrays["targets"][row, length:] == PAD).all()
        assert arrays["decoder_token_ids"][row, 0] == START
        assert list(arrays["decoder_token_ids"][row, 1:length]) == list(sequence[::-1][:-1])
        # START and the reversal (its last token is read only past the last target, if at all).
        assert arrays["decoder_padding_mask"][row].sum() == min(length + 1, 8)


def test_simclr_digits_quick_trains_on_the_whole_batch_loss(tmp_path):
    result = run_cli("--config=experiments/simclr_digits.py:quick", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = last_eval(result.stderr)
    assert 0.5 < metrics["knn_accuracy"] <= 1.0 and 0.0 < metrics["few_label_accuracy"] <= 1.0
    # 4 micro-batches of 32 pairs, but NT-Xent over all 128 pairs (255 candidates: chance log 255 =
    # 5.54): above what a micro-batch's loss can start at (63 candidates, log 63 = 4.14).
    train_loss = float(re.search(r"step 20/40  loss ([0-9.]+)", result.stderr).group(1))
    assert 4.6 < train_loss < 5.6
    assert (tmp_path / "model.keras").exists()


def test_wgan_gp_digits_quick_updates_the_generator_every_5_steps(tmp_path):
    result = run_cli("--config=experiments/wgan_gp_digits.py:quick", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"step 50/100  .*updates/generator 10 ", result.stderr)
    assert 0.0 < last_eval(result.stderr)["frechet_distance"]
    assert (tmp_path / "model.keras").exists()


@pytest.fixture
def bert_mlm(monkeypatch):
    """The experiment module, imported as the CLI imports it: from the repository root."""
    monkeypatch.syspath_prepend(REPO)
    return importlib.import_module("experiments.bert_mlm")


def test_bert_mlm_cuts_whole_lines_and_masks_only_text(bert_mlm):
    text = np.frombuffer(b"ab\ncdefghijklm\nx\ny\n\nzz", np.uint8)
    tokens = bert_mlm.line_chunks(text, seq_len=5)
    chunks = [bytes((row[row != bert_mlm.PAD] - bert_mlm.NUM_SPECIAL).astype(np.uint8))
              for row in tokens]
    # Lines pack greedily; the line too long for a chunk is cut, its tail packs with what follows.
    assert chunks == [b"ab\n", b"cdefg", b"hijkl", b"m\nx\n", b"y\n\nzz"]
    assert tokens[0].tolist() == [ord("a") + 2, ord("b") + 2, ord("\n") + 2, 0, 0]

    tokens = np.tile(tokens, (2000, 1))
    inputs, targets = bert_mlm.mask_tokens(tokens, 0.15, np.random.default_rng(0))
    is_target = targets != 0
    assert not (is_target & (tokens == bert_mlm.PAD)).any()
    np.testing.assert_array_equal(targets[is_target], tokens[is_target])
    np.testing.assert_array_equal(inputs[~is_target], tokens[~is_target])
    assert is_target.sum() / (tokens != bert_mlm.PAD).sum() == pytest.approx(0.15, abs=0.01)
    assert (inputs[is_target] == bert_mlm.MASK).mean() == pytest.approx(0.8, abs=0.02)
    assert inputs.min() >= 0 and inputs.max() < bert_mlm.VOCAB_SIZE


def test_bert_mlm_without_keras_hub_is_one_user_error(bert_mlm, monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # `import keras_hub` raises ImportError.
    with pytest.raises(UserError, match="pip install keras-hub"):
        bert_mlm.import_keras_hub()


def test_unknown_variant_is_one_line(tmp_path):
    result = run_cli("--config=experiments/charlm.py:bogus", f"--workdir={tmp_path}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "ValueError: unknown charlm config variant 'bogus'; expected 'quick' or none")
    assert not os.listdir(tmp_path)
