"""Host-side actions: research code the outer loop runs every N updates or after each evaluation.

As CommonLoopUtils' periodic actions: a small object with one call, declared by the Trainer
subclass (`Trainer.actions`), run by the controller between compiled loops with the run's
TensorBoard writer as the default `tf.summary` writer, so `tf.summary.text(...)` or
`tf.summary.image(...)` inside it lands in `workdir/train` or `workdir/eval`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mixloop.errors import UserError


@dataclasses.dataclass(frozen=True)
class Action:
    """Calls `fn(step)` every `every_steps` updates (0: never) and/or after each evaluation.

    Actions run on every process of a multi-worker run (only the chief's summaries are written).
    One that runs every N updates writes to `workdir/train`; one at eval time to `workdir/eval`, with
    the weights eval used (the EMA weights when `config.train.ema_decay` is set).
    The loop's boundaries include every multiple of `every_steps`, so none is missed.
    """

    fn: Callable[[int], None]
    every_steps: int = 0
    at_eval: bool = False

    def __post_init__(self):
        every = self.every_steps
        valid_every = isinstance(every, int) and not isinstance(every, bool) and every >= 0
        if not callable(self.fn) or not valid_every or not (every or self.at_eval):
            raise UserError(f"mixloop.Action needs a callable fn(step) and every_steps, an integer "
                            f"> 0, or at_eval=True; got fn={self.fn!r}, every_steps={every!r}, "
                            f"at_eval={self.at_eval!r}")

    def is_due(self, step: int) -> bool:
        """Whether it runs after update `step` (its every-N part)."""
        return self.every_steps > 0 and step % self.every_steps == 0

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
