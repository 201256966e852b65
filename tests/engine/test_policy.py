"""Policy: parsing precision strings, and casting only the floating tensors of nested structures."""

import re

import pytest
import tensorflow as tf

from mixloop.engine.policy import Policy

F32, F16, BF16 = tf.float32, tf.float16, tf.bfloat16


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("float32", (F32, F32, F32)),
        ("mixed_float16", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("compute=float16,output=float32,params=float32", (F32, F16, F32)),
        ("o=bfloat16,p=float32,c=float16", (F32, F16, BF16)),
        (" p = f32 , c = bf16 , o = f32 ", (F32, BF16, F32)),
        ("params=float16,compute=float16,output=float16", (F16, F16, F16)),
    ],
)
def test_from_string_accepts_named_and_explicit_forms(spec, expected):
    policy = Policy.from_string(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


@pytest.mark.parametrize(
    "spec",
    [
        "mixed_float17",
        "float16",
        "",
        "p=float32",
        "params=int8,compute=float16,output=float32",
        "params=float32,compute=float16,output=float32,p=float32",
        "params=float32,compute=float16,outputs=float32",
        "params=float32,compute=float16,output=float32,",
    ],
)
def test_from_string_rejects_bad_strings_naming_the_string_and_the_accepted_forms(spec):
    with pytest.raises(ValueError, match=re.escape(repr(spec))) as raised:
        Policy.from_string(spec)
    message = str(raised.value)
    for accepted in ("'float32'", "'mixed_float16'", "'mixed_bfloat16'", "params=", "compute=", "output="):
        assert accepted in message


def test_str_round_trips_through_from_string():
    policy = Policy.from_string("p=f32,c=bf16,o=f16")
    assert Policy.from_string(str(policy)) == policy


@pytest.mark.parametrize(
    "spec, keras_name", [("float32", "float32"), ("mixed_float16", "mixed_float16"), ("mixed_bfloat16", "mixed_bfloat16")]
)
def test_keras_name(spec, keras_name):
    assert Policy.from_string(spec).keras_name == keras_name


def test_keras_name_rejects_float16_params_with_float32_compute():
    with pytest.raises(ValueError, match="float16 parameters computing in float32"):
        Policy.from_string("p=f16,c=f32,o=f32").keras_name


def _nested_batch():
    return {
        "features": tf.constant([[1.5, -2.25]], tf.float32),
        "pair": (tf.constant([0.5], tf.float16), tf.constant([7], tf.int32)),
        "extras": [
            tf.constant(["a token"]),
            tf.constant([True, False]),
            tf.constant([3], tf.int64),
            tf.constant([2.0], tf.bfloat16),
        ],
    }


@pytest.mark.parametrize(
    "cast_name, spec, dtype",
    [
        ("cast_to_compute", "mixed_float16", F16),
        ("cast_to_compute", "mixed_bfloat16", BF16),
        ("cast_to_param", "mixed_float16", F32),
        ("cast_to_output", "p=f32,c=f16,o=bf16", BF16),
    ],
)
def test_casts_touch_only_floating_tensors(cast_name, spec, dtype):
    batch = _nested_batch()
    cast = getattr(Policy.from_string(spec), cast_name)(batch)

    assert tf.nest.map_structure(lambda t: t.shape, cast) == tf.nest.map_structure(lambda t: t.shape, batch)
    for name, (before, after) in {
        "features": (batch["features"], cast["features"]),
        "pair[0]": (batch["pair"][0], cast["pair"][0]),
        "extras[3]": (batch["extras"][3], cast["extras"][3]),
    }.items():
        assert after.dtype == dtype, name
        assert after.numpy().astype("float64").tolist() == before.numpy().astype("float64").tolist(), name
    # Integer ids, strings and masks come back as the very same objects.
    assert cast["pair"][1] is batch["pair"][1]
    assert cast["extras"][0] is batch["extras"][0]
    assert cast["extras"][1] is batch["extras"][1]
    assert cast["extras"][2] is batch["extras"][2]
    assert isinstance(cast["pair"], tuple) and isinstance(cast["extras"], list)


def test_cast_to_compute_works_inside_tf_function():
    policy = Policy.from_string("mixed_float16")
    cast = tf.function(policy.cast_to_compute)({"x": tf.ones([2]), "ids": tf.constant([1, 2])})
    assert cast["x"].dtype == F16 and cast["ids"].dtype == tf.int32
