"""A small keras-hub T5 (encoder-decoder) learns to reverse sequences of random symbols.

A `keras_hub.models.T5Backbone` built from its config (random weights: no preset, no download)
reads a sequence of 4 to `seq_len` symbols, padded, and its decoder writes the sequence reversed,
teacher-forced. The sequences are drawn once with a seeded NumPy generator (nothing ships or
downloads; every run and resume sees the same ones). T5 is here because it is a model nobody here
wrote that float16 breaks: its attention adds `(1 - mask) * -1e9` to the scores, which is `-inf`
in float16, and a fully padded row then turns into NaN. With the default
`precision.float32_layers=auto` a mixed_float16 run finds the attention layers that do so before
the first update and computes only those in float32.

Run (from the repository root; needs `pip install keras-hub`)::

    python -m mixloop.train --config=experiments/t5_reverse.py --workdir=runs/t5_reverse
    python -m mixloop.train --config=experiments/t5_reverse.py:quick --workdir=runs/t5_quick

docs/results.md has its figures and the command that made them.
"""

from __future__ import annotations

from typing import Optional

import keras
import ml_collections
import numpy as np
import tensorflow as tf

import mixloop
from experiments.bert_mlm import import_keras_hub
from mixloop.config import base_config

PAD, START = 0, 1  # Token ids: padding (also "no target"), and the decoder's start token.
NUM_SPECIAL = 2  # Symbol s has token id s + NUM_SPECIAL.
MIN_LENGTH = 4  # The shortest sequence.


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs."""
    config = base_config()
    config.trainer = "experiments.t5_reverse.T5ReverseTrainer"  # The Trainer subclass below.
    config.seed = 0  # Initialization and example order.
    config.precision.policy = "mixed_float16"  # The policy whose range T5's masks exceed.

    config.model.num_layers = 2  # Encoder layers, and as many decoder layers.
    config.model.num_heads = 4  # Attention heads.
    config.model.hidden_dim = 64  # Width of the residual stream.
    config.model.intermediate_dim = 128  # Width of the gated feed-forward layers.
    config.model.dropout = 0.0  # The task has unlimited data: nothing to regularize.

    config.data.num_symbols = 32  # Distinct symbols; chance accuracy is 1/32.
    config.data.seq_len = 8  # Longest sequence (and the padded length).
    config.data.num_train = 16384  # Train sequences, drawn once.
    config.data.num_eval = 1024  # Eval sequences, drawn from their own generator.
    config.data.data_seed = 0  # The generator that draws them; fixed apart from `seed`.

    config.train.num_steps = 8000  # About 16 passes over the train sequences.
    config.train.batch_size = 32  # Sequences per update.
    config.train.steps_per_loop = 50  # Updates per compiled loop call.
    config.train.log_every_steps = 100  # Console progress line.
    config.train.repeat_dataset = True  # More than one pass.

    config.optimizer.name = "adamw"  # Adam with decoupled weight decay.
    config.optimizer.learning_rate = 3e-3  # Peak learning rate.
    config.optimizer.schedule = "cosine"  # Cosine decay to 0 after warm-up.
    config.optimizer.warmup_steps = 400  # Linear warm-up from 0.
    config.optimizer.weight_decay = 1e-4  # Decoupled weight decay.

    config.eval.every_steps = 2000  # Evaluate four times.
    config.checkpoint.every_steps = 4000  # Save twice.

    if arg == "quick":
        config.model.num_layers = 1  # One encoder and one decoder layer.
        config.model.hidden_dim = 32  # Narrow.
        config.model.intermediate_dim = 64
        config.data.num_train = 1024  # Few sequences.
        config.data.num_eval = 128
        config.train.num_steps = 40  # A few dozen updates.
        config.train.steps_per_loop = 10
        config.train.log_every_steps = 20
        config.optimizer.warmup_steps = 5
        config.eval.every_steps = 20
        config.checkpoint.every_steps = 20
    elif arg:
        raise ValueError(f"unknown t5_reverse config variant {arg!r}; expected 'quick' or none")
    return config


def reversal_examples(num: int, num_symbols: int, seq_len: int,
                      rng: np.random.Generator) -> dict[str, np.ndarray]:
    """`num` random sequences and their reversals as T5's inputs, int32 [num, seq_len] each.

    `encoder_token_ids` holds the sequence then PAD; `decoder_token_ids` is START then the reversed
    sequence shifted right (teacher forcing); `targets` the reversed sequence, PAD where nothing is
    to be predicted. The padding masks are 1 over the sequence (and START).
    """
    lengths = rng.integers(MIN_LENGTH, seq_len + 1, num)
    in_sequence = np.arange(seq_len)[np.newaxis, :] < lengths[:, np.newaxis]
    symbols = rng.integers(0, num_symbols, (num, seq_len)) + NUM_SPECIAL
    tokens = np.where(in_sequence, symbols, PAD).astype(np.int32)
    # Position i of the reversal reads position length - 1 - i of the sequence.
    source = np.clip(lengths[:, np.newaxis] - 1 - np.arange(seq_len), 0, seq_len - 1)
    targets = np.where(in_sequence, np.take_along_axis(tokens, source, axis=1), PAD)
    decoder_tokens = np.concatenate([np.full((num, 1), START), targets[:, :-1]], axis=1)
    return {"encoder_token_ids": tokens, "encoder_padding_mask": in_sequence.astype(np.int32),
            "decoder_token_ids": decoder_tokens.astype(np.int32),
            "decoder_padding_mask": (decoder_tokens != PAD).astype(np.int32),
            "targets": targets.astype(np.int32)}


class T5ReverseTrainer(mixloop.Trainer):
    """Sequence reversal with a keras-hub T5; eval loss and per-token accuracy on the targets."""

    def build_model(self) -> keras.Model:
        """The backbone on keras-hub's four inputs, then logits over its decoder's output."""
        keras_hub = import_keras_hub("t5_reverse")
        m, d = self.config.model, self.config.data
        backbone = keras_hub.models.T5Backbone(
            vocabulary_size=d.num_symbols + NUM_SPECIAL, num_layers=m.num_layers,
            num_heads=m.num_heads, hidden_dim=m.hidden_dim, intermediate_dim=m.intermediate_dim,
            dropout=m.dropout, name="t5")
        inputs = {name: keras.Input(shape=(d.seq_len,), dtype="int32", name=name)
                  for name in ("encoder_token_ids", "encoder_padding_mask", "decoder_token_ids",
                               "decoder_padding_mask")}
        decoded = backbone(inputs)["decoder_sequence_output"]
        logits = keras.layers.Dense(d.num_symbols + NUM_SPECIAL, name="logits")(decoded)
        return keras.Model(inputs, logits, name="t5_reverse")

    def build_datasets(self) -> tuple[tf.data.Dataset, tf.data.Dataset]:
        """Shuffled train batches and in-order eval batches of (inputs, targets)."""
        d, batch_size = self.config.data, self.config.train.batch_size
        rng = np.random.default_rng(d.data_seed)
        train = reversal_examples(d.num_train, d.num_symbols, d.seq_len, rng)
        evaluation = reversal_examples(d.num_eval, d.num_symbols, d.seq_len, rng)

        def batches(arrays: dict[str, np.ndarray]) -> tf.data.Dataset:
            targets = arrays.pop("targets")
            return tf.data.Dataset.from_tensor_slices((arrays, targets))

        return (batches(train).shuffle(d.num_train, seed=self.config.seed,
                                       reshuffle_each_iteration=True)
                .batch(batch_size, drop_remainder=True),
                batches(evaluation).batch(batch_size, drop_remainder=True))

    def compute_loss(self, outputs: tf.Tensor, batch: tuple) -> tuple[tf.Tensor, tf.Tensor]:
        """Cross-entropy summed over the target tokens, and their number: a per-token mean."""
        _, targets = batch
        weights = tf.cast(targets != PAD, tf.float32)
        losses = keras.losses.sparse_categorical_crossentropy(targets, outputs, from_logits=True)
        return tf.reduce_sum(losses * weights), tf.reduce_sum(weights)

    def eval_metrics(self, outputs: tf.Tensor, batch: tuple) -> dict[str, tf.Tensor]:
        """Per-token loss (nats) and accuracy over the target tokens."""
        _, targets = batch
        weights = tf.cast(targets != PAD, tf.float32)
        correct = tf.cast(tf.equal(tf.argmax(outputs, axis=-1, output_type=tf.int32), targets),
                          tf.float32)
        total, count = self.compute_loss(outputs, batch)
        return {"loss": total / count, "accuracy": tf.reduce_sum(correct * weights) / count}
