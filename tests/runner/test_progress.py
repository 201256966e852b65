"""What the console says while a run starts, trains and ends: the compile time apart from steps/s,
a line before slow data work, an informative last line, and progress from plain Python too."""

import cli_runs
import logging
import os
import re
import subprocess
import sys
import time
from unittest import mock

import pytest
import tiny_experiment
from absl import flags
from absl import logging as absl_logging

from mixloop.runner import reporting

FIXTURES_DIR = cli_runs.FIXTURES_DIR
COMPILE_SECONDS = 1.0  # Added to the first loop call, as a slow XLA compilation would.


class UncountedTinyTrainer(tiny_experiment.TinyTrainer):
    """The tiny experiment whose train data tf.data cannot count (a filter), as a generator's."""

    def build_datasets(self):
        train, evaluation = super().build_datasets()
        return train.filter(lambda features, labels: True), evaluation


def test_compile_time_is_logged_apart_and_left_out_of_the_speed(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    config = tiny_experiment.get_config()
    config.train.num_steps, config.train.repeat_dataset = 10, False  # 16 batches, counted.
    config.jit_compile = True  # Named in the line: "tracing and XLA".
    trainer = UncountedTinyTrainer(config, str(tmp_path))
    compiled_loop, lengths = trainer.run.train_loop, []

    def slow_first_call(num_steps):
        lengths.append(num_steps)
        if len(lengths) == 1:
            time.sleep(COMPILE_SECONDS)
        return compiled_loop(num_steps)

    trainer.run.train_loop = slow_first_call
    metrics = trainer.train()

    assert lengths == [1, 4, 5]  # One update alone, then to the steps_per_loop=5 boundaries.
    compiled = float(re.search(r"Compiled the train loop in ([\d.]+) s \(tracing and XLA, and its "
                               r"first update; left out of steps/s and the ETA\)", caplog.text)[1])
    assert compiled >= COMPILE_SECONDS
    # 9 timed updates of a tiny MLP: far faster than the 10 / (1 s + ...) the whole interval gives.
    assert metrics["steps_per_sec"] > 5 * 10 / COMPILE_SECONDS
    progress = re.search(r"step 10/10  .*  ([\d.]+) steps/s  ETA 0s", caplog.text)
    assert float(progress[1]) == pytest.approx(metrics["steps_per_sec"], rel=0.01)

    messages = [record.getMessage() for record in caplog.records]
    building = messages.index("Building the datasets (UncountedTinyTrainer.build_datasets)...")
    counting = messages.index("Counting the train batches (tf.data does not know how many the train "
                              "dataset holds, so it is read once)...")
    assert re.fullmatch(r"Counting the train batches .*: done in [\d.]+ s", messages[counting + 1])
    assert building < counting < messages.index(next(m for m in messages if m.startswith("Compiled")))
    finished = messages[-1]
    assert re.fullmatch(r"Finished at step 10 of 10\. Train: loss [\d.]+  skipped_total 0\. "
                        r"Eval: accuracy [\d.]+  loss [\d.]+\.", finished), finished

    again = UncountedTinyTrainer(config, str(tmp_path))
    again.train()
    assert caplog.records[-1].getMessage() == (
        "Finished at step 10 of 10; no metrics: this run made no update (the workdir's checkpoint "
        "was already at step 10; raise config.train.num_steps to train further; earlier metrics "
        "are in its TensorBoard event files)")


def test_the_finish_line_says_why_eval_is_missing():
    line = reporting.describe_finish(40, 40, {"loss": 0.25, "loss_scale": 8.0, "steps_per_sec": 3.0,
                                              "skipped_total": 2.0}, has_eval_data=False)
    assert line == ("Finished at step 40 of 40. Train: loss 0.2500  skipped_total 2. Eval: none "
                    "(build_datasets() returned no eval dataset).")


def test_info_is_shown_from_python_unless_the_user_chose_a_verbosity():
    verbosity = flags.FLAGS["verbosity"]
    saved = verbosity.value, verbosity.using_default_value
    try:
        with mock.patch.object(flags.FlagValues, "is_parsed", return_value=False):
            absl_logging.set_verbosity(absl_logging.WARNING)  # The user's choice.
            reporting.show_info_by_default()
            assert absl_logging.get_verbosity() == absl_logging.WARNING

            verbosity.value, verbosity.using_default_value = -1, True  # absl's untouched default.
            reporting.show_info_by_default()
            assert absl_logging.get_verbosity() == absl_logging.INFO
    finally:
        verbosity.value, verbosity.using_default_value = saved


@pytest.mark.slow
def test_a_trainer_used_from_a_python_script_prints_its_progress(tmp_path):
    script = (
        "import tiny_experiment\n"
        "config = tiny_experiment.get_config()\n"
        "config.train.num_steps, config.eval.every_steps = 10, 0\n"
        f"tiny_experiment.TinyTrainer(config, {str(tmp_path)!r}).train()\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([cli_runs.TESTS_DIR, FIXTURES_DIR, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"step 10/10  loss [\d.]+  skipped 0 \(total 0\)  scale \d+  [\d.]+ steps/s",
                     result.stderr), result.stderr[-2000:]
    assert "Finished at step 10 of 10. Train: loss" in result.stderr
