"""Interval statistics for the progress line and TensorBoard: means over what was measured, per
objective; and the inner loop's per-update sums."""

import logging
import math

import pytest
import tensorflow as tf

from mixloop.errors import UserError
from mixloop.runner import reporting


def interval_after(loops, objectives=("model",), skipped=4):
    interval = reporting.Interval(step=100, skipped_totals={name: skipped for name in objectives})
    for totals in loops:
        interval.add(totals, seconds=0.5)
    return interval


def totals(loss_sum, num_finite_loss, grad_norm_sum, num_applied, metric_sums=None, metric_weight=0.0,
           num_ran=None, num_retries=0.0):
    return dict(loss_sum=loss_sum, num_finite_loss=num_finite_loss, grad_norm_sum=grad_norm_sum,
                num_applied=num_applied, metric_sums=metric_sums or {}, metric_weight=metric_weight,
                num_ran=num_finite_loss if num_ran is None else num_ran, num_retries=num_retries)


def test_means_are_over_finite_losses_and_applied_updates():
    interval = interval_after([{"objectives": {"model": totals(6.0, 3.0, 2.0, 2.0, num_retries=2.0)}},
                               {"objectives": {"model": totals(2.0, 1.0, 4.0, 1.0, num_retries=1.0)}}])
    summary = interval.summary(step=110, skipped_totals={"model": 5}, batch_size=32)
    assert summary == {"loss": 2.0, "grad_norm": 2.0, "skipped_steps": 1.0, "skipped_total": 5.0,
                       "retries": 3.0, "steps_per_sec": 10.0, "examples_per_sec": 320.0}


def test_the_loop_that_compiled_counts_in_the_means_but_not_in_the_speed(caplog):
    interval = reporting.Interval(step=0, skipped_totals={"model": 0})
    interval.add_untimed({"objectives": {"model": totals(9.0, 1.0, 1.0, 1.0)}}, num_steps=1)
    summary = interval.summary(step=1, skipped_totals={"model": 0}, batch_size=4)
    assert "steps_per_sec" not in summary and "examples_per_sec" not in summary

    interval.add({"objectives": {"model": totals(9.0, 9.0, 9.0, 9.0)}}, seconds=0.5)
    summary = interval.summary(step=10, skipped_totals={"model": 0}, batch_size=4)
    assert summary["loss"] == 1.8  # (9 + 9) / 10 finite losses: the untimed update counts here...
    assert summary["steps_per_sec"] == 18.0  # ...but not here: 9 timed updates in 0.5 s.
    assert summary["examples_per_sec"] == 72.0

    caplog.set_level(logging.INFO)
    reporting.log_progress(10, 100, summary)
    reporting.log_progress(1, 100, {"loss": 9.0, "skipped_steps": 0.0, "skipped_total": 0.0})
    assert [r.getMessage() for r in caplog.records] == [
        "step 10/100  loss 1.8000  skipped 0 (total 0)  18.00 steps/s  ETA 5s",
        "step 1/100  loss 9.0000  skipped 0 (total 0)"]


def test_an_interval_of_skipped_updates_has_no_gradient_norm_rather_than_nan():
    summary = interval_after([{"objectives": {"model": totals(3.0, 1.0, 0.0, 0.0)}}]).summary(
        step=105, skipped_totals={"model": 9}, batch_size=8)
    assert "grad_norm" not in summary
    assert summary["skipped_steps"] == 5.0 and summary["loss"] == 3.0
    assert all(not math.isnan(value) for value in summary.values())


def test_several_objectives_get_their_own_tags_and_metrics_their_own_weights():
    loop = {"objectives": {"g": totals(4.0, 2.0, 6.0, 2.0, {"coverage": 1.5}, 3.0, num_ran=1.0),
                           "d": totals(1.0, 2.0, 0.0, 0.0, {"real_accuracy": 0.8}, 1.0)}}
    summary = interval_after([loop], objectives=("g", "d")).summary(
        step=102, skipped_totals={"g": 4, "d": 6}, batch_size=1, cadenced=["g"])
    assert summary == {"loss/g": 2.0, "coverage": 0.5, "skipped_steps/g": 0.0, "skipped_total/g": 4.0,
                       "retries/g": 0.0, "updates/g": 1.0, "grad_norm/g": 3.0, "loss/d": 0.5,
                       "real_accuracy": 0.8, "skipped_steps/d": 2.0, "skipped_total/d": 6.0,
                       "retries/d": 0.0,
                       "steps_per_sec": 4.0, "examples_per_sec": 4.0}


def test_add_update_sums_finite_losses_applied_norms_and_weighted_metrics():
    running = reporting.zero_totals(["accuracy"])
    for loss, applied, weight, retries in [(2.0, True, 4.0, 0), (float("inf"), False, 2.0, 0),
                                           (1.0, True, 2.0, 2)]:
        report = {"loss": tf.constant(loss), "applied": tf.constant(applied), "ran": tf.constant(True),
                  "retries": tf.constant(retries),
                  "grad_norm": tf.constant(10.0), "weight": tf.constant(weight),
                  "grads_finite": tf.constant(applied), "loss_scale": tf.constant(8.0),
                  "metrics": {"accuracy": tf.constant(0.5 if applied else 0.0)}}
        running = reporting.add_update(running, report)
    values = tf.nest.map_structure(lambda t: t.numpy(), running)
    assert values["loss_sum"] == 3.0 and values["num_finite_loss"] == 2.0
    assert values["grad_norm_sum"] == 20.0 and values["num_applied"] == 2.0
    assert values["num_ran"] == 3.0 and values["num_retries"] == 2.0
    assert values["metric_sums"] == {"accuracy": 3.0} and values["metric_weight"] == 8.0
    assert values["last_loss"] == 1.0 and values["last_scale"] == 8.0


@pytest.mark.parametrize("name", ["loss_scale", "skipped_total/g", "loss"])
def test_metric_names_that_clash_with_built_in_tags_are_refused(name):
    with pytest.raises(UserError, match=f"a metric named '{name}', which the framework writes itself"):
        reporting.check_metric_names([name])


def test_the_progress_line_shows_losses_metrics_skips_and_scales_per_objective(caplog):
    caplog.set_level("INFO")
    reporting.log_progress(200, 2000, {"loss": 2.31412, "accuracy": 0.45, "skipped_steps": 1.0,
                                       "skipped_total": 3.0, "grad_norm": 0.5, "loss_scale": 32768.0,
                                       "learning_rate": 1e-3, "steps_per_sec": 12.3,
                                       "examples_per_sec": 787.2})
    reporting.log_progress(10, 20, {"loss/g": 0.7, "skipped_steps/g": 0.0, "skipped_total/g": 0.0,
                                    "retries/g": 0.0, "updates/g": 2.0, "loss/d": 1.4,
                                    "skipped_steps/d": 2.0, "skipped_total/d": 5.0, "retries/d": 3.0,
                                    "loss_scale/g": 1024.0, "loss_scale/d": 256.0,
                                    "steps_per_sec": 1.0, "examples_per_sec": 8.0})
    assert [record.getMessage() for record in caplog.records] == [
        "step 200/2000  loss 2.3141  accuracy 0.4500  skipped 1 (total 3)  scale 32768  "
        "12.30 steps/s  ETA 2m26s",
        "step 10/20  loss/g 0.7000  skipped/g 0 (total 0)  updates/g 2  loss/d 1.4000  skipped/d 2 (total 5)  "
        "retries/d 3  scale/g 1024  scale/d 256  1.00 steps/s  ETA 10s"]
