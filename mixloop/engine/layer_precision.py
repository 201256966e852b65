"""Per-layer precision: building a Keras model under a policy, with the layers 16 bits break kept in float32.

Keras 3 gives every layer a `DTypePolicy`; a global policy set while the model is built makes every
layer mixed, and assigning `layer.dtype_policy` afterwards switches a single layer back to float32
compute (its variables are float32 already). We set the per-layer policy after construction rather
than through a `DTypePolicyMap` because the research code builds the model and must not have to thread
a dtype argument through every layer.

A layer kept in float32 computes in float32, and what follows it computes in the compute dtype again:
inside a subclassed layer its outputs are cast back, so plain arithmetic after it (`x + residual`
after a post-LN block's LayerNormalization) sees one dtype; in a functional model the next layer
casts its inputs itself. The step casts the model's outputs to float32. A quantized layer kept in
float32 (a Dense that `quantize("float8")` made `float8_from_mixed_bfloat16`) keeps its
quantization over float32 (`float8_from_float32`): its QDQ and scale variables stay in use.

Layers are named by their *path*: the names from the model's own layers down to the layer, joined by
`/`, e.g. `bert_backbone/transformer_layer_0/self_attention/softmax` for a backbone nested in a model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
from typing import Callable, Iterator, Optional, Sequence

import keras

from mixloop.errors import ConfigError
from mixloop.engine import keras_adapter
from mixloop.engine.policy import Policy

# Layer types whose own arithmetic loses too much in 16 bits, as measured by
# tests/engine/test_layer_precision.py::test_default_float32_types_are_the_ones_16_bits_break: softmax
# (exponentials, sums along a long axis: ~10x the error of rounding its float32 result) and
# UnitNormalization (its sum of squares overflows float16). Keras's Layer-, Batch-, Group- and
# RMSNormalization already compute their statistics in float32 inside, and Embedding gathers rows of
# its float32 table before casting them: switching those changes nothing but the dtype they return.
FLOAT32_LAYER_TYPES: tuple[type, ...] = (keras.layers.Softmax, keras.layers.UnitNormalization)
# A layer of this name produces the logits the loss reads (the convention experiments follow): in
# bfloat16 a logit of 10 would be rounded by up to 0.04 before the loss sees it.
LOGITS_LAYER_NAME = "logits"
# Why a layer computes in float32 when the run did not place it there: it was built with a dtype
# policy of its own (`dtype="float32"`), or loaded from a `.keras` file, which saves each layer's.
OWN_POLICY = "its own dtype policy (set in its code, or saved with a loaded model)"


@dataclasses.dataclass(frozen=True)
class Float32Layer:
    """A layer switched to float32 compute, and why."""

    path: str
    # "Softmax (default type)", "named logits", "precision.float32_layers", from the automatic
    # placement "the probe", or `OWN_POLICY` for a layer the placement found in float32.
    reason: str
    # Its dtype policy's name: "float32", or a quantized layer's quantization over float32
    # (`float8_from_float32`: a float8 Dense keeps its QDQ and scales, computing in float32).
    policy: str = "float32"


@contextlib.contextmanager
def building_under(policy: Policy) -> Iterator[None]:
    """Builds the layers made inside the block under `policy`, named as in a fresh process.

    Keras numbers unnamed layers (`softmax_3`, `bert_backbone_1`) by how many of their kind the
    process has built before; counting afresh gives a model the same layer paths however often it
    is built (the Trainer, its export, the doctor's float32 twin, a test), so a regex over paths
    aims at the same layers every time.
    """
    previous_policy = keras.config.dtype_policy()
    previous_names = keras_adapter.name_counters()
    keras.config.set_dtype_policy(policy.keras_name)
    keras_adapter.set_name_counters(None)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous_policy)
        keras_adapter.set_name_counters(previous_names)


def build_model(
    build_fn: Callable[[], keras.Model], policy: Policy, float32_layers: str = ""
) -> keras.Model:
    """Calls `build_fn` under `policy`, then keeps the numerically sensitive layers in float32.

    Args:
      build_fn: returns a built Keras model (its variables must exist).
      policy: parameter and compute dtypes for the layers.
      float32_layers: a regex; layers whose path fully matches it also compute in float32.

    Raises:
      ConfigError: when `float32_layers` matches no layer path.
    """
    with building_under(policy):
        model = build_fn()
    keep_float32_layers(model, policy, float32_layers)
    return model


def keep_float32_layers(model: keras.Model, policy: Policy, pattern: str = "") -> list[Float32Layer]:
    """Switches the sensitive layers of `model` to float32 compute; returns them with the reason.

    Sensitive layers are those of `FLOAT32_LAYER_TYPES`, any layer named `logits`, and any layer
    whose path fully matches `pattern`, together with all of that layer's sublayers. A switched
    layer called by a subclassed layer's `call` (attention's softmax, the LayerNormalization of a
    keras-hub block) casts its floating outputs back to the compute dtype, since plain TensorFlow
    arithmetic there cannot mix dtypes. One in a functional or sequential model passes float32 on:
    the layers after it cast their inputs themselves and Keras ops promote, so a float32 neighbour
    (a layer the doctor moved together with it) gets values 16 bits could not hold. Does nothing
    unless the policy computes in a lower precision than its float32 parameters, but checks
    `pattern` under every policy.

    Raises:
      ConfigError: when `pattern` is set and fully matches no layer path (naming some real paths).
    """
    layers = named_layers(model)
    matcher = re.compile(pattern) if pattern else None
    if pattern:
        matching_paths(pattern, list(layers))
    if not policy.is_mixed or policy.param_dtype.name != "float32":
        return []
    return _switch_to_float32(model, policy, layers,
                              lambda path, layer: _float32_reason(layer, path, matcher))


def move_to_float32(model: keras.Model, policy: Policy, paths: Sequence[str],
                    reason: str) -> list[Float32Layer]:
    """Switches the layers at `paths`, with their sublayers, to float32 compute as
    `keep_float32_layers` does, after the model was placed (the automatic placement's finds);
    returns those switched, each with `reason`. Layers computing in float32 already, and paths
    that name no layer, are left alone. Whatever traced the model must be traced again."""
    if not policy.is_mixed or policy.param_dtype.name != "float32":
        return []
    wanted = set(paths)
    return _switch_to_float32(
        model, policy, named_layers(model),
        lambda path, layer: reason if path in wanted and layer.compute_dtype != "float32" else None)


def _switch_to_float32(model: keras.Model, policy: Policy, layers: dict[str, keras.layers.Layer],
                       reason_of: Callable[[str, keras.layers.Layer], Optional[str]]
                       ) -> list[Float32Layer]:
    """Switches each of `layers` (by path, parents first) that `reason_of` gives a reason, and its
    sublayers, to float32 compute; returns the switched ones that are not a sublayer of another."""
    kept: list[Float32Layer] = []
    inside_kept: set[str] = set()  # Paths of the kept layers whose sublayers follow them anyway.
    for path, layer in layers.items():
        reason = reason_of(path, layer)
        parent_kept = any(path.startswith(prefix + "/") for prefix in inside_kept)
        if reason is None and not parent_kept:
            continue
        layer.dtype_policy = _float32_policy(layer)
        if parent_kept:
            # Its float32 parent hands back the compute dtype; a sublayer kept before the parent
            # moved (a default softmax) must stop handing it back inside the parent.
            _stop_handing_back(layer)
            continue
        kept.append(Float32Layer(path, reason, layer.dtype_policy.name))
        inside_kept.add(path)
        parent = layers.get(path.rpartition("/")[0], model)
        if not keras_adapter.output_layers(parent):
            _hand_back(layer, policy)
    return kept


def own_float32_layers(model: keras.Model, policy: Policy,
                       kept: Sequence[Float32Layer]) -> list[Float32Layer]:
    """The layers of `model` that compute in float32 under a mixed `policy` by a dtype policy of
    their own (reason `OWN_POLICY`), outermost only, leaving out the `kept` ones and their
    sublayers: a layer built with `dtype="float32"`, and every layer of a model loaded with
    `keras.models.load_model` (a `.keras` file saves each layer's dtype policy; mixloop's exports
    are float32). The placement leaves them as they are."""
    if not policy.is_mixed:
        return []
    inside = [layer.path for layer in kept]
    found = []
    for path, layer in named_layers(model).items():
        if layer.compute_dtype == "float32" and not any(
                path == outer or path.startswith(outer + "/") for outer in inside):
            found.append(Float32Layer(path, OWN_POLICY, layer.dtype_policy.name))
            inside.append(path)
    return found


def describe_placement(kept: list[Float32Layer], policy: Policy, max_paths: int = 6) -> str:
    """One log line: which layers compute in float32 and why, grouped by reason."""
    if not policy.is_mixed:
        return f"Every layer computes in {policy.compute_dtype.name}"
    if not kept:
        return f"Every layer computes in {policy.compute_dtype.name}; none is kept in float32"
    groups: dict[str, list[str]] = {}
    for layer in kept:
        groups.setdefault(layer.reason, []).append(
            layer.path if layer.policy == "float32"
            else f"{layer.path} as {layer.policy}, its quantization kept")
    parts = [f"{len(paths)} by {reason} ({shown_paths(paths, max_paths)})"
             for reason, paths in groups.items()]
    return (f"Layers computing in float32, the rest in {policy.compute_dtype.name}: "
            + "; ".join(parts))


def shown_paths(paths: Sequence[str], max_paths: int) -> str:
    """The first `max_paths` of `paths` for a log line, and how many more there are."""
    more = f", +{len(paths) - max_paths} more" if len(paths) > max_paths else ""
    return ", ".join(paths[:max_paths]) + more


def named_layers(model: keras.Model) -> dict[str, keras.layers.Layer]:
    """Every layer under `model` by its path, parents before their sublayers; a shared layer once."""
    found: dict[str, keras.layers.Layer] = {}
    seen: set[int] = set()

    def visit(layer: keras.layers.Layer, prefix: str) -> None:
        for sublayer in keras_adapter.sublayers(layer):
            if id(sublayer) in seen or isinstance(sublayer, keras.layers.InputLayer):
                continue
            seen.add(id(sublayer))
            path = prefix + sublayer.name
            found[path] = sublayer
            visit(sublayer, path + "/")

    visit(model, "")
    return found


def _float32_reason(layer: keras.layers.Layer, path: str, matcher) -> str | None:
    """Why `layer` computes in float32, or None when it computes in the policy's dtype."""
    if matcher is not None and matcher.fullmatch(path):
        return "precision.float32_layers"
    if isinstance(layer, FLOAT32_LAYER_TYPES):
        return f"{type(layer).__name__} (default type)"
    if layer.name == LOGITS_LAYER_NAME:
        return "named logits"
    return None


def _float32_policy(layer: keras.layers.Layer) -> keras.DTypePolicy:
    """The dtype policy that makes `layer` compute in float32: "float32", or for a quantized layer
    (a float8 Dense) its own quantization over float32. Plain "float32" would drop the quantization:
    the layer would run its plain `call`, leaving its QDQ and its scale variables unused."""
    policy = layer.dtype_policy
    if policy.quantization_mode is None:
        return keras.DTypePolicy("float32")
    return type(policy)(**{**policy.get_config(), "source_name": "float32"})


# The methods Keras's `__call__` runs: `quantized_call` for a quantized layer, `call` otherwise.
# Both are wrapped, so the hand-back holds however the layer is quantized, before or after.
_CALLS = ("call", "quantized_call")


def _hand_back(layer: keras.layers.Layer, policy: Policy) -> None:
    """Makes `layer` cast its floating outputs to the policy's compute dtype.

    The instance's `call` and `quantized_call` are replaced (Keras's `__call__` looks them up on
    the instance), bypassing Keras's attribute tracking, which has nothing to track in a function.
    """
    for name in _CALLS:
        object.__setattr__(layer, name, _cast_back(getattr(layer, name), policy))


def _cast_back(call: Callable, policy: Policy) -> Callable:
    """`call`, with its floating outputs cast to the policy's compute dtype."""

    @functools.wraps(call)
    def call_and_cast_back(*args, **kwargs):
        return policy.cast_to_compute(call(*args, **kwargs))

    call_and_cast_back.hands_back = True
    return call_and_cast_back


def _stop_handing_back(layer: keras.layers.Layer) -> None:
    """Undoes `_hand_back` on `layer`, if it was applied."""
    for name in _CALLS:
        if getattr(vars(layer).get(name), "hands_back", False):
            object.__delattr__(layer, name)


def matching_paths(pattern: str, paths: Sequence[str],
                   setting: str = "config.precision.float32_layers") -> list[str]:
    """The layer `paths` the regex `pattern` fully matches.

    Raises:
      ConfigError: when it matches none, naming it as `setting` (where it was set) and some real
        paths.
    """
    matcher = re.compile(pattern)
    matched = [path for path in paths if matcher.fullmatch(path)]
    if not matched:
        raise ConfigError(_no_match_message(setting, pattern, list(paths)))
    return matched


def _no_match_message(setting: str, pattern: str, paths: list[str], max_paths: int = 5) -> str:
    """The one-line error for a `float32_layers` regex that names no layer, with real paths."""
    close = difflib.get_close_matches(pattern, paths, n=max_paths, cutoff=0.3)
    examples = close + [path for path in paths if path not in close][: max_paths - len(close)]
    return (f"{setting}={pattern!r} fully matches no layer path; paths look like: "
            f"{', '.join(examples)} (a regex over the whole path, e.g. '.*softmax.*')")
