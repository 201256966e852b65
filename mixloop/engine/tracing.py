"""Tracing: mixloop's code is traced as written, with mixloop's kernels; only the experiment's hooks go
through AutoGraph.

mixloop's step and loop spell their control flow out (`tf.cond`, `tf.while_loop`), so AutoGraph has
nothing to convert in them, yet converting their hundred functions cost each process seconds before
its first update (CHANGELOG.md). Each traces inside `kernels.installed()`: mixloop's matrix-product
gradient and GELU apply to what mixloop traces, and to nothing else in the process. The experiment's hooks
(`compute_loss`, `model_inputs`, `eval_metrics`, an objective's `after_update`) are converted while
traced, as inside a `tf.function`: Python `if`/`for` over tensors become graph control flow, and an
error raised in them names the experiment's lines ('in user code: ...'). Keras's own `fit` traces
its step without AutoGraph too. `ag_ctx` is TensorFlow's private module for AutoGraph's on/off
status; tests/engine/test_tracing.py fails loudly if it changes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx

from mixloop.engine import kernels
from mixloop.errors import UserError

Hook = TypeVar("Hook", bound=Callable[..., Any])
# AutoGraph on, whatever the caller's status: mixloop's functions trace with it off.
_CONVERT = ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED)


def function(fn: Callable[..., Any], **options: Any) -> tf.types.experimental.PolymorphicFunction:
    """`tf.function(fn, **options)` for mixloop's own code: traced as written, without AutoGraph,
    with mixloop's kernels in place while it traces."""
    return tf.function(kernels.used(fn), autograph=False, **options)


def hook(fn: Hook) -> Hook:
    """The experiment's `fn`, converted by AutoGraph when called while tracing; as written when run
    eagerly (a debugger stops in the experiment's own lines) and when it is mixloop's own default
    (e.g. `Trainer.eval_metrics`, which converts the `compute_loss` it calls). A `UserError` that
    mixloop's code raised inside it comes out as raised: one line, not AutoGraph's re-raise."""
    if (getattr(getattr(fn, "__func__", fn), "__module__", None) or "").startswith("mixloop."):
        return fn

    @functools.wraps(fn)
    def converted(*args: Any, **kwargs: Any) -> Any:
        if not tf.inside_function():
            return fn(*args, **kwargs)
        try:
            return tf.__internal__.autograph.tf_convert(fn, _CONVERT)(*args, **kwargs)
        except Exception as error:
            if hasattr(error, "ag_error_metadata") and isinstance(error.__context__, UserError):
                raise error.__context__ from None
            raise
    return converted
