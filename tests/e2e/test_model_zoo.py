"""Models nobody here wrote train unchanged under every policy: keras-hub backbones (post-LN BERT with
dict inputs, padding masks and an unused pooler; pre-LN GPT-2), a `keras.applications` CNN with
BatchNormalization, a model with an unused head, and a dict-output model.

Each is built from a small config with random weights (nothing is downloaded), trained for a few
updates by the compiled step on one fixed batch, and must: run, apply its updates, lower the loss,
start within 16-bit rounding of the float32 loss, and compute its body in the policy's dtype.
"""

import cli_runs

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.engine.layer_precision import named_layers
from mixloop.engine.loss import as_loss
from mixloop.engine.loss_scale import DynamicLossScale, NoLossScale
from mixloop.engine.policy import Policy
from mixloop.engine.micro_step import forward

keras_hub = pytest.importorskip("keras_hub")

pytestmark = pytest.mark.slow

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
VOCAB, SEQ_LEN, BATCH = 96, 16, 8
NUM_APPLIED = 4  # Updates to apply; float16 may skip some more while its scale backs off from 2**15.
# MobileNetV2 at random init, BatchNorm over micro-batches of 4, skipped 11 (scale down to 2**4), as
# any dynamic scale starting at 2**15 would (Keras's LossScaleOptimizer, PyTorch's GradScaler).
MAX_SKIPPED = {"float32": 0, "mixed_float16": 12, "mixed_bfloat16": 0}
# The loss before training (dropout off) under 16-bit compute, against float32 from the same weights.
START_LOSS_RTOL = {"float32": 1e-6, "mixed_float16": 5e-3, "mixed_bfloat16": 3e-2}


def token_batch(with_segments):
    """Dict inputs with ragged lengths (padding masks in use) and next-token targets, padding 0."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(SEQ_LEN // 2, SEQ_LEN + 1, BATCH)
    mask = np.arange(SEQ_LEN)[None, :] < lengths[:, None]
    tokens = rng.integers(1, VOCAB, (BATCH, SEQ_LEN)) * mask
    inputs = {"token_ids": tokens, "padding_mask": mask}
    if with_segments:
        inputs["segment_ids"] = np.zeros_like(tokens)
    targets = np.roll(tokens, -1, axis=1) * mask
    return tf.nest.map_structure(tf.constant, (inputs, targets.astype("int32")))


def masked_token_loss(outputs, batch):
    """Token-weighted cross-entropy over the non-padding positions, as (sum, count)."""
    weights = tf.cast(batch[0]["padding_mask"], tf.float32)
    losses = keras.losses.sparse_categorical_crossentropy(batch[1], outputs, from_logits=True)
    return tf.reduce_sum(losses * weights), tf.reduce_sum(weights)


def lm_on(backbone_fn):
    """A language-model head over a keras-hub backbone's sequence output."""

    def build():
        backbone = backbone_fn()
        inputs = {name: keras.Input((SEQ_LEN,), dtype="int32", name=name) for name in backbone.input}
        outputs = backbone(inputs)
        sequence = outputs["sequence_output"] if isinstance(outputs, dict) else outputs
        return keras.Model(inputs, keras.layers.Dense(VOCAB, name="logits")(sequence))

    return build


def bert():
    # Post-LayerNorm blocks (`x + residual` after a LayerNormalization) and a pooler no loss reads.
    return keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                        hidden_dim=32, intermediate_dim=64,
                                        max_sequence_length=SEQ_LEN, dropout=0.1)


def gpt2():
    # Pre-LayerNorm decoder blocks with a causal mask and keras-hub's PositionEmbedding.
    return keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                        hidden_dim=32, intermediate_dim=64,
                                        max_sequence_length=SEQ_LEN, dropout=0.1)


def mobilenet():
    return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                          classes=10, classifier_activation=None)


def vit():
    # keras-hub's Vision Transformer: patches, a class token, pre-LN blocks; logits on the token.
    backbone = keras_hub.models.ViTBackbone(image_shape=(32, 32, 3), patch_size=8, num_layers=2,
                                            num_heads=2, hidden_dim=32, mlp_dim=64)
    images = keras.Input((32, 32, 3))
    return keras.Model(images, keras.layers.Dense(10, name="logits")(backbone(images)[:, 0, :]))


def image_batch():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(BATCH, 32, 32, 3)), tf.float32),
            tf.constant(rng.integers(0, 10, BATCH), tf.int32))


def class_loss(outputs, batch):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch[1], outputs,
                                                                       from_logits=True))


def with_unused_head():
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    keras.layers.Dense(5, name="unused_head")(hidden)  # built, tracked, never in the loss
    shared = keras.Model(inputs, hidden, name="trunk")
    outer = keras.Input((12,))
    trunk_out = shared(outer)
    head = keras.layers.Dense(7, name="unused_projection")
    head(trunk_out)  # variables exist, output unused
    model = keras.Model(outer, keras.layers.Dense(10, name="logits")(trunk_out))
    model.unused_projection = head  # tracked by the model, as research code often leaves a head
    return model


def dict_output():
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(32, activation="relu", name="dense")(inputs)
    return keras.Model(inputs, {"logits": keras.layers.Dense(10, name="logits")(hidden),
                                "hidden": hidden})


def vector_batch():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(BATCH, 12)), tf.float32),
            tf.constant(rng.integers(0, 10, BATCH), tf.int32))


def dict_output_loss(outputs, batch):
    # The hidden output is float32 here (the step casts outputs), and joins the loss as a penalty.
    return class_loss(outputs["logits"], batch) + 1e-3 * tf.reduce_mean(tf.square(outputs["hidden"]))


ZOO = {
    "bert": (lm_on(bert), lambda: token_batch(with_segments=True), masked_token_loss),
    "gpt2": (lm_on(gpt2), lambda: token_batch(with_segments=False), masked_token_loss),
    "mobilenet_v2": (mobilenet, image_batch, class_loss),
    "vit": (vit, image_batch, class_loss),
    "unused_head": (with_unused_head, vector_batch, class_loss),
    "dict_output": (dict_output, vector_batch, dict_output_loss),
}
BODY_LAYERS = {  # a layer that must compute in the policy's dtype
    "bert": "bert_backbone/transformer_layer_0/feedforward_intermediate_dense",
    "gpt2": "gpt2_backbone/transformer_layer_0/feedforward_intermediate_dense",
    "mobilenet_v2": "Conv1",
    "vit": "vi_t_backbone/vit_encoder/transformer_block_1/mlp/dense_1",
    "unused_head": "trunk/hidden",
    "dict_output": "dense",
}


def eval_loss(model, policy, batch, loss_fn):
    """The loss of the model's forward pass in `policy`, dropout off."""
    loss = as_loss(loss_fn(forward(model, policy, batch[0], training=False), batch))
    return float(loss.value / loss.weight)


def train(name, policy_name, weights=None):
    """(loss before training, first and last train loss, skipped updates, model) of training on one
    fixed batch until NUM_APPLIED updates are applied (or too many are skipped). Without XLA: a
    handful of updates does not repay XLA's compile (MobileNetV2 under three policies: 74 s with
    XLA, 38 s without); test_step runs the same step under XLA."""
    build_fn, batch_fn, loss_fn = ZOO[name]
    keras.utils.set_random_seed(0)
    policy = Policy.from_string(policy_name)
    model = mixloop.build_model(build_fn, policy)
    if weights is not None:
        model.set_weights(weights)
    step = mixloop.TrainStep(
        model=model, optimizer=keras.optimizers.AdamW(1e-3), loss_fn=loss_fn, policy=policy,
        loss_scale=DynamicLossScale() if policy.compute_dtype == tf.float16 else NoLossScale(),
        accumulation_steps=2, clip_global_norm=1.0, jit_compile=False)
    batch = batch_fn()
    initial = eval_loss(model, policy, batch, loss_fn)
    results = []
    while sum(bool(r["applied"]) for r in results) < NUM_APPLIED and len(results) < 20:
        results.append(step(batch)["objectives"]["model"])
    skipped = len(results) - NUM_APPLIED
    return initial, float(results[0]["loss"]), float(results[-1]["loss"]), skipped, model


@pytest.mark.parametrize("name", sorted(ZOO))
def test_trains_unchanged_under_every_policy(name):
    weights = mixloop.build_model(ZOO[name][0], Policy.from_string("float32")).get_weights()
    float32_initial = None
    for policy_name in POLICIES:
        initial, first, last, skipped, model = train(name, policy_name, weights)
        float32_initial = initial if float32_initial is None else float32_initial
        assert np.isfinite([first, last]).all(), policy_name
        assert 0 <= skipped <= MAX_SKIPPED[policy_name], (policy_name, skipped)
        assert last < first, (policy_name, first, last)
        assert initial == pytest.approx(float32_initial, rel=START_LOSS_RTOL[policy_name]), policy_name
        compute = Policy.from_string(policy_name).compute_dtype.name
        assert named_layers(model)[BODY_LAYERS[name]].compute_dtype == compute, policy_name


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_bert_with_its_layer_norms_kept_in_float32_trains(policy_name):
    """The post-LN case that crashed when a float32 LayerNormalization returned float32 into
    `x + residual` inside keras-hub's TransformerEncoder: now it hands the compute dtype back."""
    policy = Policy.from_string(policy_name)
    model = mixloop.build_model(lm_on(bert), policy, float32_layers=".*_layer_norm")
    norms = [layer for path, layer in named_layers(model).items() if path.endswith("_layer_norm")]
    assert len(norms) == 5 and {layer.compute_dtype for layer in norms} == {"float32"}
    step = mixloop.TrainStep(model=model, optimizer=keras.optimizers.AdamW(1e-3),
                             loss_fn=masked_token_loss, policy=policy, jit_compile=False)
    batch = token_batch(with_segments=True)
    losses = [float(step(batch)["objectives"]["model"]["loss"]) for _ in range(3)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


T5_ATTENTION = ["t5/transformer_decoder_layer_0/cross_attention",
                "t5/transformer_decoder_layer_0/self_attention",
                "t5/transformer_encoder_layer_0/self_attention"]


def test_t5_trains_with_the_default_settings_under_every_policy(tmp_path, monkeypatch):
    """keras-hub T5 (encoder-decoder) through the Trainer with no precision setting: its attention
    adds `(1 - mask) * -1e9`, NaN in float16, so float16's default probe must move exactly its
    attention layers (not the backbone) before the first update; nothing skips, and every policy
    ends where float32 does."""
    # The experiment, imported as the CLI imports it: from the repository root.
    monkeypatch.syspath_prepend(cli_runs.REPO)
    from experiments import t5_reverse
    from mixloop.cli import import_trainer

    final_loss = {}
    for policy_name in POLICIES:
        config = t5_reverse.get_config("quick")
        config.precision.policy = policy_name
        config.jit_compile = False
        config.train.num_steps = config.train.steps_per_loop = config.train.log_every_steps = 8
        config.eval.every_steps = config.checkpoint.every_steps = 0
        trainer = import_trainer(config.trainer)(config, str(tmp_path / policy_name))
        metrics = trainer.train()
        keras.config.set_dtype_policy("float32")

        layers = named_layers(trainer.model)
        in_float32 = sorted(path for path, layer in layers.items()
                            if layer.compute_dtype == "float32" and path.endswith("attention"))
        compute = Policy.from_string(policy_name).compute_dtype.name
        moved = policy_name == "mixed_float16"
        assert in_float32 == (T5_ATTENTION if moved or compute == "float32" else []), policy_name
        assert layers["t5"].compute_dtype == compute, policy_name  # Not the backbone.
        assert layers["t5/transformer_encoder_layer_0/input_projector"].compute_dtype == compute
        assert metrics["skipped_total"] == 0, policy_name
        final_loss[policy_name] = metrics["loss"]
    for policy_name, loss in final_loss.items():
        assert loss == pytest.approx(final_loss["float32"], rel=START_LOSS_RTOL[policy_name] + 5e-3)
