"""mixloop's own kernels, in place only while mixloop's functions trace: the gradient of a batch of
inputs times one matrix (engine/matmul_gradient.py) and GELU of 16-bit inputs (engine/gelu.py).

TensorFlow looks a gradient up, and Keras its backend's GELU, when a function is traced, so each is
installed when the outermost of mixloop's traces starts and the original put back when it ends
(`engine/tracing.function` wraps every function mixloop traces in `installed()`): the step, the
inner loop, eval, the doctor's passes. Importing mixloop changes neither, and a user's own
computation in the same process (a `model.fit`, a `tf.function` of their own) keeps TensorFlow's
and Keras's, bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, TypeVar

from mixloop.engine import gelu, matmul_gradient

Fn = TypeVar("Fn", bound=Callable[..., Any])
_lock = threading.Lock()
_depth = 0  # Traces inside `installed()` now, across threads: the compile-mode probe traces in one.
_replaced: list[Any] = []  # What the outermost `installed()` replaced, to put back.


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """mixloop's kernels in place for the `with` block (nested blocks share one installation)."""
    global _depth
    with _lock:
        if _depth == 0:
            _replaced[:] = [matmul_gradient.install(), gelu.install()]
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                previous_gradient, previous_gelu = _replaced
                if previous_gradient is not None:
                    matmul_gradient.install(previous_gradient)
                gelu.install(previous_gelu)


def are_installed() -> bool:
    """Whether mixloop's kernels are in place now (inside `installed()`)."""
    return _depth > 0


def used(fn: Fn) -> Fn:
    """`fn`, run (and so traced) with mixloop's kernels in place."""
    @functools.wraps(fn)
    def with_kernels(*args: Any, **kwargs: Any) -> Any:
        with installed():
            return fn(*args, **kwargs)

    return with_kernels
