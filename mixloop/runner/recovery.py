"""When updates fail: the variables behind a run's first skipped and first retried updates, named once,
and a divergence, recovered from (restore the last good checkpoint, go on with later data; with
`precision.heal`, first move the layers a probe finds overflowing to float32) or stopped with one
line that names its cure."""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf
from absl import logging

from mixloop.engine.step import masked_paths
from mixloop.runner import auto_precision, guard, reporting


class Recovery:
    """The failures of `run` (a `run.Run`) between its compiled loops, and how many recoveries and
    heals it made."""

    def __init__(self, run: Any):
        self.run = run
        self.recoveries = self.heals = 0
        self.last_healed = False  # Whether the last recovery healed, tracing the loops anew.
        self._named_skips: set[str] = set()
        self._named_retries: set[str] = set()

    def name_first_failures(self, interval: reporting.Interval, totals: Mapping[str, Any]) -> None:
        """Logs, once per objective and run, the variables behind its first skipped update and its
        first retried attempt (a retry that cures an overflow leaves no skip to name them)."""
        many = len(self.run.objectives) > 1
        skipped = interval.skipped(self.run.state.skipped_totals())
        for objective, count in skipped.items():
            if not count or objective in self._named_skips:
                continue
            self._named_skips.add(objective)
            skips = self.run.state.skips[objective]
            bad_data = ("" if skips.first_inputs_finite.numpy()
                        else "; the batch's floating inputs held inf or NaN (bad data, not an overflow)")
            logging.info("First skipped update%s (non-finite gradients) by step %d: non-finite in %s%s",
                         f" of objective {objective!r}" if many else "", self._step(),
                         guard.describe_variables(self.nonfinite_paths(objective)), bad_data)
        for objective, objective_totals in totals["objectives"].items():
            if not objective_totals["num_retries"] or objective in self._named_retries:
                continue
            self._named_retries.add(objective)
            logging.info("First overflow retried%s by step %d (taken again on its batch at a lower "
                         "loss scale): non-finite in %s", f" in objective {objective!r}" if many else "",
                         self._step(),
                         guard.describe_variables(self.nonfinite_paths(objective, latest=True)))

    def after_loop(self, totals: Mapping[str, Any]) -> bool:
        """Whether the loop whose `totals` these are diverged; if so, the run is recovered (and
        perhaps healed: `last_healed`).

        Raises:
          guard.TrainingDiverged: when no recovery is left, or none can restore a checkpoint.
        """
        inputs_finite = bool(totals["last_inputs_finite"])
        diverged = self._divergence(totals, inputs_finite)
        if not diverged:
            return False
        if self.recoveries >= self.run.config.train.max_recoveries:  # No bad checkpoint saved.
            raise guard.TrainingDiverged(diverged + self._cure(inputs_finite))
        self.recoveries += 1
        self.last_healed = self._recover(diverged, inputs_finite)
        self.heals += self.last_healed
        return True

    def nonfinite_paths(self, objective: str, latest: bool = False) -> list[str]:
        """Paths of the variables whose gradients were non-finite first in the latest skip streak
        of `objective` (`latest`: in its latest overflowed attempt, a retried one included)."""
        if latest:
            return self.run.train_step.nonfinite_variable_paths(objective)
        return masked_paths(self.run.objectives[objective].variables,
                            self.run.state.skips[objective].first_nonfinite)

    def _divergence(self, totals: Mapping[str, Any], inputs_finite: bool) -> str:
        """The divergence message for the first objective whose guard stopped the loop, or ''."""
        for name, objective_totals in totals["objectives"].items():
            reason = int(objective_totals["stop_reason"])
            if reason in (guard.NONFINITE_LOSS, guard.TOO_MANY_SKIPS, guard.OVERFLOW_AT_MIN_SCALE):
                return self._message(reason, name, objective_totals, inputs_finite)
        return ""

    def _message(self, reason: int, objective: str, totals: Mapping[str, Any],
                 inputs_finite: bool) -> str:
        run = self.run
        message = guard.describe(
            reason, step=self._step(), objective=objective if len(run.objectives) > 1 else None,
            loss=float(totals["last_loss"]), inputs_finite=inputs_finite,
            grads_finite=bool(totals["last_grads_finite"]), xla=run.jit_compile,
            scale=float(totals["last_scale"]),
            consecutive_skips=int(run.state.skips[objective].consecutive_skips.numpy()),
            max_consecutive_skips=run.config.train.max_consecutive_skips,
            nonfinite_paths=self.nonfinite_paths(objective),
        )
        last_good = tf.train.latest_checkpoint(run.resume_directory())
        return f"{message}; last good checkpoint: {last_good or 'none yet'}"

    def _recover(self, message: str, inputs_finite: bool) -> bool:
        """Restores the last good checkpoint (the data keeps moving forward) and goes on; with
        `precision.heal` and finite inputs, first moves the layers a probe of the diverged weights
        finds overflowing to float32. Returns whether it healed.

        Raises:
          guard.TrainingDiverged: when there is no checkpoint to restore.
        """
        run = self.run
        heal = run.config.precision.heal and inputs_finite
        path = tf.train.latest_checkpoint(run.resume_directory())
        if path is None:
            hint = ("; a heal needs a checkpoint to restore (precision.float32_layers=auto probes "
                    "before the first update)" if heal else "")
            raise guard.TrainingDiverged(message + hint + self._cure(inputs_finite))
        healed = auto_precision.heal(run) if heal else ""
        logging.warning("%s %d of %d: %s. %sRestoring %s and continuing with later data.",
                        "Heal (recovery)" if healed else "Recovery", self.recoveries,
                        run.config.train.max_recoveries, message,
                        f"Healing: {healed}. " if healed else "", path)
        run.restore_weights(path)
        return bool(healed)

    def _cure(self, inputs_finite: bool) -> str:
        """The precision cure for a divergence's one line; '' for bad data, which no precision cures."""
        return auto_precision.cure(self.run) if inputs_finite else ""

    def _step(self) -> int:
        return int(self.run.global_step.numpy())
