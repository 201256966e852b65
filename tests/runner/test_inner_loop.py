"""The inner loop (runner/inner_loop.py): N steps in one call, their sums, the skip counters, and an
early end when the guard stops it."""

import numpy as np
import tiny_experiment

from mixloop.runner import guard
from mixloop.runner.inner_loop import numpy_totals


def make_run(workdir, **precision):
    config = tiny_experiment.get_config()
    config.precision.update(precision)
    config.jit_compile = False
    return tiny_experiment.TinyTrainer(config, str(workdir)).run


def test_one_call_makes_its_steps_and_sums_their_reports(tmp_path):
    run = make_run(tmp_path, policy="float32")
    loop = run.inner_loop.compiled(False)
    totals = numpy_totals(loop(run.train_iterator, np.int32(4)))["objectives"]["model"]
    assert totals["num_ran"] == totals["num_applied"] == totals["num_finite_loss"] == 4
    assert int(run.global_step.numpy()) == 4 and totals["stop_reason"] == guard.CONTINUE
    assert 0 < totals["loss_sum"] / 4 < 2.0  # Three classes: about log 3 at the start.
    assert run.inner_loop.compiled(False) is loop  # Traced once per mode, and kept.
    run.inner_loop.forget()
    assert run.inner_loop.compiled(False) is not loop


def test_the_loop_ends_at_the_update_the_guard_stops(tmp_path):
    """A scale that overflows every update and cannot back off (min_scale = initial_scale): the
    guard's OVERFLOW_AT_MIN_SCALE after the first, of 10 asked."""
    run = make_run(tmp_path, initial_scale=1e15, min_scale=1e15, max_scale=1e15, float32_layers="",
                   overflow_retries=0)
    totals = numpy_totals(run.inner_loop.compiled(False)(run.train_iterator, np.int32(10)))
    model = totals["objectives"]["model"]
    assert model["stop_reason"] == guard.OVERFLOW_AT_MIN_SCALE and model["num_ran"] == 1
    assert int(run.state.skips["model"].skipped_total.numpy()) == 1 and totals["last_inputs_finite"]
