"""When the outer loop stops and what is due (runner/cadence.py): the built-in log, eval and
checkpoint and the actions share one mechanism."""

import itertools

import ml_collections
import pytest

import mixloop
from mixloop.runner.cadence import Cadence, Schedule


def config(num_steps=40, steps_per_loop=10, log=10, eval_every=20, checkpoint=15):
    c = ml_collections.ConfigDict()
    c.train = dict(num_steps=num_steps, steps_per_loop=steps_per_loop, log_every_steps=log)
    c.eval = dict(every_steps=eval_every)
    c.checkpoint = dict(every_steps=checkpoint)
    return c


def test_a_cadence_is_due_every_n_and_at_its_extra_steps():
    cadence = Cadence(15, also_at=(40,))
    assert [step for step in range(1, 46) if cadence.is_due(step)] == [15, 30, 40, 45]
    assert cadence.steps_to_due(0) == 15 and cadence.steps_to_due(30) == 10
    assert Cadence(0, (7,)).steps_to_due(7) is None and Cadence().steps_to_due(3) is None


def test_the_loop_stops_at_every_boundary_of_any_cadence_and_at_the_data_end():
    sample = mixloop.Action(lambda step: None, every_steps=7)
    schedule = Schedule(config(), [sample], last_step=33)
    step, stops = 0, []
    while step < 33:
        step += schedule.loop_length(step)
        stops.append(step)
    assert stops == [7, 10, 14, 15, 20, 21, 28, 30, 33]
    assert [s for s in stops if schedule.log.is_due(s)] == [10, 20, 30, 33]  # And the last step.
    assert [s for s in stops if schedule.eval.is_due(s)] == [20]  # Its last is num_steps: 40.
    assert schedule.train_actions(14) == [sample] and schedule.train_actions(15) == []


@pytest.mark.parametrize("log, eval_every, checkpoint, action_every, last_step",
                         itertools.product([0, 7], [0, 20], [0, 13], [0, 6], [40, 25]))
def test_loop_lengths_are_the_nearest_boundary(log, eval_every, checkpoint, action_every, last_step):
    """What the outer loop did before the schedule (the nearest multiple of any cadence, at most
    steps_per_loop, at most the last step) for every combination."""
    actions = [mixloop.Action(lambda step: None, every_steps=action_every)] if action_every else []
    schedule = Schedule(config(40, 10, log, eval_every, checkpoint), actions, last_step)
    for step in range(last_step):
        cadences = [10, log, eval_every, checkpoint, action_every]
        expected = min([every - step % every for every in cadences if every] + [last_step - step])
        assert schedule.loop_length(step) == expected


def test_eval_time_actions_are_listed_apart():
    at_eval = mixloop.Action(lambda step: None, at_eval=True)
    assert Schedule(config(), [at_eval], 40).eval_actions() == [at_eval]
