"""experiments/gpt2_bytes.py: a keras-hub GPT-2 byte LM whose logits are its tied token embedding,
and its quick variant trained lighter (bfloat16 master weights, int8 Adam moments, bfloat16
accumulators) through the CLI, weighing less per parameter than float32."""

import math
import re
import types

import cli_runs
import keras
import numpy as np
import pytest
import tensorflow as tf

keras_hub = pytest.importorskip("keras_hub")

REPO = cli_runs.REPO
LIGHTER = ("--config.precision.master_weights=bfloat16", "--config.optimizer.state_dtype=int8",
           "--config.train.accumulation_dtype=bfloat16")
ADAM_MOMENTS = 2  # Adam(W) keeps two moments per parameter.


@pytest.fixture
def gpt2_bytes(monkeypatch):
    """The experiment module, imported as the CLI imports it: from the repository root."""
    monkeypatch.syspath_prepend(REPO)
    from experiments import gpt2_bytes

    return gpt2_bytes


def memory_line(stderr):
    """(total, {part: bytes per parameter}) from the run's 'memory: ...' start line."""
    match = re.search(r"memory: [0-9,]+ parameters; persistent state ([0-9.]+) B/param \(([^)]*)\)",
                      stderr)
    parts = dict(re.fullmatch(r"(.+) ([0-9.]+)", part).groups() for part in match[2].split(", "))
    return float(match[1]), {part: float(size) for part, size in parts.items()}


def float32_bytes_per_parameter(config):
    """What the same run keeps per parameter in float32: weights, Adam's moments, the accumulators
    (with more than one micro-batch) and the EMA (with a decay), 4 bytes each."""
    size = tf.float32.size
    return {"weights": size, "optimizer state": ADAM_MOMENTS * size,
            "accumulators": size if config.train.accumulation_steps > 1 else 0,
            "EMA": size if config.train.ema_decay else 0}


def test_logits_are_the_tied_token_embedding(gpt2_bytes):
    config = gpt2_bytes.get_config("quick")
    model = gpt2_bytes.GPT2BytesTrainer.build_model(types.SimpleNamespace(config=config))
    backbone = model.get_layer("gpt2_causal_lm").backbone
    # No output projection of its own: the head reads the backbone's token embedding.
    assert model.count_params() == backbone.count_params()
    tokens = np.random.default_rng(0).integers(0, 256, (2, config.data.seq_len)).astype("int32")
    logits = model(tokens)
    assert logits.shape == (2, config.data.seq_len, 256)
    embeddings = backbone.token_embedding.embeddings
    sequence = backbone({"token_ids": tokens, "padding_mask": np.ones_like(tokens)})
    np.testing.assert_allclose(logits, keras.ops.matmul(sequence, keras.ops.transpose(embeddings)),
                               rtol=1e-5, atol=1e-6)


def test_the_saved_model_loads_with_its_tie_and_computes_the_same_logits(gpt2_bytes, tmp_path):
    """What the run exports: the tied embedding loads once, shared (a functional model calling the
    backbone's embedding itself loaded it a second time, empty: "expected 1 variables, but
    received 0")."""
    config = gpt2_bytes.get_config("quick")
    model = gpt2_bytes.GPT2BytesTrainer.build_model(types.SimpleNamespace(config=config))
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    tokens = np.random.default_rng(0).integers(0, 256, (2, config.data.seq_len)).astype("int32")
    np.testing.assert_array_equal(loaded(tokens), model(tokens))
    assert loaded.count_params() == model.count_params()


def test_unknown_variant_names_the_known_one(gpt2_bytes):
    with pytest.raises(ValueError, match="expected 'quick' or none"):
        gpt2_bytes.get_config("bogus")


@pytest.mark.slow
def test_quick_trains_lighter_than_float32(gpt2_bytes, tmp_path):
    # Graph mode: the compile-mode probe would take longer than these 40 updates.
    result = cli_runs.run("mixloop.train", "--config=experiments/gpt2_bytes.py:quick",
                          f"--workdir={tmp_path}", "--config.jit_compile=False", *LIGHTER, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]

    losses = [float(loss) for loss in re.findall(r"step \d+/40  loss ([0-9.]+)", result.stderr)]
    assert len(losses) == 2 and losses[1] < losses[0] < math.log(256), losses  # From uniform, down.
    assert "Weights stored in bfloat16" in result.stderr

    total, parts = memory_line(result.stderr)
    assert total == pytest.approx(sum(parts.values()), abs=0.02)
    config = gpt2_bytes.get_config("quick")
    float32 = float32_bytes_per_parameter(config)
    # Every weight and accumulator in bfloat16; the moments in int8 codes with float32 block scales
    # (small tensors and the embedding tables stay float32): less than float32's, more than one byte
    # a moment.
    assert parts["weights"] == tf.bfloat16.size
    assert parts["accumulators"] == float32["accumulators"] / 2 > 0
    assert ADAM_MOMENTS * tf.int8.size < parts["optimizer state"] < float32["optimizer state"]
    assert parts["EMA"] == float32["EMA"]
    assert total < sum(float32.values())
    assert (tmp_path / "model.keras").exists()
