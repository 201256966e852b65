"""Tracing: mixloop's own code is traced as written; only the experiment's hooks go through AutoGraph.

mixloop's step and loop spell their control flow out (`tf.cond`, `tf.while_loop`), so AutoGraph has
nothing to convert in them, yet converting their hundred functions cost every process about 5 s
before its first update on a 2-core CPU (tests/test_tracing.py). The experiment's hooks
(`compute_loss`, `model_inputs`, `eval_metrics`, an objective's `after_update`) are converted as a
`tf.function` converts them: Python `if`/`for` over tensors become graph control flow, and an error
raised in them names the experiment's lines ('in user code: ...'). Keras's own `fit` traces its
step without AutoGraph too.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx

Hook = TypeVar("Hook", bound=Callable[..., Any])
# AutoGraph on, whatever the caller's status: mixloop's functions trace with it off.
_CONVERT = ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED)


def function(fn: Callable[..., Any], **options: Any) -> tf.types.experimental.PolymorphicFunction:
    """`tf.function(fn, **options)` for mixloop's own code: traced as written, without AutoGraph."""
    return tf.function(fn, autograph=False, **options)


def hook(fn: Hook) -> Hook:
    """The experiment's `fn` as a `tf.function` with AutoGraph calls it: converted when called."""
    @functools.wraps(fn)
    def converted(*args: Any, **kwargs: Any) -> Any:
        return tf.__internal__.autograph.tf_convert(fn, _CONVERT)(*args, **kwargs)
    return converted
