"""Host-side actions: research code the outer loop runs every N updates or after each evaluation.

As CommonLoopUtils' periodic actions: a small object with one call, declared by the Trainer
subclass (`Trainer.actions`), run by the controller between compiled loops with the run's
TensorBoard writer as the default `tf.summary` writer, so `tf.summary.text(...)` or
`tf.summary.image(...)` inside it lands in `workdir/train` or `workdir/eval`. A metric an action
computes (a sample's Fréchet distance) is what it returns, as a dict of floats: the controller
writes it beside the split's scalars, and an eval-time action's joins the eval summary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, Mapping, Optional

import numpy as np

from mixloop.errors import UserError
from mixloop.runner.cadence import Cadence


@dataclasses.dataclass(frozen=True)
class Action:
    """Calls `fn(step)` every `every_steps` updates (0: never) and/or after each evaluation.

    Actions run on every process of a multi-worker run (only the chief's summaries are written).
    One that runs every N updates writes to `workdir/train`; one at eval time to `workdir/eval`, with
    the weights eval used (the EMA weights when `config.train.ema_decay` is set).
    The loop's boundaries include every multiple of `every_steps`, so none is missed.

    `fn` may return a dict of metrics, name -> a real number (e.g. {"fid": 12.3}); an eval-time
    action's join eval's own in the eval summary (TensorBoard's `workdir/eval`, the `eval at step N:`
    line, the run's `Finished ...` line), an every-N one's go to `workdir/train`. Any other return
    value (None, what `tf.summary.scalar` returns) is ignored.
    """

    fn: Callable[[int], Optional[Mapping[str, float]]]
    every_steps: int = 0
    at_eval: bool = False

    def __post_init__(self):
        every = self.every_steps
        valid_every = isinstance(every, int) and not isinstance(every, bool) and every >= 0
        if not callable(self.fn) or not valid_every or not (every or self.at_eval):
            raise UserError(f"mixloop.Action needs a callable fn(step) and every_steps, an integer "
                            f"> 0, or at_eval=True; got fn={self.fn!r}, every_steps={every!r}, "
                            f"at_eval={self.at_eval!r}")

    @property
    def cadence(self) -> Cadence:
        """When it runs between compiled loops (its every-N part), as the built-in log, eval and
        checkpoint do (`cadence.Schedule`)."""
        return Cadence(self.every_steps)

    def is_due(self, step: int) -> bool:
        """Whether it runs after update `step` (its every-N part)."""
        return self.cadence.is_due(step)

    def describe(self) -> str:
        """Its function's name and when it runs, e.g. "sample (every 100 updates, at eval)"."""
        when = ([f"every {self.every_steps} updates"] if self.every_steps else []) + (
            ["at eval"] if self.at_eval else [])
        return f"{getattr(self.fn, '__name__', repr(self.fn))} ({', '.join(when)})"


def checked_actions(actions: Any) -> list[Action]:
    """What `Trainer.actions()` returned, as a list: a list or tuple of `Action`s, or one `Action`.

    Raises:
      UserError: for anything else, naming what it is.
    """
    if isinstance(actions, Action):
        return [actions]
    if isinstance(actions, (list, tuple)) and all(isinstance(a, Action) for a in actions):
        return list(actions)
    raise UserError(f"actions() must return a list of mixloop.Action, got {actions!r:.200}")


def returned_metrics(action: Action, returned: Any, step: int, taken: Collection[str] = (),
                     reserved: Collection[str] = ()) -> dict[str, float]:
    """The metrics `action.fn` returned at `step`: a mapping's items as floats, {} for anything
    else. A metric may not replace one of the names in `taken` (reported already at this step:
    eval's metrics, other actions') nor start with a `reserved` tag (the framework's train
    scalars: `loss`, `loss/<objective>`, ...).

    Raises:
      UserError: for a name that is not a non-empty string, taken or reserved, or a value that is
        not a real number, naming the action, the step and the metric.
    """
    if not isinstance(returned, Mapping):
        return {}
    metrics = {}
    for name, value in returned.items():
        where = f"action {action.describe()} returned metric {name!r} at step {step}"
        if not (isinstance(name, str) and name):
            raise UserError(f"{where}: a metric's name must be a non-empty string")
        if name in taken:
            raise UserError(f"{where}, which the run reports already at that step; rename it")
        if name.split("/")[0] in reserved:
            raise UserError(f"{where}, which the framework writes itself; rename it (taken: "
                            f"{', '.join(reserved)})")
        metrics[name] = _real_number(value, where)
    return metrics


def _real_number(value: Any, where: str) -> float:
    """`value` as a float: a Python, NumPy or 0-d tensor real number.

    Raises:
      UserError: for anything else (a vector, a string, a complex number).
    """
    array = np.asarray(value)
    if array.ndim or not (np.issubdtype(array.dtype, np.integer)
                          or np.issubdtype(array.dtype, np.floating)):
        raise UserError(f"{where}: {value!r:.80} is not a real number (a metric is one float)")
    return float(array)
