"""The commands' shared pieces, in-process: default workdirs and fitting a shortened run."""

import logging

import tiny_experiment

from mixloop import cli


def test_a_variant_gets_its_own_default_workdir():
    assert cli.default_workdir("experiments/charlm.py") == "runs/charlm"
    assert cli.default_workdir("experiments/charlm.py:quick") == "runs/charlm-quick"


def test_a_run_shortened_below_its_warmup_warms_up_over_a_tenth_with_a_notice(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    config = tiny_experiment.get_config()
    config.optimizer.schedule, config.optimizer.warmup_steps = "cosine", 100
    config.train.num_steps = 8
    trainer = cli.build_trainer(config, str(tmp_path))
    assert trainer.config.optimizer.warmup_steps == 0
    assert "optimizer.warmup_steps=100 does not fit train.num_steps=8: warming up over 0" in caplog.text
    config.train.num_steps, config.optimizer.warmup_steps = 40, 50
    assert cli.build_trainer(config, str(tmp_path / "b")).config.optimizer.warmup_steps == 4
