"""Interval statistics for the progress line and TensorBoard: means over what was measured."""

import math

from mixloop import reporting


def interval_after(loops):
    interval = reporting.Interval(step=100, skipped_total=4)
    for totals in loops:
        interval.add(totals, seconds=0.5)
    return interval


def totals(loss_sum, num_finite_loss, grad_norm_sum, num_applied):
    return dict(loss_sum=loss_sum, num_finite_loss=num_finite_loss, grad_norm_sum=grad_norm_sum,
                num_applied=num_applied)


def test_means_are_over_finite_losses_and_applied_updates():
    interval = interval_after([totals(6.0, 3.0, 2.0, 2.0), totals(2.0, 1.0, 4.0, 1.0)])
    summary = interval.summary(step=110, skipped_total=5, batch_size=32)
    assert summary == {"loss": 2.0, "grad_norm": 2.0, "skipped_steps": 1.0, "skipped_total": 5.0,
                       "steps_per_sec": 10.0, "examples_per_sec": 320.0}


def test_an_interval_of_skipped_updates_has_no_gradient_norm_rather_than_nan():
    summary = interval_after([totals(3.0, 1.0, 0.0, 0.0)]).summary(step=105, skipped_total=9,
                                                                   batch_size=8)
    assert "grad_norm" not in summary
    assert summary["skipped_steps"] == 5.0 and summary["loss"] == 3.0
    assert all(not math.isnan(value) for value in summary.values())
