"""A character language model on the Python standard library's own source code.

A small decoder-only Transformer (learned positions, pre-LayerNorm blocks, causal self-attention)
reads fixed windows of bytes and predicts each next byte. The text is the installed standard
library's top-level `.py` files: nothing is downloaded, and a file goes wholly to train or to eval.

Run (from the repository root)::

    python -m mixloop.train --config=experiments/charlm.py --workdir=runs/charlm
    python -m mixloop.train --config=experiments/charlm.py:quick --workdir=runs/charlm_quick

Expect, on 2 CPU cores: about 3 minutes (160 s measured, with a 22 s probe of the compile modes;
13 updates/s with XLA fusing the elementwise ops around oneDNN's bfloat16 matrix products, which
`jit_compile=auto` picks for bfloat16 on a CPU with AVX512_BF16) for 1,500 updates of a
0.47M-parameter model, and eval 1.98 bits per character (loss 1.38 nats), against 4.55 bits for
the unigram entropy of the train text that the Trainer logs, with the most likely next byte right
64% of the time (eval `accuracy` 0.638; 0.58 at step 500).
The `quick` variant runs 40 updates in about 15 seconds and ends near 4.4 bits per character and
accuracy 0.24.

After each eval, TensorBoard's Text tab (`--logdir=runs/charlm`, the `eval` run) shows `sample`:
`config.data.sample_chars` bytes the model writes after "def " (temperature 0.8, a fixed seed, so
steps differ only by the weights). At step 1,500 it has Python's shape, not its sense:
`def blabstractmethods be and gzument socket of the name ...`, then `    return contain`.
Measured with Python 3.11's standard library; another Python version has other files, so the
figures shift a little.
"""

from __future__ import annotations

import math
import pathlib
import sysconfig
from typing import Optional

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging

import mixloop
from mixloop.config import base_config

VOCAB_SIZE = 256  # Bytes: every file encodes without a vocabulary to build or store.
SAMPLE_PROMPT = b"def "  # Every eval's sample continues a function definition.
# Below 1 for fewer stray bytes; greedy decoding (near 0) loops, e.g. into a line of spaces.
SAMPLE_TEMPERATURE = 0.8
SAMPLE_SEED = 0  # One fixed seed, so samples at different steps differ only by the weights.


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs."""
    config = base_config()
    config.trainer = "experiments.charlm.CharLMTrainer"  # The Trainer subclass below.
    config.seed = 0  # Initialization and window order.
    # On 2 Xeon cores (AVX512_BF16, AMX), `python -m mixloop.benchmark` measured 841 examples/s in
    # mixed_bfloat16 (XLA fusing the elementwise ops around oneDNN's bfloat16 matmuls, auto's
    # pick), 717 in float32 (with XLA) and 674 in mixed_float16 (without XLA): bfloat16 1.16x
    # float32 at this width, where the step is mostly elementwise work; 1.96x at d_model 512.
    config.precision.policy = "mixed_bfloat16"  # 16-bit compute without a loss scale.

    config.model.num_layers = 2  # Transformer blocks.
    config.model.d_model = 128  # Width of the residual stream.
    config.model.num_heads = 4  # Attention heads; each has d_model / num_heads dimensions.
    config.model.mlp_dim = 512  # Hidden width of each block's MLP.

    config.data.seq_len = 64  # Bytes per window; the model predicts each next byte.
    config.data.max_chars = 4_000_000  # Read sorted files until this many bytes (train + eval).
    config.data.eval_every_nth_file = 10  # Every 10th sorted file goes to eval, the rest to train.
    config.data.sample_chars = 200  # Bytes the eval's text sample adds after its prompt.

    config.train.num_steps = 1500  # Optimizer updates: about 1.7 passes over the train windows.
    config.train.batch_size = 64  # Windows per update.
    config.train.accumulation_steps = 2  # Two micro-batches of 32 windows per update.
    config.train.steps_per_loop = 50  # Updates per compiled loop call.
    config.train.log_every_steps = 100  # Console progress line.
    config.train.clip_global_norm = 1.0  # Guards the early updates of a Transformer.
    config.train.repeat_dataset = True  # Several passes over the train windows.

    config.optimizer.name = "adamw"  # Adam with decoupled weight decay.
    config.optimizer.learning_rate = 2e-3  # Peak learning rate.
    config.optimizer.schedule = "cosine"  # Cosine decay to 0 after warm-up.
    config.optimizer.warmup_steps = 100  # Linear warm-up from 0.
    config.optimizer.weight_decay = 0.01  # Decoupled weight decay.
    config.optimizer.beta_2 = 0.99  # Faster second-moment estimate for a short run.

    config.eval.every_steps = 500  # Evaluate three times over the run.
    config.eval.num_batches = 0  # The whole eval text.
    config.checkpoint.every_steps = 500  # Save three times over the run.

    if arg == "quick":
        config.model.num_layers = 1  # One block.
        config.model.d_model = 32  # Narrow.
        config.model.num_heads = 2  # Two heads of 16.
        config.model.mlp_dim = 64  # Narrow MLP.
        config.data.seq_len = 32  # Short windows.
        config.data.max_chars = 100_000  # A few files.
        config.data.sample_chars = 40  # A short sample.
        config.train.num_steps = 40  # A few dozen updates.
        config.train.batch_size = 16  # Small batches.
        config.train.steps_per_loop = 10  # Four loop calls.
        config.train.log_every_steps = 20  # Two progress lines.
        config.optimizer.learning_rate = 1e-2  # High enough to see the loss fall in 40 updates.
        config.optimizer.warmup_steps = 5  # Short warm-up.
        config.eval.every_steps = 20  # Evaluate twice.
        config.eval.num_batches = 4  # On a few batches.
        config.checkpoint.every_steps = 20  # Save twice.
    elif arg:
        raise ValueError(f"unknown charlm config variant {arg!r}; expected 'quick' or none")
    return config


def read_stdlib_text(max_chars: int, eval_every_nth_file: int) -> tuple[np.ndarray, np.ndarray]:
    """The uint8 bytes of the standard library's top-level `.py` files, as (train, eval) arrays.

    Files are read in sorted path order until `max_chars` bytes are read; file i goes to eval when
    `i % eval_every_nth_file == eval_every_nth_file - 1`. Each file ends with a newline separator.
    """
    paths = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    parts: dict[str, list[bytes]] = {"train": [], "eval": []}
    total = 0
    for index, path in enumerate(paths):
        if total >= max_chars:
            break
        text = path.read_bytes() + b"\n"
        split = "eval" if index % eval_every_nth_file == eval_every_nth_file - 1 else "train"
        parts[split].append(text)
        total += len(text)
    return tuple(np.frombuffer(b"".join(parts[s]), np.uint8) for s in ("train", "eval"))


def unigram_entropy_bits(text: np.ndarray) -> float:
    """The entropy of the byte frequencies of `text`, in bits: a model that ignores context."""
    counts = np.bincount(text, minlength=VOCAB_SIZE)
    probs = counts[counts > 0] / len(text)
    return float(-(probs * np.log2(probs)).sum())


def windows(text: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping int32 windows [N, seq_len] of `text`, and the same shifted by one byte."""
    num = (len(text) - 1) // seq_len
    inputs = text[: num * seq_len].reshape(num, seq_len)
    targets = text[1 : num * seq_len + 1].reshape(num, seq_len)
    return inputs.astype(np.int32), targets.astype(np.int32)


@keras.saving.register_keras_serializable(package="charlm")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to a [batch, seq_len, dim] input."""

    def build(self, input_shape):
        self.positions = self.add_weight(shape=tuple(input_shape[1:]), initializer="zeros",
                                         name="positions")

    def call(self, x):
        return x + keras.ops.cast(self.positions, x.dtype)


def _block(x, m: ml_collections.ConfigDict, name: str):
    """A pre-LayerNorm Transformer block: causal self-attention, then an MLP, each residual."""
    h = keras.layers.LayerNormalization(name=f"{name}_ln1")(x)
    attention = keras.layers.MultiHeadAttention(m.num_heads, m.d_model // m.num_heads,
                                                name=f"{name}_attention")
    x = x + attention(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name=f"{name}_ln2")(x)
    h = keras.layers.Dense(m.mlp_dim, activation="gelu", name=f"{name}_mlp_in")(h)
    return x + keras.layers.Dense(m.d_model, name=f"{name}_mlp_out")(h)


class CharLMTrainer(mixloop.Trainer):
    """Next-byte prediction with a causal Transformer; reports eval bits per character."""

    def build_model(self) -> keras.Model:
        """Token + position embeddings, `num_layers` blocks, final LayerNorm, logits over bytes."""
        m = self.config.model
        tokens = keras.Input(shape=(self.config.data.seq_len,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(VOCAB_SIZE, m.d_model, name="token_embedding")(tokens)
        x = PositionEmbedding(name="position_embedding")(x)
        for index in range(m.num_layers):
            x = _block(x, m, name=f"block{index}")
        x = keras.layers.LayerNormalization(name="final_ln")(x)
        logits = keras.layers.Dense(VOCAB_SIZE, name="logits")(x)
        return keras.Model(tokens, logits, name="charlm")

    def build_datasets(self) -> tuple[tf.data.Dataset, tf.data.Dataset]:
        """Shuffled train windows and in-order eval windows, batched; logs the unigram baseline."""
        d, batch_size = self.config.data, self.config.train.batch_size
        train_text, eval_text = read_stdlib_text(d.max_chars, d.eval_every_nth_file)
        self.unigram_bits_per_char = unigram_entropy_bits(train_text)
        logging.info("charlm data: %d train bytes, %d eval bytes; unigram entropy %.3f bits/char",
                     len(train_text), len(eval_text), self.unigram_bits_per_char)
        train_windows = windows(train_text, d.seq_len)
        num_windows = len(train_windows[0])
        train = (tf.data.Dataset.from_tensor_slices(train_windows)
                 .shuffle(num_windows, seed=self.config.seed, reshuffle_each_iteration=True)
                 .batch(batch_size, drop_remainder=True))
        evaluation = (tf.data.Dataset.from_tensor_slices(windows(eval_text, d.seq_len))
                      .batch(batch_size, drop_remainder=True))
        return train, evaluation

    def compute_loss(self, outputs: tf.Tensor, batch: tuple) -> mixloop.Loss:
        """Mean cross-entropy in nats per byte (every window has seq_len targets), and the share of
        bytes whose most likely prediction is right (`accuracy`)."""
        _, targets = batch
        losses = keras.losses.sparse_categorical_crossentropy(targets, outputs, from_logits=True)
        correct = tf.equal(tf.argmax(outputs, axis=-1, output_type=tf.int32), targets)
        return mixloop.Loss(tf.reduce_mean(losses),
                            metrics={"accuracy": tf.reduce_mean(tf.cast(correct, tf.float32))})

    def eval_metrics(self, outputs: tf.Tensor, batch: tuple) -> dict[str, tf.Tensor]:
        """Cross-entropy in nats, in bits per character to compare with the unigram entropy, and
        next-byte accuracy."""
        loss = self.compute_loss(outputs, batch)
        return {"loss": loss.value, "bits_per_char": loss.value / math.log(2.0), **loss.metrics}

    def actions(self) -> list[mixloop.Action]:
        """A text sample after each eval."""
        return [mixloop.Action(self.write_sample, at_eval=True)]

    def write_sample(self, step: int) -> None:
        """Writes a sample after `SAMPLE_PROMPT` as the text summary `sample` (default writer)."""
        sample = self.generate(SAMPLE_PROMPT, self.config.data.sample_chars)
        tf.summary.text("sample", sample.decode("utf-8", errors="replace"), step=step)

    def generate(self, prompt: bytes, num_bytes: int, *, temperature: float = SAMPLE_TEMPERATURE,
                 seed: int = SAMPLE_SEED) -> bytes:
        """`prompt` and `num_bytes` bytes sampled after it one at a time, in the run's precision.

        Each byte is drawn from the float32 logits divided by `temperature`, with NumPy's generator
        for `seed`, so the same weights give the same bytes. The model reads `seq_len` bytes: the
        text so far, or its last `seq_len` bytes once it is longer.
        """
        seq_len = self.config.data.seq_len
        rng = np.random.default_rng(seed)
        text = np.zeros(len(prompt) + num_bytes + seq_len, np.int32)  # Room for the last window.
        text[: len(prompt)] = np.frombuffer(prompt, np.uint8)
        for end in range(len(prompt), len(prompt) + num_bytes):
            start = max(0, end - seq_len)
            # Causal: the zeros after `end` do not reach the logits read at `end - 1`, and the text
            # starts at position 0 as every training window does, with no padding before it.
            logits = self._next_byte_logits(text[None, start : start + seq_len],
                                            tf.constant(end - 1 - start))
            text[end] = _sample(logits.numpy().astype(np.float64), temperature, rng)
        return text[: len(prompt) + num_bytes].astype(np.uint8).tobytes()

    @tf.function
    def _next_byte_logits(self, tokens: tf.Tensor, position: tf.Tensor) -> tf.Tensor:
        """The float32 logits [VOCAB_SIZE] at `position` of tokens int32 [1, seq_len]."""
        return mixloop.forward(self.model, self.policy, tokens, training=False)[0, position]


def _sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """A byte drawn from softmax(logits / temperature)."""
    scaled = logits / temperature
    probs = np.exp(scaled - scaled.max())
    return int(rng.choice(len(probs), p=probs / probs.sum()))
