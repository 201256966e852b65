"""The run's counters (runner/state.py): skips in total and in a row, and which gradients started
the latest streak."""

import tensorflow as tf

from mixloop.runner.state import RunState


def test_skips_count_in_a_row_and_the_streak_keeps_its_first_nonfinite_gradients():
    state = RunState({"model": 2})
    skips = state.skips["model"]
    for ran, applied, nonfinite, inputs_finite in [
            (True, False, [True, False], True),   # A streak starts: its gradients are kept...
            (True, False, [False, True], False),  # ...not the second skip's.
            (False, False, [True, True], True),   # Not due: nothing counts.
            (True, True, [False, False], True),   # Applied: the streak ends.
            (True, False, [False, True], False)]:  # A new streak.
        if ran and not applied and skips.consecutive_skips.numpy() == 0:
            expected_first = nonfinite
        skips.record(tf.constant(ran), tf.constant(applied), tf.constant(nonfinite),
                     tf.constant(inputs_finite))
        assert skips.first_nonfinite.numpy().tolist() == expected_first
    assert int(skips.skipped_total.numpy()) == 3 and int(skips.consecutive_skips.numpy()) == 1
    assert not bool(skips.first_inputs_finite.numpy())
    assert state.skipped_totals() == {"model": 3} and int(state.global_step.numpy()) == 0
