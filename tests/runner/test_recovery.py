"""When updates fail (runner/recovery.py): the first skip named once, a divergence recovered from the
last good checkpoint, and one line when no recovery is left."""

import logging

import numpy as np
import pytest
import tiny_experiment

from mixloop.runner import guard, reporting
from mixloop.runner.recovery import Recovery


def stuck_run(workdir, max_recoveries):
    """A float16 run whose every update overflows at a scale that cannot back off."""
    config = tiny_experiment.get_config()
    config.precision.update(initial_scale=1e15, min_scale=1e15, max_scale=1e15, float32_layers="",
                            overflow_retries=0)
    config.train.max_recoveries = max_recoveries
    config.jit_compile = False
    return tiny_experiment.TinyTrainer(config, str(workdir)).run


def test_the_first_skip_is_named_once_and_a_divergence_without_a_checkpoint_is_one_line(tmp_path, caplog):
    run = stuck_run(tmp_path, max_recoveries=1)
    recovery = Recovery(run)
    interval = reporting.Interval(0, run.state.skipped_totals())
    totals = run.train_loop(5)
    caplog.set_level(logging.INFO)
    recovery.name_first_failures(interval, totals)
    recovery.name_first_failures(interval, totals)
    named = [r.getMessage() for r in caplog.records if "First skipped update" in r.getMessage()]
    assert named == ["First skipped update (non-finite gradients) by step 1: non-finite in "
                     "dense/kernel, dense/bias in layer(s) dense"]
    with pytest.raises(guard.TrainingDiverged) as diverged:
        recovery.after_loop(totals)
    line = str(diverged.value)
    assert line.startswith("training diverged at step 1: the gradients still overflow at the "
                           "minimum loss scale (precision.min_scale); loss scale 1e+15")
    assert "last good checkpoint: none yet" in line


def test_a_divergence_after_a_checkpoint_restores_it_and_goes_on(tmp_path):
    run = stuck_run(tmp_path, max_recoveries=1)
    saved = [v.numpy().copy() for v in run.model.variables]
    run.checkpoints.save(checkpoint_number=0)
    recovery = Recovery(run)
    assert recovery.after_loop(run.train_loop(3)) and recovery.recoveries == 1
    assert not recovery.last_healed and recovery.heals == 0
    assert int(run.global_step.numpy()) == 0  # The checkpoint's step.
    for before, variable in zip(saved, run.model.variables):
        np.testing.assert_array_equal(before, variable.numpy())
    with pytest.raises(guard.TrainingDiverged):  # No recovery left.
        recovery.after_loop(run.train_loop(3))


def test_a_loop_that_did_not_diverge_needs_nothing(tmp_path):
    config = tiny_experiment.get_config()
    config.jit_compile = False
    run = tiny_experiment.TinyTrainer(config, str(tmp_path)).run
    assert not Recovery(run).after_loop(run.train_loop(2))
