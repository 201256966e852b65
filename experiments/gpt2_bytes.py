"""A small keras-hub GPT-2 as a byte-level language model on the Python standard library's source.

A `keras_hub.models.GPT2Backbone` built from its config (random weights: no preset, no download, no
tokenizer files) over the 256 byte values, its logits from the token embedding read in reverse (the
input and output embeddings tied, as GPT-2 ties them), trained on charlm's data (the installed
standard library's top-level `.py` files, a file wholly to train or to eval, cut into fixed windows)
to predict each next byte, and reporting eval bits per character as charlm does. Every window is
full, so the backbone's padding mask is all ones; the causal mask is GPT-2's own.

Run (from the repository root; needs `pip install keras-hub`)::

    python -m mixloop.train --config=experiments/gpt2_bytes.py --workdir=runs/gpt2_bytes
    python -m mixloop.train --config=experiments/gpt2_bytes.py:quick --workdir=runs/gpt2_bytes_quick

and the lighter run (bfloat16 master weights, int8 Adam moments, bfloat16 accumulators)::

    python -m mixloop.train --config=experiments/gpt2_bytes.py --workdir=runs/gpt2_bytes_light \\
        --config.precision.master_weights=bfloat16 --config.optimizer.state_dtype=int8 \\
        --config.train.accumulation_dtype=bfloat16

Expect, on 2 CPU cores (measured with --config.jit_compile=False, the loop in graph mode, two runs
at a time on a 2-core AMD EPYC, so the times are loose): about 4.5 minutes for 2000 updates of a
0.44M-parameter model, and eval near 2.04 bits per character, against 4.55 bits for the unigram
entropy the Trainer logs. At this learning rate a run barely depends on how its sums are rounded:
float32 with and without XLA ends 0.0003 bits apart for seed 0 and 0.0016 for seed 1 (at 5e-3 and
600 updates, the earlier defaults, 0.16 bits, and the seed moved a run by up to 0.35), so what a
precision costs shows. Over seeds 0-2 (`--config.seed=S`, float32 with
`--config.precision.policy=float32`):

    float32         2.0442 / 1.9937 / 2.0833   mean 2.0404
    mixed_bfloat16  2.0263 / 2.0330 / 2.0448   mean 2.0347 (-0.28%)
    lighter run     2.0491 / 2.0156 / 2.0482   mean 2.0376 (-0.14%)

The lighter run's start line is `persistent state 6.64 B/param (weights 2.00, optimizer state 2.64,
accumulators 2.00, EMA 0.00)` against float32's 16.00: the two embedding tables (9% of the
parameters) keep float32 moments (engine/compact_optimizer.py). Quantized, they ended it at
2.0637 / 2.0742 / 2.0807 (mean 2.0729, +1.6%), in 6.08 B/param; with only bfloat16 weights or only
int8 moments quantizing them cost nothing (seed 1: 2.0133 and 1.9904, against mixed_bfloat16's
2.0330). Peak resident set size is about 1.18 GB in float32, 1.15 GB in mixed_bfloat16 and
1.22 GB for the lighter run: at this size the runtime, not the 7 MB of state, is the peak, and the
lighter settings' quantization and rounding add their temporaries to it.
The `quick` variant runs 40 updates of a one-block model in under a minute (9 s measured alone,
graph mode chosen without a probe) and ends near 4.7 bits per character (4.68) on its few eval
batches. Measured with Python 3.11's standard library, as charlm.
"""

from __future__ import annotations

from typing import Optional

import keras
import ml_collections

from experiments.bert_mlm import import_keras_hub
from experiments.charlm import VOCAB_SIZE, CharLMTrainer
from mixloop.config import base_config


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
    """The default run, or with `arg="quick"` a tiny one for tests and smoke runs."""
    config = base_config()
    config.trainer = "experiments.gpt2_bytes.GPT2BytesTrainer"  # The Trainer subclass below.
    config.seed = 0  # Initialization and window order.
    config.precision.policy = "mixed_bfloat16"  # 16-bit compute without a loss scale.

    config.model.num_layers = 2  # GPT-2 decoder blocks.
    config.model.hidden_dim = 128  # Width of the residual stream.
    config.model.num_heads = 4  # Attention heads; each has hidden_dim / num_heads dimensions.
    config.model.intermediate_dim = 512  # Hidden width of each block's feed-forward layer.
    # GPT-2's dropout on embeddings, attention and feed-forward outputs. Off: a run this short sees
    # the train windows once and has nothing to regularize.
    config.model.dropout = 0.0

    config.data.seq_len = 64  # Bytes per window, and the backbone's max_sequence_length.
    config.data.max_chars = 4_000_000  # Read sorted files until this many bytes (train + eval).
    config.data.eval_every_nth_file = 10  # Every 10th sorted file goes to eval, the rest to train.
    config.data.sample_chars = 200  # Bytes the eval's text sample adds after its prompt.

    config.train.num_steps = 2000  # Optimizer updates: about 2.2 passes over the train windows.
    config.train.batch_size = 64  # Windows per update.
    config.train.accumulation_steps = 2  # Two micro-batches of 32 windows per update.
    config.train.steps_per_loop = 50  # Updates per compiled loop call.
    config.train.log_every_steps = 250  # Console progress line.
    config.train.clip_global_norm = 1.0  # Guards the early updates of a Transformer.
    config.train.repeat_dataset = True  # Repeat the train windows if the run outlasts them.

    config.optimizer.name = "adamw"  # Adam with decoupled weight decay.
    # Peak learning rate. At 5e-3 (600 updates) a run was chaotic: float32 seed 0 ended 0.16 bits
    # apart with and without XLA, so a precision's effect hid in the noise; at 2e-3, 0.0003 bits.
    config.optimizer.learning_rate = 2e-3
    config.optimizer.schedule = "cosine"  # Cosine decay to 0 after warm-up.
    config.optimizer.warmup_steps = 50  # Linear warm-up from 0.
    config.optimizer.weight_decay = 0.01  # Decoupled weight decay.
    config.optimizer.beta_2 = 0.99  # Faster second-moment estimate for a short run.

    config.eval.every_steps = 500  # Evaluate four times over the run.
    config.eval.num_batches = 0  # The whole eval text.
    config.checkpoint.every_steps = 1000  # Save twice over the run.

    if arg == "quick":
        config.model.num_layers = 1  # One block.
        config.model.hidden_dim = 32  # Narrow.
        config.model.num_heads = 2  # Two heads of 16.
        # Narrow feed-forward layer, whose kernels (4,096 values) are the smallest int8 moments
        # quantize: the token embedding's table keeps float32 moments.
        config.model.intermediate_dim = 128
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
        raise ValueError(f"unknown gpt2_bytes config variant {arg!r}; expected 'quick' or none")
    return config


class GPT2BytesTrainer(CharLMTrainer):
    """charlm's data, loss, metrics and samples, with a keras-hub GPT-2 backbone as the model."""

    def build_model(self) -> keras.Model:
        """Byte windows int32 [batch, seq_len] -> logits [batch, seq_len, 256]: the backbone on the
        windows with an all-ones padding mask, then its token embedding transposed (tied)."""
        keras_hub = import_keras_hub("gpt2_bytes")
        m, seq_len = self.config.model, self.config.data.seq_len
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB_SIZE, num_layers=m.num_layers, num_heads=m.num_heads,
            hidden_dim=m.hidden_dim, intermediate_dim=m.intermediate_dim, dropout=m.dropout,
            max_sequence_length=seq_len)
        # keras-hub's causal LM reads the logits from the token embedding in reverse, and rebuilds
        # that tie when an export is loaded (a functional model calling the backbone's embedding
        # itself would load as a second, empty embedding).
        language_model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        # The model takes the windows alone, as charlm's does, so charlm's data, eval and sampling
        # (which calls the model on byte windows) apply unchanged.
        tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
        logits = language_model({"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens)})
        return keras.Model(tokens, logits, name="gpt2_bytes")
