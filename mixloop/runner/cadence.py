"""When the outer loop stops between compiled loops, and what is due then: one mechanism for the
built-in log, eval and checkpoint and for the Trainer's `Action`s, as CommonLoopUtils' periodic
actions."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import ml_collections


@dataclasses.dataclass(frozen=True)
class Cadence:
    """Due after every `every_steps`-th update (0: never so), and after each update in `also_at`."""

    every_steps: int = 0
    also_at: tuple[int, ...] = ()

    def is_due(self, step: int) -> bool:
        """Whether it is due after update `step`."""
        return step in self.also_at or (self.every_steps > 0 and step % self.every_steps == 0)

    def steps_to_due(self, step: int) -> Optional[int]:
        """The fewest updates after `step` to the next update it is due after; None for never."""
        ahead = [due - step for due in self.also_at if due > step]
        if self.every_steps > 0:
            ahead.append(self.every_steps - step % self.every_steps)
        return min(ahead, default=None)


class Schedule:
    """A run's cadences: the progress line and TensorBoard (`log`), `eval`, `checkpoint` (each also
    after the run's last update), and the `Action`s' own; `loop_length` ends each compiled loop at
    the next update where any of them is due, `train.steps_per_loop` updates at most, and at
    `last_step` (the last update the data allows)."""

    def __init__(self, config: ml_collections.ConfigDict, actions: Sequence, last_step: int):
        num_steps = config.train.num_steps
        self.log = Cadence(config.train.log_every_steps, (num_steps, last_step))
        self.eval = Cadence(config.eval.every_steps, (num_steps,))
        self.checkpoint = Cadence(config.checkpoint.every_steps, (num_steps,))
        self.actions = list(actions)
        self._loop = Cadence(config.train.steps_per_loop, (last_step,))

    def loop_length(self, step: int) -> int:
        """Updates from `step` to the next boundary."""
        cadences = [self._loop, self.log, self.eval, self.checkpoint,
                    *(action.cadence for action in self.actions)]
        return min(ahead for ahead in (c.steps_to_due(step) for c in cadences) if ahead is not None)

    def train_actions(self, step: int) -> list:
        """The actions due after update `step` (their every-N part)."""
        return [action for action in self.actions if action.cadence.is_due(step)]

    def eval_actions(self) -> list:
        """The actions that run after each evaluation."""
        return [action for action in self.actions if action.at_eval]
