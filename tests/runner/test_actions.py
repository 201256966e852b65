"""Actions (runner/actions.py): what `Trainer.actions()` may return, when one runs, and the metrics it
may report."""

import numpy as np
import pytest

import mixloop
from mixloop.errors import UserError
from mixloop.runner.actions import checked_actions, returned_metrics


def sample(step):
    return {"fid": np.float32(1.5), "classes": 10}


def test_an_action_runs_every_n_updates_and_names_itself():
    action = mixloop.Action(sample, every_steps=5, at_eval=True)
    assert [step for step in range(1, 16) if action.is_due(step)] == [5, 10, 15]
    assert action.describe() == "sample (every 5 updates, at eval)"
    assert checked_actions(action) == [action] and checked_actions((action,)) == [action]


@pytest.mark.parametrize("kwargs", [dict(every_steps=0), dict(every_steps=-1), dict(every_steps=True),
                                    dict(every_steps=2.0)])
def test_an_action_that_never_runs_or_counts_oddly_is_one_line(kwargs):
    with pytest.raises(UserError, match="mixloop.Action needs a callable fn"):
        mixloop.Action(sample, **kwargs)


def test_returned_metrics_are_floats_and_may_not_take_a_reported_name():
    action = mixloop.Action(sample, every_steps=1)
    assert returned_metrics(action, sample(3), 3) == {"fid": 1.5, "classes": 10.0}
    assert returned_metrics(action, None, 3) == {}
    with pytest.raises(UserError, match="returned metric 'fid' at step 3, which the run reports"):
        returned_metrics(action, sample(3), 3, taken=["fid"])
    with pytest.raises(UserError, match="which the framework writes itself"):
        returned_metrics(action, {"loss/critic": 1.0}, 3, reserved=["loss"])
    with pytest.raises(UserError, match="is not a real number"):
        returned_metrics(action, {"fid": [1.0, 2.0]}, 3)
    with pytest.raises(UserError, match="must return a list of mixloop.Action"):
        checked_actions([sample])
