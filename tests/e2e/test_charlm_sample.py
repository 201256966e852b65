"""charlm's text sample (deterministic, the prompt then the asked bytes, changed by training) and
its next-byte accuracy metric, on the quick variant."""

import cli_runs
import glob
import importlib

import numpy as np
import pytest
import tensorflow as tf

from mixloop.engine.micro_step import forward

REPO = cli_runs.REPO


@pytest.fixture
def charlm(monkeypatch):
    """The experiment module, imported as the CLI imports it: from the repository root."""
    monkeypatch.syspath_prepend(REPO)
    return importlib.import_module("experiments.charlm")


@pytest.fixture
def trainer(charlm, tmp_path):
    config = charlm.get_config("quick")
    config.train.num_steps = 20  # Enough to move the sample; fewer compiled loop calls.
    return charlm.CharLMTrainer(config, str(tmp_path))


def test_sample_is_prompt_then_bytes_asked_the_same_twice_and_moved_by_training(charlm, trainer,
                                                                                tmp_path):
    num_bytes = trainer.config.data.sample_chars
    before = trainer.generate(charlm.SAMPLE_PROMPT, num_bytes)
    assert before == trainer.generate(charlm.SAMPLE_PROMPT, num_bytes)
    assert before.startswith(charlm.SAMPLE_PROMPT)
    assert len(before) == len(charlm.SAMPLE_PROMPT) + num_bytes
    assert num_bytes > trainer.config.data.seq_len  # So the window slides.

    trainer.train()
    after = trainer.generate(charlm.SAMPLE_PROMPT, num_bytes)
    assert after != before and after == trainer.generate(charlm.SAMPLE_PROMPT, num_bytes)
    assert after.startswith(charlm.SAMPLE_PROMPT) and len(after) == len(before)
    # The one eval, at the last step, wrote the trained model's sample to the eval run.
    assert text_summaries(tmp_path / "eval", "sample") == {
        trainer.config.train.num_steps: after.decode("utf-8", errors="replace")}


def test_accuracy_is_the_share_of_bytes_whose_argmax_is_the_next_byte(trainer):
    batch = next(iter(trainer.eval_data))
    inputs, targets = batch
    outputs = forward(trainer.model, trainer.policy, inputs, training=False)
    expected = np.mean(np.argmax(outputs.numpy(), axis=-1) == targets.numpy())
    accuracy = trainer.compute_loss(outputs, batch).metrics["accuracy"]
    assert accuracy.numpy() == pytest.approx(expected)
    # Eval reports it beside bits per character, from the same batch.
    trainer.config.eval.num_batches = 1
    metrics = trainer.evaluate()
    assert metrics["accuracy"] == pytest.approx(expected)
    assert set(metrics) == {"loss", "bits_per_char", "accuracy"}


def text_summaries(logdir, tag: str) -> dict[int, str]:
    """{step: text} of the text summaries named `tag` in `logdir`'s event files."""
    return {event.step: tf.make_ndarray(value.tensor).item().decode()
            for path in glob.glob(str(logdir / "events.*"))
            for event in tf.compat.v1.train.summary_iterator(path)
            for value in event.summary.value if value.tag == tag}
