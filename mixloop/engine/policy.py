"""Precision policy: which dtype parameters, computation and outputs use, and the casts between them.

Modelled on DeepMind jmp's `Policy`: a frozen triple of dtypes with three cast functions that act on
nested structures and touch only floating tensors (integer ids, masks and strings pass through).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

_DTYPE_NAMES = {
    "float32": tf.float32, "f32": tf.float32, "float": tf.float32,
    "float16": tf.float16, "f16": tf.float16, "half": tf.float16,
    "bfloat16": tf.bfloat16, "bf16": tf.bfloat16,
}
_FIELD_NAMES = {
    "params": "param_dtype", "param": "param_dtype", "p": "param_dtype",
    "compute": "compute_dtype", "c": "compute_dtype",
    "output": "output_dtype", "o": "output_dtype",
}
_ACCEPTED_FORMS = (
    "'float32', 'mixed_float16', 'mixed_bfloat16', or 'params=DTYPE,compute=DTYPE,output=DTYPE' "
    "(any order, p/c/o shorthands) with DTYPE one of float32, float16, bfloat16"
)


def is_floating(leaf: Any) -> bool:
    """Whether `leaf` is a floating tensor: what the casts touch, and what has a gradient."""
    return tf.is_tensor(leaf) and tf.as_dtype(leaf.dtype).is_floating


def floating_leaves(tree: Any) -> list[tf.Tensor]:
    """The floating tensors of `tree`, in `tf.nest.flatten` order."""
    return [leaf for leaf in tf.nest.flatten(tree) if is_floating(leaf)]


def _cast_floating(tree: Any, dtype: tf.DType) -> Any:
    """Casts the floating tensors of `tree` to `dtype`; every other leaf is returned unchanged."""
    return tf.nest.map_structure(lambda leaf: tf.cast(leaf, dtype) if is_floating(leaf) else leaf, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of one run: parameters (master weights), computation, and outputs handed to the loss."""

    param_dtype: tf.DType
    compute_dtype: tf.DType
    output_dtype: tf.DType

    @classmethod
    def from_string(cls, spec: str) -> "Policy":
        """Parses `float32`, `mixed_float16`, `mixed_bfloat16` or `params=..,compute=..,output=..`.

        Raises:
          ValueError: naming `spec` and the accepted forms when it is none of them.
        """
        name = spec.strip().lower()
        if name in ("float32", "f32"):
            return cls(tf.float32, tf.float32, tf.float32)
        if name in ("mixed_float16", "mixed_bfloat16"):
            return cls(tf.float32, _DTYPE_NAMES[name.removeprefix("mixed_")], tf.float32)
        if "=" in name:
            return cls._from_explicit(spec, name)
        raise ValueError(f"unknown precision policy {spec!r}; expected {_ACCEPTED_FORMS}")

    @classmethod
    def _from_explicit(cls, spec: str, name: str) -> "Policy":
        fields = {}
        for part in name.split(","):
            key, _, value = (s.strip() for s in part.partition("="))
            if key not in _FIELD_NAMES or value not in _DTYPE_NAMES or _FIELD_NAMES[key] in fields:
                raise ValueError(
                    f"bad precision policy {spec!r} at {part.strip()!r}; expected {_ACCEPTED_FORMS}"
                )
            fields[_FIELD_NAMES[key]] = _DTYPE_NAMES[value]
        if len(fields) != 3:
            raise ValueError(
                f"precision policy {spec!r} must name params, compute and output; "
                f"expected {_ACCEPTED_FORMS}"
            )
        return cls(**fields)

    @property
    def is_mixed(self) -> bool:
        """True when computation runs in a lower precision than the parameters are stored in."""
        return self.compute_dtype != self.param_dtype

    @property
    def keras_name(self) -> str:
        """The Keras `DTypePolicy` name that builds layers with these parameter and compute dtypes.

        Raises:
          ValueError: for combinations Keras cannot express (e.g. float16 params, float32 compute).
        """
        if self.param_dtype == self.compute_dtype:
            return self.param_dtype.name
        if self.param_dtype == tf.float32:
            return f"mixed_{self.compute_dtype.name}"
        raise ValueError(
            f"Keras cannot build layers with {self.param_dtype.name} parameters computing in "
            f"{self.compute_dtype.name}; use float32 parameters or equal dtypes"
        )

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating tensors of `tree` to the compute dtype."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating tensors of `tree` to the parameter dtype."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating tensors of `tree` to the output dtype."""
        return _cast_floating(tree, self.output_dtype)

    def __str__(self) -> str:
        return (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}"
        )
