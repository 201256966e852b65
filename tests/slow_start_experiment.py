"""tiny_experiment whose build_model says so on stderr and then waits: a startup to interrupt.

For the tests of Ctrl-C and SIGTERM before training starts (tests/test_train_cli.py). The `probe`
variant builds its model at once and waits in the precision probe instead, when the probe builds
its float32 twin (build_model's second call): a stop during the probe
(tests/test_auto_precision.py). The `trace` variant waits while the compile-mode probe traces
its loss, as a long compilation does: a stop during that probe (tests/test_compile_mode.py).
"""

import glob
import os
import sys
import time

import tensorflow as tf
import tiny_experiment

BUILDING = "slow_start_experiment: building the model"  # The line the tests wait for.
BUILDING_TWIN = "slow_start_experiment: building the probe's float32 twin"  # The probe's.
TRACING = "slow_start_experiment: tracing the loss"  # The line the compile-mode probe's test waits for.
TWIN_SECONDS = 3  # Long enough for the test's signal to come while the twin is built.


class SlowStartTrainer(tiny_experiment.TinyTrainer):
    def build_model(self):
        print(BUILDING, file=sys.stderr, flush=True)
        # Interrupted by the test long before. In short sleeps, as a build busy in Python: the
        # kernel may hand the signal to one of TensorFlow's threads, and then Python runs the
        # handler only when the main thread next runs Python code, not inside one long sleep.
        for _ in range(1200):
            time.sleep(0.1)
        return super().build_model()


class SlowProbeTrainer(tiny_experiment.TinyTrainer):
    def build_model(self):
        if self.model is not None:  # Built already: this is the probe's twin.
            print(BUILDING_TWIN, file=sys.stderr, flush=True)
            time.sleep(TWIN_SECONDS)  # The signal's handler runs; the sleep goes on.
        return super().build_model()


class SlowTraceTrainer(tiny_experiment.TinyTrainer):
    def compute_loss(self, outputs, batch):
        # Traced by the compile-mode probe (its folder is there): a minute, in short sleeps.
        if tf.inside_function() and glob.glob(os.path.join(self.workdir, ".compile-probe-*")):
            print(TRACING, file=sys.stderr, flush=True)
            for _ in range(600):
                time.sleep(0.1)
        return super().compute_loss(outputs, batch)


TRAINERS = {"probe": "SlowProbeTrainer", "trace": "SlowTraceTrainer"}


def get_config(arg=None):
    config = tiny_experiment.get_config(None if arg in TRAINERS else arg)
    config.trainer = f"slow_start_experiment.{TRAINERS.get(arg, 'SlowStartTrainer')}"
    return config
