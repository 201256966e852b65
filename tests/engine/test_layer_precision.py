"""Per-layer precision, read from the traced train step: which ops run in 16 bits and which in float32."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.config import ConfigError
from mixloop.engine.layer_precision import (FLOAT32_LAYER_TYPES, OWN_POLICY, building_under,
                                            describe_placement, keep_float32_layers, move_to_float32,
                                            named_layers, own_float32_layers)
from mixloop.engine.policy import Policy
from mixloop.engine.step import TrainStep

NUM_TOKENS, SEQ_LEN, WIDTH, NUM_CLASSES, BATCH_SIZE = 32, 6, 8, 3, 4
COMPUTE_DTYPES = {"float32": "float32", "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
MATRIX_OPS = ("MatMul", "BatchMatMulV2", "Einsum", "Conv2D", "Conv2DBackpropFilter")


def transformer():
    tokens = keras.Input((SEQ_LEN,), dtype="int32")
    x = keras.layers.Embedding(NUM_TOKENS, WIDTH, name="embed")(tokens)
    x = keras.layers.Dense(WIDTH, activation="relu", name="body")(x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    # dropout > 0 makes Keras use its explicit Softmax sublayer; dropout = 0 its fused
    # ops.dot_product_attention path, which carries out the softmax itself.
    x = keras.layers.MultiHeadAttention(2, WIDTH // 2, dropout=0.1, name="attention_softmax")(x, x)
    x = keras.layers.MultiHeadAttention(2, WIDTH // 2, dropout=0.0, name="attention_fused")(x, x)
    x = keras.layers.Dense(WIDTH, name="pre_norm_proj")(x)  # a name a user regex may catch
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(NUM_CLASSES, name="logits")(x))


def convnet():
    # A Sequential model whose output layer is not called "logits": it computes in the compute dtype.
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv_body"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(NUM_CLASSES, name="classifier"),
    ])


def token_batch():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.integers(0, NUM_TOKENS, (BATCH_SIZE, SEQ_LEN)), tf.int32),
            tf.constant(rng.integers(0, NUM_CLASSES, BATCH_SIZE), tf.int32))


def image_batch():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(BATCH_SIZE, 6, 6, 2)), tf.float32),
            tf.constant(rng.integers(0, NUM_CLASSES, BATCH_SIZE), tf.int32))


def cross_entropy(logits, batch):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch[1], logits, from_logits=True))


def make_step(build_fn, policy_name, float32_layers="", optimizer=None, loss_fn=cross_entropy):
    policy = Policy.from_string(policy_name)
    model = mixloop.build_model(build_fn, policy, float32_layers=float32_layers)
    return TrainStep(model=model, optimizer=optimizer or keras.optimizers.SGD(0.1), loss_fn=loss_fn,
                     policy=policy)


def traced_ops(step, batch):
    """(op type, op name, data dtype) for every op of the compiled step, including those inside
    conditional branches and loop bodies, which live in the graph's function library."""
    graph_def = step.compiled.get_concrete_function(batch).graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return [(n.op, n.name, _data_dtype(n)) for n in nodes]


def _data_dtype(node):
    """The dtype an op computes in: its `T` attribute (`Tparams` for gathers); casts have neither."""
    for name in ("T", "Tparams"):
        attr = node.attr.get(name)
        if attr is not None and attr.WhichOneof("value") == "type":
            return tf.as_dtype(attr.type).name
    return None


def ops_in(ops, scope, types=None):
    """The floating ops under layer `scope`'s name scope (Keras appends `_<n>` to repeated names)."""
    pattern = re.compile(rf"(^|/){scope}(_\d+)*/")
    return [(t, name, dtype) for t, name, dtype in ops
            if pattern.search(name) and dtype in COMPUTE_DTYPES.values() and (types is None or t in types)]


def dtypes_of(ops):
    assert ops, "no ops matched: the scope or op types are wrong, so the check would prove nothing"
    return {dtype for _, _, dtype in ops}


@pytest.mark.parametrize("policy_name", sorted(COMPUTE_DTYPES))
def test_transformer_body_in_compute_dtype_and_sensitive_layers_in_float32(policy_name):
    compute = COMPUTE_DTYPES[policy_name]
    step = make_step(transformer, policy_name)
    ops = traced_ops(step, token_batch())

    # Forward and backward matrix products of the dense layers, the attention projections and the
    # attention score/value products run in the compute dtype; every op of the body Dense does.
    for scope in ("body", "pre_norm_proj", "attention_softmax", "attention_fused"):
        assert dtypes_of(ops_in(ops, scope, MATRIX_OPS)) == {compute}, scope
    assert dtypes_of(ops_in(ops, "body")) == {compute}
    # Embedding and norm run in float32 forward and backward by Keras's own design (a gather from the
    # float32 table; statistics in float32), logits by name, and so do both attention softmaxes: the
    # explicit sublayer (kept by type, its scope is `softmax`) and the fused one (Keras's own).
    for scope in ("embed", "norm", "logits", "softmax"):
        assert dtypes_of(ops_in(ops, scope)) == {"float32"}, scope
    assert dtypes_of(ops_in(ops, "attention_softmax", ("Softmax",))) == {"float32"}
    assert dtypes_of(ops_in(ops, "attention_fused", ("Softmax",))) == {"float32"}

    metrics = step(token_batch())["objectives"]["model"]
    assert bool(metrics["applied"]) and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_conv_body_in_compute_dtype(policy_name):
    ops = traced_ops(make_step(convnet, policy_name), image_batch())
    conv_ops = ops_in(ops, "conv_body", MATRIX_OPS)
    assert {t for t, _, _ in conv_ops} == {"Conv2D", "Conv2DBackpropFilter"}
    assert dtypes_of(conv_ops) == {COMPUTE_DTYPES[policy_name]}
    # Being the model's output is no reason for float32: the step casts outputs to float32 after it.
    assert dtypes_of(ops_in(ops, "classifier", MATRIX_OPS)) == {COMPUTE_DTYPES[policy_name]}


def test_user_regex_forces_a_layer_and_a_whole_block_to_float32():
    step = make_step(transformer, "mixed_float16", float32_layers=r"pre_norm_proj|attention_fused")
    ops = traced_ops(step, token_batch())
    assert dtypes_of(ops_in(ops, "pre_norm_proj")) == {"float32"}
    # Naming the attention block keeps its projections (its sublayers) in float32 too.
    assert dtypes_of(ops_in(ops, "attention_fused", MATRIX_OPS)) == {"float32"}
    for scope in ("body", "attention_softmax"):
        assert dtypes_of(ops_in(ops, scope, MATRIX_OPS)) == {"float16"}, scope


def test_layers_in_float32_by_a_policy_of_their_own_are_named_apart_from_the_placement():
    """A layer built with dtype="float32" (Keras's idiom for an output layer) keeps it; the placement
    line names it, but not a sublayer of a layer the placement keeps."""
    policy = Policy.from_string("mixed_float16")
    with building_under(policy):
        inputs = keras.Input((WIDTH,))
        own = keras.layers.Dense(WIDTH, dtype="float32", name="own")(inputs)
        kept_block = keras.Sequential([keras.layers.Dense(WIDTH, dtype="float32", name="inner")],
                                      name="block")
        model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(kept_block(own)))
    kept = keep_float32_layers(model, policy, "block")
    assert own_float32_layers(model, policy, kept) == [
        mixloop.engine.layer_precision.Float32Layer("own", OWN_POLICY)]
    assert own_float32_layers(model, Policy.from_string("float32"), []) == []
    line = describe_placement(kept + own_float32_layers(model, policy, kept), policy)
    assert line.endswith(f"; 1 by {OWN_POLICY} (own)")


def test_keep_float32_layers_reports_the_layers_it_switched_and_why():
    policy = Policy.from_string("mixed_float16")
    with building_under(policy):
        model = transformer()
    kept = keep_float32_layers(model, policy, r".*(norm|proj).*")

    reasons = {without_counter(layer.path): layer.reason for layer in kept}
    assert reasons == {
        "norm": "precision.float32_layers", "pre_norm_proj": "precision.float32_layers",
        "attention_softmax/softmax": "Softmax (default type)",
        "attention_fused/softmax": "Softmax (default type)", "logits": "named logits"}
    float32_layers = {path for path, layer in named_layers(model).items() if layer.compute_dtype == "float32"}
    assert float32_layers == {layer.path for layer in kept}
    assert model.get_layer("body").compute_dtype == "float16"
    assert model.get_layer("embed").compute_dtype == "float16"  # Keras gathers float32 rows itself
    line = without_counter(describe_placement(kept, policy))
    assert line == ("Layers computing in float32, the rest in float16: 2 by precision.float32_layers "
                    "(norm, pre_norm_proj); 2 by Softmax (default type) (attention_softmax/softmax, "
                    "attention_fused/softmax); 1 by named logits (logits)")


def without_counter(text):
    """Keras numbers auto-named layers in build order (softmax, softmax_1, ...) across the process."""
    return re.sub(r"(softmax)_\d+", r"\1", text)


def nested_backbone_model():
    """A functional backbone nested in a model, as keras-hub backbones are, with a post-LN block."""
    inputs = keras.Input((SEQ_LEN, WIDTH))
    x = keras.layers.Dense(WIDTH, name="proj")(inputs)
    normed = keras.layers.LayerNormalization(name="norm")(x)
    x = normed + keras.layers.Dense(WIDTH, name="ffn")(normed)  # plain arithmetic after the norm
    backbone = keras.Model(inputs, x, name="backbone")
    outer_inputs = keras.Input((SEQ_LEN, WIDTH))
    hidden = backbone(outer_inputs)
    return keras.Model(outer_inputs, {"logits": keras.layers.Dense(NUM_CLASSES, name="logits")(hidden),
                                      "hidden": keras.layers.Dense(WIDTH, name="hidden")(hidden)})


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_a_float32_layer_hands_the_compute_dtype_back_and_outputs_leave_in_float32(policy_name):
    compute = COMPUTE_DTYPES[policy_name]
    policy = Policy.from_string(policy_name)
    model = mixloop.build_model(nested_backbone_model, policy, float32_layers="backbone/norm")
    x = tf.ones((BATCH_SIZE, SEQ_LEN, WIDTH))
    outputs = model(policy.cast_to_compute(x))  # the post-LN `normed + ffn(normed)` adds one dtype

    assert model.get_layer("backbone").get_layer("norm").compute_dtype == "float32"
    assert outputs["logits"].dtype == "float32"  # kept by name, and a model output: not handed back
    # A dict output does not force its layer to float32; the step casts every output afterwards.
    assert outputs["hidden"].dtype == compute
    assert model.get_layer("hidden").compute_dtype == compute
    assert model.get_layer("backbone").get_layer("ffn").compute_dtype == compute


def test_paths_of_nested_models_include_the_nested_model_and_attention_internals():
    with building_under(Policy.from_string("mixed_float16")):
        paths = list(named_layers(nested_backbone_model()))
        attention_paths = [without_counter(path) for path in named_layers(transformer())]
    assert paths[:4] == ["backbone", "backbone/proj", "backbone/norm", "backbone/ffn"]
    assert "attention_softmax/softmax" in attention_paths
    assert "attention_softmax/query" in attention_paths


class PostNormBlock(keras.layers.Layer):
    """A subclassed post-LN block, as keras-hub writes them: plain arithmetic after the norm."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(WIDTH, name="ffn")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, x):
        normed = self.norm(x)
        return normed + self.dense(normed)


def post_norm_model():
    inputs = keras.Input((SEQ_LEN, WIDTH))
    x = PostNormBlock(name="block")(keras.layers.Dense(WIDTH, name="proj")(inputs))
    return keras.Model(inputs, keras.layers.Dense(NUM_CLASSES, name="logits")(x))


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_a_float32_layer_inside_a_subclassed_block_hands_the_compute_dtype_back(policy_name):
    policy = Policy.from_string(policy_name)
    model = mixloop.build_model(post_norm_model, policy, float32_layers="block/norm")
    norm = named_layers(model)["block/norm"]
    x = policy.cast_to_compute(tf.ones((BATCH_SIZE, SEQ_LEN, WIDTH)))
    assert norm.compute_dtype == "float32"
    assert norm(x).dtype == COMPUTE_DTYPES[policy_name]  # cast back: `normed + ffn(normed)` works
    assert model(x).dtype == "float32"  # the logits layer, a model output, keeps its float32


def test_a_float32_layer_in_a_functional_model_passes_float32_on():
    """So a float32 neighbour reads values 16 bits could not hold (the doctor's hot-layer cure)."""
    def build():
        inputs = keras.Input((4,))
        hot = keras.layers.Lambda(lambda x: x * 1e5, name="hot")(inputs)
        return keras.Model(inputs, keras.layers.Dense(1, name="squash")(hot))

    model = mixloop.build_model(build, Policy.from_string("mixed_float16"), float32_layers="hot|squash")
    assert np.isfinite(model(tf.ones((2, 4))).numpy()).all()


def test_a_regex_that_matches_no_layer_is_an_error_naming_real_paths():
    with pytest.raises(ConfigError) as raised:
        mixloop.build_model(nested_backbone_model, Policy.from_string("mixed_float16"),
                            float32_layers="backbone_typo/norm")
    message = str(raised.value)
    assert message.startswith("config.precision.float32_layers='backbone_typo/norm' fully matches no "
                              "layer path; paths look like: backbone/norm, ")
    assert "\n" not in message and "'.*softmax.*'" in message
    # A regex is checked under float32 too: a typo is a typo whatever the policy.
    with pytest.raises(ConfigError):
        mixloop.build_model(nested_backbone_model, Policy.from_string("float32"), float32_layers="nope")


TYPES_16_BITS_DO_NOT_BREAK = {
    "LayerNormalization": lambda: keras.layers.LayerNormalization(),
    "BatchNormalization": lambda: keras.layers.BatchNormalization(),
    "GroupNormalization": lambda: keras.layers.GroupNormalization(groups=8),
    "RMSNormalization": lambda: keras.layers.RMSNormalization(),
}
TYPES_16_BITS_BREAK = {
    "Softmax": lambda: keras.layers.Softmax(),
    "UnitNormalization": lambda: keras.layers.UnitNormalization(),
}


def error_against_float32(make_layer, name, policy_name):
    """max |16-bit layer - float32 layer| on the same 16-bit input, in units of the largest rounding
    error of the float32 result to 16 bits: about 1 when the layer computes in float32 inside."""
    compute = COMPUTE_DTYPES[policy_name]
    rng = np.random.default_rng(0)
    scale = 8.0 if name == "Softmax" else 300.0  # scores; activations large enough to overflow x**2
    x = tf.cast(tf.constant(rng.normal(size=(4, 8, 512)) * scale, tf.float32), compute)
    results = []
    for policy in ("float32", policy_name):
        with building_under(Policy.from_string(policy)):
            layer = make_layer()
        # The float32 layer reads the same values in float32: some Keras ops return their input dtype.
        inputs = Policy.from_string(policy).cast_to_compute(x)
        results.append(tf.cast(layer(inputs, training=True), tf.float32).numpy())
    reference, result = results
    rounding = np.max(np.abs(tf.cast(tf.cast(reference, compute), tf.float32).numpy() - reference))
    return np.max(np.abs(result - reference)) / rounding


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_default_float32_types_are_the_ones_16_bits_break(policy_name):
    """The measurement behind FLOAT32_LAYER_TYPES (WORKSPACE.md): Keras's Layer-, Batch-, Group- and
    RMSNormalization already compute in float32 inside (error: one rounding of the result), while
    Softmax and UnitNormalization in float16 err by several roundings (measured 3.3x; UnitNormalization
    ~3000x, its sum of squares overflowing). TensorFlow's CPU kernels do bfloat16 softmax in float32
    (1.0x), and float16 softmax too on a CPU with native float16 arithmetic (AVX512_FP16: 1.0x); one
    list serves both dtypes, every CPU and GPUs, whose kernels differ."""
    assert set(TYPES_16_BITS_BREAK) == {t.__name__ for t in FLOAT32_LAYER_TYPES}
    for name, make_layer in TYPES_16_BITS_DO_NOT_BREAK.items():
        assert error_against_float32(make_layer, name, policy_name) <= 1.01, name
    if policy_name == "mixed_float16":  # bfloat16 on this CPU: 1.0 and 1.4; one list serves both
        softmax = error_against_float32(TYPES_16_BITS_BREAK["Softmax"], "Softmax", policy_name)
        assert softmax > 3.0 or (softmax <= 1.01 and _cpu_has("avx512_fp16")), softmax
        assert error_against_float32(TYPES_16_BITS_BREAK["UnitNormalization"], "UnitNormalization",
                                     policy_name) > 3.0


def _cpu_has(flag):
    """Whether /proc/cpuinfo lists the CPU feature `flag` (False where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(flag in line.split() for line in cpuinfo if line.startswith("flags"))
    except OSError:
        return False


@pytest.mark.parametrize("spec", ["float32", "p=f16,c=f16,o=f16"])
def test_policies_that_are_not_mixed_keep_nothing(spec):
    policy = Policy.from_string(spec)
    with building_under(policy):
        model = transformer()
    assert keep_float32_layers(model, policy, ".*") == []
    assert {layer.compute_dtype for layer in model._flatten_layers(include_self=False)} == {policy.compute_dtype.name}


def test_build_model_restores_the_global_policy():
    keras.config.set_dtype_policy("float32")
    seen = []

    def build_fn():
        seen.append(keras.config.dtype_policy().name)
        return convnet()

    mixloop.build_model(build_fn, Policy.from_string("mixed_bfloat16"))
    assert seen == ["mixed_bfloat16"]
    assert keras.config.dtype_policy().name == "float32"


class RecordingSGD(keras.optimizers.SGD):
    """SGD that records, while the step is traced, the dtypes of the gradients it is handed."""

    def apply(self, grads, trainable_variables=None):
        self.grad_dtypes = {tf.as_dtype(g.dtype).name for g in grads}
        return super().apply(grads, trainable_variables)


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_loss_gradients_slots_and_variables_are_float32(policy_name):
    seen_output_dtypes = []

    def loss_fn(logits, batch):
        seen_output_dtypes.append(logits.dtype.name)
        return cross_entropy(logits, batch)

    optimizer = RecordingSGD(0.1, momentum=0.9)
    step = make_step(transformer, policy_name, optimizer=optimizer, loss_fn=loss_fn)
    metrics = step(token_batch())["objectives"]["model"]

    assert seen_output_dtypes and set(seen_output_dtypes) == {"float32"}  # every trace
    assert metrics["loss"].dtype == tf.float32 and metrics["grad_norm"].dtype == tf.float32
    assert optimizer.grad_dtypes == {"float32"}
    assert {v.dtype for v in step.model.trainable_variables} == {"float32"}
    slots = [v for v in optimizer.variables if v.path != optimizer.iterations.path]
    assert len(slots) == len(step.model.trainable_variables) + 1  # one momentum each, plus the learning rate
    assert {v.dtype for v in slots} == {"float32"}


def test_moving_a_parent_to_float32_stops_its_kept_sublayer_handing_back_float16():
    def attention_model():
        inputs = keras.Input((6, 8))
        x = keras.layers.MultiHeadAttention(2, 4, name="attention")(inputs, inputs)
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))

    policy = Policy.from_string("mixed_float16")
    model = mixloop.build_model(attention_model, policy)
    layers = named_layers(model)
    softmax = layers["attention/softmax"]
    inputs = tf.random.normal((2, 6, 8), seed=1)
    # Kept in float32 by default inside the float16 attention: it casts its outputs back.
    assert softmax.compute_dtype == "float32" and softmax(tf.zeros((1, 2, 6, 6))).dtype == tf.float16

    moved = move_to_float32(model, policy, ["attention", "no/such/layer"], "the probe")

    assert [layer.path for layer in moved] == ["attention"]
    assert {layers[p].compute_dtype for p in layers if p.startswith("attention")} == {"float32"}
    # Inside its float32 parent the softmax now returns float32, as the float32 model computes.
    assert softmax(tf.zeros((1, 2, 6, 6))).dtype == tf.float32
    reference = mixloop.build_model(attention_model, Policy.from_string("float32"))
    reference.set_weights(model.get_weights())
    attention = keras.Model(model.inputs, model.get_layer("attention").output)
    expected = keras.Model(reference.inputs, reference.get_layer("attention").output)
    np.testing.assert_allclose(attention(inputs).numpy(), expected(inputs).numpy(), rtol=1e-6,
                               atol=1e-6)
    # Under a policy that computes in float32 there is nothing to move.
    assert move_to_float32(reference, Policy.from_string("float32"), ["attention"], "x") == []
