"""Mixed precision that places itself: `precision.float32_layers=auto`, `initial_scale=auto`, `heal`.

The probe is the precision doctor (`doctor.diagnosis.diagnose_batches`) on `precision.probe_batches`
train batches from the current weights; what it advises is applied instead of printed::

    start (before the first trace; on resume from the restored weights), `start`:
        move back to float32 the layers config.json's `resolved` record names (earlier probes' finds)
        only for float16 compute (both settings are its defaults; bfloat16 has float32's range),
            on one device, with a data position a checkpoint holds (else not probed, said in a
            line):
        probe the run's next batches, its data position put back (a second iterator over data
            that reshuffles would change the run's order); a probe that fails on them is skipped
            with a line (the train step reports the data's or the model's error)
        float32_layers=auto: move to float32 the 16-bit layers the doctor advises, the finest
            whose values come within MARGIN_BITS doublings of their dtype's largest finite value
            or that turn finite inputs into inf or NaN (not a block for its sublayer's), with
            their sublayers
        initial_scale=auto, fresh run: start each dynamic loss scale at the doctor's rule, the
            largest power of two that leaves the probed gradients left in float16 MARGIN_BITS
            doublings below 65504, no higher than the default 2^15 unless they underflow there
            (clipped into [min_scale, max_scale])
        log a line each; record the regex and scale in config.json (`resolved`), the doctor's
            report in precision/report-step-N.json
        a stop (SIGTERM, Ctrl-C) during the probe: it gives up within a second or two (between
            its passes and layers), a line says so, nothing moves or is recorded; the run saves
            and exits, and its resume probes
    divergence with finite inputs (`precision.heal`; the controller then restores the last good
    checkpoint), `heal`:
        probe the weights the run diverged at on the run's next batches: the skipped updates left
            those weights finite, and they are the ones that overflowed (a last checkpoint long
            before may not yet come near the limit); a recovery moves on to later data anyway; a
            probe that fails is a line, and the recovery goes on without a heal
        move the newly advised layers to float32, trace the loops anew, record as above

Bad data is not healed (the controller asks only with finite inputs). The probe runs eagerly on one
device, so healing with several replicas is refused: pin the regex a one-device run found.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from typing import Any, Callable, Iterable, Sequence, Union

import tensorflow as tf
from absl import logging

from mixloop.config import (AUTO, DEFAULT_INITIAL_SCALE, ConfigError, compiles as config_compiles,
                            split_auto)
from mixloop.engine import layer_precision
from mixloop.engine.loss_scale import DynamicLossScale
from mixloop.engine.policy import floating_leaves
from mixloop import interrupts
from mixloop import errors
from mixloop.errors import UserError
from mixloop.doctor import advice, diagnosis, report as doctor_report
from mixloop.doctor.report import MARGIN_BITS, DtypeRange, PrecisionReport
from mixloop.runner import workdir

REASON = "the probe"  # The `Float32Layer.reason` of the layers moved here.
FLOAT32_KEY, SCALE_KEY = "precision.float32_layers", "precision.initial_scale"


def is_wanted(precision: Any) -> bool:
    """Whether `config.precision` asks for any of this module's work."""
    return split_auto(precision.float32_layers)[0] or precision.initial_scale == AUTO or precision.heal


def start(run, stop_requested: Callable[[], bool] = lambda: False) -> None:
    """Places the layers and starts the loss scales as `config.precision` asks, before the first
    trace (the module docstring's start); does nothing unless `is_wanted`, and nothing more once
    `stop_requested()` gives the probe up.

    Raises:
      UserError: when the probe's batches cannot be read or the probe fails.
    """
    precision = run.config.precision
    if not (is_wanted(precision) and run.policy.is_mixed):
        return
    auto_layers, explicit = split_auto(precision.float32_layers)
    recorded = apply_recorded(run)
    auto_scale, fresh = precision.initial_scale == AUTO, int(run.global_step.numpy()) == 0
    if not (auto_layers or (auto_scale and fresh)):
        return  # Healing only: the probe waits for a divergence.
    if run.policy.compute_dtype != tf.float16:
        return  # bfloat16 has float32's range: nothing to place, no loss scale to start.
    replicas = run.strategy.num_replicas_in_sync
    unprobed = (f"the probe runs on one device and this run has {replicas} replicas" if replicas > 1
                else None if run.iterator_in_checkpoint else
                "the probe reads the run's next batches and puts its data position back, which a "
                "checkpoint cannot hold here (generator data, or a strategy other than the "
                "default), and an iterator of its own would change the run's data order")
    if unprobed:
        logging.warning("Automatic precision: not probed, %s; no layer moves and a dynamic loss "
                        "scale starts at %g (to pin what a probed run finds: "
                        "--config.precision.float32_layers=REGEX --config.precision.initial_scale="
                        "SCALE)", unprobed, DEFAULT_INITIAL_SCALE)
        return
    started = time.perf_counter()
    try:
        batches = _next_batches_put_back(run, precision.probe_batches)
        bad = _non_finite_inputs(batches)
        if bad:  # The probe would measure the data's NaN; the train step names it in its words.
            logging.warning("Automatic precision: not probed, %s; no layer moves and the loss "
                            "scales start where config.precision starts them", bad)
            return
        if auto_layers:
            reports, found, evidence = _place(run, batches, stop_requested)
        else:
            reports, found, evidence = _probe(run, batches, stop_requested), [], []
    except interrupts.ProbeStopped:  # The run saves and exits; its resume probes.
        logging.info("Automatic precision: the probe gave up for the stop request after %.1f s; no "
                     "layer moves, nothing recorded", time.perf_counter() - started)
        return
    except workdir.UnusableWorkdir:  # The run could not save either: it stops here, in one line.
        raise
    except (UserError, tf.errors.OpError) as error:
        logging.warning("Automatic precision: not probed, %s; no layer moves and the loss scales "
                        "start where config.precision starts them", _probe_failure(error))
        return
    seconds = time.perf_counter() - started
    pinned = pinned_regex(recorded or explicit, [layer.path for layer in found])
    if auto_layers:
        logging.info("precision.float32_layers=auto: %s",
                     _placement_sentence(reports[0], evidence, _pin(run, pinned), seconds))
    resolved = {FLOAT32_KEY: pinned} if auto_layers else {}
    if auto_scale and fresh:
        resolved[SCALE_KEY] = _start_loss_scales(run, reports, [l.path for l in found])
    _record(run, resolved, reports)


def heal(run) -> str:
    """Probes the weights the run diverged at on its next train batches and moves the layers found
    to float32, tracing the loops anew (the module docstring's divergence); returns a sentence
    saying what moved, '' when the probe found nothing new, failed (a line says why) or no batch
    was left."""
    precision = run.config.precision
    if not run.policy.is_mixed:
        return ""
    started = time.perf_counter()
    batches = list(itertools.islice(run.train_iterator, precision.probe_batches))
    if not batches:  # The recovery then ends the run at the end of the data.
        logging.warning("The healing probe found no train batch left to read")
        return ""
    try:
        reports, found, evidence = _place(run, batches)
    except UserError as error:  # The recovery goes on without a heal.
        logging.warning("The healing probe failed (%s); no layer moves", error)
        return ""
    if not found:
        logging.info("The healing probe found no 16-bit layer to move to float32: %s",
                     _placement_sentence(reports[0], evidence, "", time.perf_counter() - started))
        return ""
    run.compile_loops()
    recorded = _recorded_regex(run.workdir)
    pinned = pinned_regex(recorded or split_auto(precision.float32_layers)[1],
                          [layer.path for layer in found])
    _record(run, {FLOAT32_KEY: pinned}, reports)
    return _placement_sentence(reports[0], evidence, _pin(run, pinned),
                               time.perf_counter() - started)


def cure(run) -> str:
    """For a float16 run that diverged with finite inputs, the end of its one line: the finest layers
    a probe of the weights it diverged at, on its next train batches, finds overflowing float16 and
    the setting that moves them, or where to look when it finds none; and that mixed_bfloat16 has
    float32's range. Nothing moves and nothing is recorded; '' for other compute dtypes."""
    if run.policy.compute_dtype != tf.float16:
        return ""
    bfloat16 = "--config.precision.policy=mixed_bfloat16 has float32's range"
    doctor = "python -m mixloop.diagnose with the same --config and --workdir"
    batches = list(itertools.islice(run.train_iterator, run.config.precision.probe_batches))
    if run.strategy.num_replicas_in_sync > 1 or not batches:
        return f"; {doctor} names the layers that overflow float16, or {bfloat16}"
    try:
        paths = _probe(run, batches)[0].advice.float32_layers
    except UserError as error:
        return f"; the precision probe of the weights it diverged at failed ({error}); {bfloat16}"
    if not paths:
        return (f"; the precision probe of the weights it diverged at finds no layer overflowing "
                f"float16 in the forward pass: {doctor} shows the gradients; {bfloat16}")
    auto_layers, explicit = split_auto(run.config.precision.float32_layers)
    regex = pinned_regex("|".join([AUTO] + ([explicit] if explicit else [])), paths)
    when = ("from the start (--config.precision.heal=True --config.train.max_recoveries=1 moves "
            "them mid-run)" if auto_layers else
            "(the default 'auto' moves them before the first update)")
    return (f"; the precision probe of the weights it diverged at finds {', '.join(paths)} "
            f"overflowing float16: --config.precision.float32_layers='{regex}' computes them in "
            f"float32 {when}, or {bfloat16}")


def apply_recorded(run) -> str:
    """Moves to float32 the layers config.json's `resolved` record names (what earlier probes and
    heals chose for these weights), logging them; returns the recorded regex ('' for none).

    Raises:
      UserError: for a record that is not a valid regex or names no layer (the rule of
        precision.float32_layers on the command line).
    """
    recorded = _recorded_regex(run.workdir)
    paths = [layer.path for layer in _move(run, _recorded_paths(run, recorded))]
    if paths:
        logging.info("Automatic precision: %s compute in float32, as config.json records "
                     "(precision.float32_layers=%r)", ", ".join(paths), recorded)
    return recorded


def check_replicas(config: Any, num_replicas: int) -> None:
    """Refuses healing with several replicas (its probe runs on one device); the other automatic
    settings, defaults for float16, leave such a run unprobed instead (`start`).

    Raises:
      ConfigError: naming the setting and the way out.
    """
    if config.precision.heal and num_replicas > 1:
        raise ConfigError(
            f"precision.heal=True probes on one device, but config.distribution="
            f"{config.distribution!r} gives {num_replicas} replicas; run once with "
            "--config.distribution=one_device and pin the regex it logs")


def pinned_regex(base: str, paths: Sequence[str]) -> str:
    """The `precision.float32_layers` regex that pins a placement: `base` (a regex) or the `paths`."""
    return "|".join(([base] if base else []) + [re.escape(path) for path in paths])


# ----- Private helpers. -----


def _next_batches_put_back(run, num_batches: int) -> list:
    """The run's next `num_batches` train batches, its data position put back afterwards, so the
    run reads them again: a second iterator over a dataset that reshuffles would move the shuffle
    seed it shares with the run's, and a resumed run would see another order than a straight one.

    Raises:
      tf.errors.OpError: when reading the data fails (its position is put back all the same).
      workdir.UnusableWorkdir: when the position cannot be saved (a full disk, no free inodes).
    """
    position = tf.train.Checkpoint(iterator=run.train_iterator)
    with workdir.scratch_folder(run.workdir, ".precision-probe-") as directory:
        try:
            saved = position.write(os.path.join(directory, "position"))
        except tf.errors.ResourceExhaustedError as error:  # Not a failure of the data's.
            raise workdir.unusable_workdir(run.workdir, error, directory) from None
        try:
            return list(itertools.islice(run.train_iterator, num_batches))
        finally:
            position.read(saved).assert_consumed()


def _place(run, batches: list, stop_requested: Callable[[], bool] = lambda: False
           ) -> tuple[list[PrecisionReport], list, list[str]]:
    """Probes `batches` and moves the layers the doctor advises to float32, the finest that need it
    (a block is not moved for a sublayer's overflow: the sublayer is); returns the reports, the
    layers moved and the evidence for each.

    Raises:
      interrupts.ProbeStopped: once `stop_requested()` during the probe, nothing moved.
    """
    reports = _probe(run, batches, stop_requested)
    # The layers' values come from the one forward pass every objective shares: the first
    # objective's advice on layers is every objective's.
    found = _move(run, reports[0].advice.float32_layers)
    layers = {layer.path: layer for layer in reports[0].layers}
    evidence = [advice.hot_layer_problem(layers[layer.path], reports[0].layers)
                for layer in found]
    return reports, found, evidence


def _probe(run, batches: Iterable[Any], stop_requested: Callable[[], bool] = lambda: False
           ) -> list[PrecisionReport]:
    """The doctor's reports on `batches`, one per objective, at the current weights.

    Raises:
      UserError: when reading the batches or running the model on them fails, or there are none.
      interrupts.ProbeStopped: once `stop_requested()` (`doctor.diagnosis.diagnose_batches`).
    """
    try:
        # Without the doctor's columns the advice does not read: rel.err and FP8.
        return diagnosis.diagnose_batches(run, list(run.objectives), batches,
                                                 relative_errors=False, float8=False,
                                                 stop_requested=stop_requested)
    except tf.errors.OpError as error:
        raise UserError(f"the precision probe failed on the train batches: "
                        f"{errors.op_error_summary(error)}") from None


def _non_finite_inputs(batches: list) -> str:
    """Why the probe cannot measure `batches`, or '': some batch's floating values hold inf or
    NaN (bad data: every figure would be NaN, and the advice made of them wrong)."""
    for index, batch in enumerate(batches, 1):
        for leaf in floating_leaves(batch):
            if not bool(tf.reduce_all(tf.math.is_finite(leaf))):
                return (f"probe batch {index} of {len(batches)} holds inf or NaN in its floating "
                        "values (bad data?)")
    return ""


def _probe_failure(error: Exception) -> str:
    """Why the start's probe gave no advice: a loss it cannot measure, in its own line, or the
    failure on the train batches (the train step meets the same data or model and says what is
    wrong in its own words)."""
    if isinstance(error, doctor_report.UnmeasurableLoss):
        return str(error)
    summary = error if isinstance(error, UserError) else errors.op_error_summary(error)
    return f"the probe failed on the train batches ({summary})"


def _recorded_regex(directory: str) -> str:
    """The pinning regex config.json's `resolved` record holds ('' for none).

    Raises:
      UserError: for a record that is not a valid regex (a hand-edited config.json).
    """
    resolved = workdir.read_resolved(directory)
    regex = resolved.get(FLOAT32_KEY, "") if isinstance(resolved, dict) else None
    if not (isinstance(regex, str) and config_compiles(regex)):
        raise UserError(f"{os.path.join(directory, 'config.json')}: its resolved record "
                        f"{FLOAT32_KEY}={regex!r} is not a regex over layer paths; repair it or "
                        "remove the record")
    return regex


def _recorded_paths(run, regex: str) -> list[str]:
    """The layer paths config.json's recorded `regex` matches.

    Raises:
      UserError: when it matches none (a hand-edited record), as the command line's regex would.
    """
    if not regex:
        return []
    setting = f"{os.path.join(run.workdir, 'config.json')}: its resolved record {FLOAT32_KEY}"
    try:
        return layer_precision.matching_paths(
            regex, list(layer_precision.named_layers(run.model)), setting)
    except ConfigError as error:
        raise UserError(f"{error}; repair the record or remove it") from None


def _move(run, paths: Sequence[str]) -> list[layer_precision.Float32Layer]:
    """Moves the 16-bit layers at `paths` to float32 (before any trace, or followed by one)."""
    return layer_precision.move_to_float32(run.model, run.policy, paths, REASON)


def _pin(run, pinned: str) -> str:
    """The flags that start a new run with this placement: `pinned` as precision.float32_layers
    and, under float8_layers=auto, the layers it chose (placed first, `auto` would leave out the
    layers now moved, which keep float8 over float32 here)."""
    flags = f"--config.precision.float32_layers='{pinned}'"
    if run.config.precision.float8_layers == AUTO and run.float8_paths:
        chosen = "|".join(re.escape(path) for path in run.float8_paths)
        flags += f" --config.precision.float8_layers='{chosen}'"
    return flags


def _placement_sentence(report: PrecisionReport, evidence: list[str], pin: str,
                        seconds: float) -> str:
    """'probed N train batches in S s: <evidence per layer moved>; moved to float32 (to pin this
    placement: <pin>)', or that nothing needed moving and how close the largest 16-bit value came."""
    probed = f"probed {report.num_batches} train batches in {seconds:.1f} s"
    if evidence:
        return f"{probed}: {'; '.join(evidence)}; moved to float32 (to pin this placement: {pin})"
    low = [layer for layer in report.layers if layer.compute_dtype != "float32"]
    closest = min(low, key=lambda layer: layer.headroom_bits, default=None)
    if closest is None:
        return f"{probed}: no layer computes in 16 bits; no layer moved"
    return (f"{probed}: every 16-bit value stays {MARGIN_BITS} or more doublings below its dtype's "
            f"largest (closest: {closest.path}, values up to {closest.max_abs:.3g}, "
            f"{closest.headroom_bits:.1f} doublings); no layer moved")


def _start_loss_scales(run, reports: list[PrecisionReport],
                       moved: list[str]) -> Union[None, float, dict[str, float]]:
    """Starts each objective's dynamic loss scale at the doctor's rule, given the layers `moved` to
    float32; logs one line per objective; returns the scale (a dict of them with several
    objectives), or None when no objective has a dynamic scale in float16."""
    chosen = {}
    for report in reports:
        loss_scale = run.objectives[report.objective].loss_scale
        whose = f" (objective {report.objective!r})" if len(reports) > 1 else ""
        advised = advice.initial_scale_keeping(report, moved)
        if not isinstance(loss_scale, DynamicLossScale) or advised is None:
            logging.info("precision.initial_scale=auto%s: %s", whose, _unstarted(loss_scale))
            continue
        scale = loss_scale.start_at(advised)
        clipped = "" if scale == advised else f", clipped from {advised:g} into [min_scale, max_scale]"
        logging.info("precision.initial_scale=auto%s: the loss scale starts at %g%s (the largest "
                     "probed gradient left in float16 stays %d or more doublings below %g; above "
                     "%g only where the gradients underflow there)", whose, scale, clipped,
                     MARGIN_BITS, DtypeRange.of(tf.float16).max_finite, DEFAULT_INITIAL_SCALE)
        chosen[report.objective] = scale
    if not chosen:
        return None
    return chosen if len(reports) > 1 else next(iter(chosen.values()))


def _unstarted(loss_scale: Any) -> str:
    """Why `initial_scale=auto` leaves an objective's loss scale where config.precision starts it."""
    if not isinstance(loss_scale, DynamicLossScale):
        return "no dynamic loss scale over float16 gradients to start"
    return (f"no gradient left in float16 is nonzero in the probed batches, which measures no "
            f"scale; the loss scale starts at {float(loss_scale.scale.numpy()):g}")


def _record(run, resolved: dict[str, Any], reports: list[PrecisionReport]) -> None:
    """Writes `resolved` into config.json's record and the doctor's reports into precision/."""
    if not run.is_chief:
        return
    workdir.record_resolved(run.workdir, {key: value for key, value in resolved.items()
                                              if value not in (None, "")})
    directory = os.path.join(run.workdir, "precision")
    os.makedirs(directory, exist_ok=True)
    for report in reports:
        suffix = f"-{report.objective}" if len(reports) > 1 else ""
        doctor_report.write_json(report, os.path.join(
            directory, f"report-step-{report.step}{suffix}.json"))
