"""Optimizers and schedules from config: the learning rate at given iterations."""

import keras
import numpy as np
import pytest

from mixloop.config import base_config
import mixloop
from mixloop.runner.optimizers import learning_rate_schedule


def optimizer_config(**fields):
    config = base_config().optimizer
    config.update(fields)
    return config


def rate(schedule, step):
    return float(keras.ops.convert_to_numpy(schedule(step))) if callable(schedule) else schedule


@pytest.mark.parametrize("schedule, warmup, expected", [
    # (step, learning rate) pairs computed by hand for a peak of 1.0 over 100 steps.
    ("constant", 0, [(0, 1.0), (50, 1.0), (100, 1.0)]),
    ("constant", 10, [(0, 0.0), (5, 0.5), (10, 1.0), (100, 1.0)]),
    ("linear", 0, [(0, 1.0), (50, 0.5), (100, 0.0)]),
    ("linear", 20, [(10, 0.5), (20, 1.0), (60, 0.5), (100, 0.0)]),
    ("cosine", 0, [(0, 1.0), (50, 0.5), (100, 0.0)]),
    ("cosine", 20, [(10, 0.5), (20, 1.0), (60, 0.5), (100, 0.0)]),
])
def test_schedule_values(schedule, warmup, expected):
    lr = learning_rate_schedule(optimizer_config(learning_rate=1.0, schedule=schedule,
                                                 warmup_steps=warmup), num_steps=100)
    for step, value in expected:
        assert rate(lr, step) == pytest.approx(value, abs=1e-6), (schedule, step)


@pytest.mark.parametrize("name, cls", [("sgd", keras.optimizers.SGD), ("momentum", keras.optimizers.SGD),
                                       ("adam", keras.optimizers.Adam), ("adamw", keras.optimizers.AdamW)])
def test_build_optimizer_by_name(name, cls):
    config = base_config()
    config.optimizer.update(dict(name=name, weight_decay=0.01))
    optimizer = mixloop.build_optimizer(config)
    assert type(optimizer) is cls
    assert optimizer.weight_decay == pytest.approx(0.01)
    if name == "momentum":
        assert optimizer.momentum == pytest.approx(0.9)
    np.testing.assert_allclose(float(optimizer.learning_rate), 1e-3, rtol=1e-6)


def test_an_objective_every_5_steps_gets_its_schedule_over_its_own_updates():
    """A cosine schedule over 100 steps reaches zero after the 20 updates of an objective updated
    every 5 steps: its iterations advance on those only."""
    config = base_config()
    config.train.num_steps = 100
    config.optimizer.update(dict(learning_rate=1.0, schedule="cosine"))
    every_5 = mixloop.build_optimizer(config, every_steps=5)
    for iterations, expected in [(10, 0.5), (20, 0.0)]:
        every_5.iterations.assign(iterations)
        assert float(every_5.learning_rate) == pytest.approx(expected, abs=1e-6)


def with_name(config, name):
    config.optimizer.name = name
    return config


@pytest.mark.parametrize("call, error, message", [
    (lambda config: mixloop.build_optimizer(config, every_steps=0), ValueError,
     "mixloop.build_optimizer: every_steps=0 is not allowed: a positive integer, the every_steps "
     "of the objective it updates (1: every step)"),
    (lambda config: mixloop.build_optimizer(config.optimizer), TypeError,
     "mixloop.build_optimizer: config is the config.optimizer section; pass the run's whole config "
     "(self.config), whose optimizer section it reads with train.num_steps"),
    (lambda config: mixloop.build_optimizer(None), TypeError,
     "mixloop.build_optimizer: config is a NoneType; pass the run's whole config (self.config), "
     "whose optimizer section it reads with train.num_steps"),
    (lambda config: mixloop.build_optimizer(with_name(config, "bogus")), ValueError,
     "mixloop.build_optimizer: config.optimizer.name='bogus' is not one it builds: 'sgd', "
     "'momentum', 'adam', 'adamw'"),
], ids=["every_steps=0", "the optimizer section", "None", "an unknown name"])
def test_build_optimizer_refuses_what_it_cannot_read_in_one_line(call, error, message):
    with pytest.raises(error) as raised:
        call(base_config())
    assert str(raised.value) == message
