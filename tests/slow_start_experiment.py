"""tiny_experiment whose build_model says so on stderr and then waits: a startup to interrupt.

For the tests of Ctrl-C and SIGTERM before training starts (tests/test_train_cli.py).
"""

import sys
import time

import tiny_experiment

BUILDING = "slow_start_experiment: building the model"  # The line the tests wait for.


class SlowStartTrainer(tiny_experiment.TinyTrainer):
    def build_model(self):
        print(BUILDING, file=sys.stderr, flush=True)
        time.sleep(120)  # Interrupted by the test long before.
        return super().build_model()


def get_config(arg=None):
    config = tiny_experiment.get_config(arg)
    config.trainer = "slow_start_experiment.SlowStartTrainer"
    return config
