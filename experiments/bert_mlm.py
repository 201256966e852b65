"""A small keras-hub BERT trained as a masked language model on the standard library's source.

A `keras_hub.models.BertBackbone` built from its config (random weights: no preset, no download, no
tokenizer files) reads byte-level sequences and predicts the bytes hidden behind its masks. The text
is the one charlm reads (the installed standard library's top-level `.py` files; a file goes wholly
to train or to eval), cut at line boundaries into sequences of at most `seq_len` bytes and padded,
so the backbone's padding mask matters. The masks are drawn once, with a seeded NumPy generator,
when the data is built: every run (and every resume) sees the same ones. The backbone's pooler
(`pooled_dense`) stays in the model, unused by the loss, as in BERT pre-training without the
next-sentence task: a variable without a gradient, which the framework must handle.

Run (from the repository root; needs `pip install keras-hub`)::

    python -m mixloop.train --config=experiments/bert_mlm.py --workdir=runs/bert_mlm
    python -m mixloop.train --config=experiments/bert_mlm.py:quick --workdir=runs/bert_mlm_quick

Expect, on 2 CPU cores: about 1.5 minutes (85 s mixed_bfloat16 with XLA fusing the elementwise
ops, 93 s float32 with XLA, 120 s mixed_float16 without XLA measured, each with a 22-25 s probe of
the compile modes; 11-14 updates/s) for 600 updates of a
0.49M-parameter model, and eval 1.92 nats per masked byte, accuracy 0.50 (float32 1.917,
mixed_float16 1.927, no update skipped), against 3.15 nats for the unigram entropy of the train
bytes that the Trainer logs; the eval set has 57,315 masked bytes. The run is sensitive to small
perturbations: float32 alone ends between 1.876 and 1.917 over seeds 0-2, and a 16-bit run lands
within about 1% of float32 of the same seed (+0.2%, +0.2%, +1.0% for mixed_float16; +0.7%, +1.2%,
0.0% for mixed_bfloat16, seeds 0-2): compare over seeds, not one run.
The `quick` variant runs 200 updates of a one-layer model in about 15 seconds and ends near 2.86
nats (its few files: unigram 3.16). Measured with Python 3.11's standard library, as charlm.
"""

from __future__ import annotations

import math
from typing import Optional

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging

import mixloop
from experiments.charlm import read_stdlib_text, unigram_entropy_bits
from mixloop.config import base_config
from mixloop.errors import UserError

PAD, MASK = 0, 1  # Special token ids; the padding mask and the targets both use 0 as "nothing".
NUM_SPECIAL = 2  # Token id = byte + NUM_SPECIAL.
VOCAB_SIZE = 256 + NUM_SPECIAL  # No vocabulary to build or store, as in charlm.
NEWLINE = ord("\n")
# Of the target positions: 80% show [MASK], 10% a random byte, 10% the byte itself (BERT's recipe).
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs."""
    config = base_config()
    config.trainer = "experiments.bert_mlm.BertMLMTrainer"  # The Trainer subclass below.
    config.seed = 0  # Initialization and sequence order.
    config.precision.policy = "mixed_bfloat16"  # 16-bit compute without a loss scale.

    config.model.num_layers = 2  # Transformer encoder layers.
    config.model.hidden_dim = 128  # Width of the residual stream.
    config.model.num_heads = 4  # Attention heads; each has hidden_dim / num_heads dimensions.
    config.model.intermediate_dim = 512  # Hidden width of each layer's feed-forward block.
    # BERT's dropout on embeddings, attention and feed-forward outputs. Off: a run this short sees
    # half the train sequences once and has nothing to regularize; 0.1 ended 0.1 nats worse.
    config.model.dropout = 0.0

    config.data.seq_len = 64  # Bytes per sequence at most: whole lines, then padding.
    config.data.max_chars = 4_000_000  # Read sorted files until this many bytes (train + eval).
    config.data.eval_every_nth_file = 10  # Every 10th sorted file goes to eval, the rest to train.
    config.data.mask_rate = 0.15  # Fraction of the non-pad bytes that are prediction targets.
    config.data.mask_seed = 0  # Draws the masks; apart from `seed`, so every run has the same eval.

    config.train.num_steps = 600  # Optimizer updates: about half a pass over the train sequences.
    config.train.batch_size = 64  # Sequences per update.
    config.train.accumulation_steps = 2  # Two micro-batches of 32 sequences per update.
    config.train.steps_per_loop = 50  # Updates per compiled loop call.
    config.train.log_every_steps = 100  # Console progress line.
    config.train.clip_global_norm = 1.0  # Guards the early updates of a Transformer.
    config.train.repeat_dataset = True  # Repeat the train sequences if the run outlasts them.

    config.optimizer.name = "adamw"  # Adam with decoupled weight decay.
    # Peak learning rate. 5e-3 reached the same mean loss over seeds 0-2 but scattered 3x more from
    # seed to seed, and up to 2.4% from policy to policy; 1e-2 stalled near the unigram entropy.
    config.optimizer.learning_rate = 3e-3
    config.optimizer.schedule = "cosine"  # Cosine decay to 0 after warm-up.
    config.optimizer.warmup_steps = 50  # Linear warm-up from 0.
    config.optimizer.weight_decay = 0.01  # Decoupled weight decay.
    config.optimizer.beta_2 = 0.99  # Faster second-moment estimate for a short run.

    config.eval.every_steps = 300  # Evaluate twice over the run.
    config.eval.num_batches = 0  # The whole eval text.
    config.checkpoint.every_steps = 300  # Save twice over the run.

    if arg == "quick":
        config.model.num_layers = 1  # One layer.
        config.model.hidden_dim = 64  # Narrow.
        config.model.num_heads = 2  # Two heads of 32.
        config.model.intermediate_dim = 128  # Narrow feed-forward block.
        config.data.max_chars = 300_000  # A few files.
        # A step takes milliseconds here and compiling most of the time: enough updates to get
        # past the plateau at the unigram entropy that a post-LayerNorm BERT starts on.
        config.train.num_steps = 200
        config.train.batch_size = 32  # Small batches.
        config.train.steps_per_loop = 50  # Four loop calls.
        config.train.log_every_steps = 100  # Two progress lines.
        config.optimizer.warmup_steps = 20  # Short warm-up.
        config.eval.every_steps = 100  # Evaluate twice.
        config.checkpoint.every_steps = 100  # Save twice.
    elif arg:
        raise ValueError(f"unknown bert_mlm config variant {arg!r}; expected 'quick' or none")
    return config


def import_keras_hub(experiment: str = "bert_mlm"):
    """The keras_hub module, an optional dependency of the experiments that use it.

    Raises:
      UserError: when keras-hub is not installed, saying how to install it.
    """
    try:
        import keras_hub
    except ImportError:
        raise UserError(f"the {experiment} experiment needs keras-hub: pip install keras-hub") from None
    return keras_hub


def line_chunks(text: np.ndarray, seq_len: int) -> np.ndarray:
    """Token ids int32 [N, seq_len]: `text` cut into runs of whole lines of at most `seq_len` bytes.

    Lines are packed greedily, in order; a line longer than `seq_len` is cut into pieces of
    `seq_len`. Each row holds one chunk's bytes + NUM_SPECIAL, then PAD. Every byte of `text` lands
    in exactly one row, in order.
    """
    line_ends = np.flatnonzero(text == NEWLINE) + 1
    cuts, line_start = [0], 0
    for line_end in [*line_ends.tolist(), len(text)]:
        if line_end - cuts[-1] > seq_len and line_start > cuts[-1]:
            cuts.append(line_start)  # The line does not fit: it starts the next chunk.
        while line_end - cuts[-1] > seq_len:
            cuts.append(cuts[-1] + seq_len)  # A line too long for any chunk.
        line_start = line_end
    if cuts[-1] < len(text):
        cuts.append(len(text))
    lengths = np.diff(cuts)
    tokens = np.full((len(lengths), seq_len), PAD, np.int32)
    # The chunks cover `text` contiguously, so row-major order of the non-pad cells is text order.
    tokens[np.arange(seq_len) < lengths[:, np.newaxis]] = text.astype(np.int32) + NUM_SPECIAL
    return tokens


def mask_tokens(tokens: np.ndarray, mask_rate: float,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking of int32 token ids [N, L]: returns (model token ids, targets), both [N, L].

    Each non-pad token is a target with probability `mask_rate`; a target's input becomes [MASK]
    (80%), a random byte (10%) or stays itself (10%). `targets` holds the original token id at
    target positions and 0 elsewhere (no byte has token id 0).
    """
    is_target = (tokens != PAD) & (rng.random(tokens.shape) < mask_rate)
    action = rng.random(tokens.shape)
    is_random = is_target & (action >= MASK_FRACTION) & (action < MASK_FRACTION + RANDOM_FRACTION)
    inputs = np.where(is_target & (action < MASK_FRACTION), MASK, tokens).astype(np.int32)
    inputs[is_random] = rng.integers(0, 256, size=int(is_random.sum())) + NUM_SPECIAL
    return inputs, np.where(is_target, tokens, 0).astype(np.int32)


def as_bert_batch(token_ids: tf.Tensor,
                  targets: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    """(keras-hub's BERT inputs, targets): one segment, padding wherever the token id is PAD."""
    inputs = {
        "token_ids": token_ids,
        "segment_ids": tf.zeros_like(token_ids),
        "padding_mask": tf.cast(token_ids != PAD, tf.int32),
    }
    return inputs, targets


class BertMLMTrainer(mixloop.Trainer):
    """Masked-byte prediction with a keras-hub BERT; eval loss and accuracy on the targets."""

    def build_model(self) -> keras.Model:
        """The backbone called on keras-hub's input dict, then logits over its sequence output."""
        keras_hub = import_keras_hub()
        m, seq_len = self.config.model, self.config.data.seq_len
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCAB_SIZE, num_layers=m.num_layers, num_heads=m.num_heads,
            hidden_dim=m.hidden_dim, intermediate_dim=m.intermediate_dim, dropout=m.dropout,
            max_sequence_length=seq_len, num_segments=1, name="bert")
        inputs = {name: keras.Input(shape=(seq_len,), dtype="int32", name=name)
                  for name in ("token_ids", "segment_ids", "padding_mask")}
        sequence = backbone(inputs)["sequence_output"]  # pooled_output is left unused.
        logits = keras.layers.Dense(VOCAB_SIZE, name="logits")(sequence)
        return keras.Model(inputs, logits, name="bert_mlm")

    def build_datasets(self) -> tuple[tf.data.Dataset, tf.data.Dataset]:
        """Shuffled train sequences and in-order eval sequences, masked once; logs the baseline."""
        d, batch_size = self.config.data, self.config.train.batch_size
        train_text, eval_text = read_stdlib_text(d.max_chars, d.eval_every_nth_file)
        # A model that ignores the context can do no better than the bytes' unigram entropy.
        self.unigram_nats = unigram_entropy_bits(train_text) * math.log(2.0)
        splits = {}
        for index, (name, text) in enumerate((("train", train_text), ("eval", eval_text))):
            rng = np.random.default_rng([d.mask_seed, index])
            splits[name] = mask_tokens(line_chunks(text, d.seq_len), d.mask_rate, rng)
        logging.info(
            "bert_mlm data: %d train and %d eval sequences of at most %d bytes (%.0f%% padding); "
            "unigram entropy %.3f nats/byte", len(splits["train"][0]), len(splits["eval"][0]),
            d.seq_len, 100 * np.mean(splits["train"][0] == PAD), self.unigram_nats)
        num_train = len(splits["train"][0])
        train = (tf.data.Dataset.from_tensor_slices(splits["train"])
                 .shuffle(num_train, seed=self.config.seed, reshuffle_each_iteration=True)
                 .batch(batch_size, drop_remainder=True)
                 .map(as_bert_batch))
        evaluation = (tf.data.Dataset.from_tensor_slices(splits["eval"])
                      .batch(batch_size, drop_remainder=True)
                      .map(as_bert_batch))
        return train, evaluation

    def compute_loss(self, outputs: tf.Tensor, batch: tuple) -> tuple[tf.Tensor, tf.Tensor]:
        """(Sum of cross-entropy in nats over the target positions, number of target positions)."""
        _, targets = batch
        is_target = tf.cast(targets != 0, tf.float32)
        losses = keras.losses.sparse_categorical_crossentropy(targets, outputs, from_logits=True)
        return tf.reduce_sum(losses * is_target), tf.reduce_sum(is_target)

    def eval_metrics(self, outputs: tf.Tensor, batch: tuple) -> dict[str, tf.Tensor]:
        """Cross-entropy in nats per target byte, and the fraction of targets predicted exactly."""
        _, targets = batch
        loss_sum, num_targets = self.compute_loss(outputs, batch)
        correct = tf.equal(tf.argmax(outputs, axis=-1, output_type=tf.int32), targets)
        num_correct = tf.reduce_sum(tf.cast(correct & (targets != 0), tf.float32))
        return {"loss": loss_sum / num_targets, "accuracy": num_correct / num_targets}
