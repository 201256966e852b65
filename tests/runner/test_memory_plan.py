"""The memory budget's plan (mixloop/runner/memory_plan.py): the budget's syntax, the choice among
micro-batch counts on made-up probes, the record a resume takes, and end to end through the CLI on
wide_activations_experiment, whose peak grows with the micro-batch."""

import json
import os
import re
import signal
import subprocess
import time

import pytest

import cli_runs
from mixloop import config as config_lib
from mixloop.errors import ConfigError, UserError
from mixloop.runner import memory_plan

MIB = 2**20
WIDE_CONFIG = os.path.join(cli_runs.FIXTURES_DIR, "wide_activations_experiment.py")


@pytest.mark.parametrize("value, parsed", [
    ("6GiB", ("bytes", 6 * 2**30)), ("1500MiB", ("bytes", 1500 * MIB)), ("8GB", ("bytes", 8 * 10**9)),
    ("1.5 GiB", ("bytes", int(1.5 * 2**30))), ("0.6", ("fraction", 0.6)), ("1", ("fraction", 1.0)),
    ("0", None), ("1.5", None), ("6 apples", None), ("GiB", None), ("-1GiB", None)])
def test_budget_syntax(value, parsed):
    assert config_lib.parse_memory_budget(value) == parsed


def test_a_bad_budget_is_one_line_naming_the_key():
    config = config_lib.base_config()
    config.trainer = "tiny_experiment.TinyTrainer"
    config.train.memory_budget = "6 apples"
    with pytest.raises(ConfigError, match=r"train.memory_budget.*'6 apples'.*'6GiB'"):
        config_lib.validate(config)


def test_a_fraction_is_of_the_available_ram_and_refused_on_an_accelerator(monkeypatch):
    monkeypatch.setattr(memory_plan.machine, "available_memory", lambda: 10 * 2**30)
    assert memory_plan.budget_bytes("0.5", accelerator=False) == 5 * 2**30
    assert memory_plan.budget_bytes("3GiB", accelerator=True) == 3 * 2**30
    with pytest.raises(ConfigError, match="give bytes"):
        memory_plan.budget_bytes("0.5", accelerator=True)


def test_micro_batch_counts_are_the_per_replica_divisors_from_the_configured_up():
    assert memory_plan.micro_batch_counts(64, 1, 1) == [1, 2, 4, 8, 16, 32, 64]
    assert memory_plan.micro_batch_counts(48, 2, 3) == [3, 4, 6, 8, 12, 24]
    assert memory_plan.micro_batch_counts(256, 1, 1)[-1] == memory_plan.MAX_MICRO_BATCHES == 64
    assert memory_plan.micro_batch_counts(256, 1, 128) == [128]  # More than 64 only as configured.


def _linear_probes(floor_mib, per_example_mib, batch_size, asked):
    """A measure whose peak is floor + per_example x micro-batch, recording what it was asked."""
    def measure(k, recompute):
        assert recompute == ""
        asked.append(k)
        return memory_plan.Probe(peak=int((floor_mib + per_example_mib * batch_size // k) * MIB),
                                 state_bytes=10 * MIB, jit_compile=False)
    return measure


def test_a_budget_forces_the_fewest_micro_batches_that_fit():
    asked = []
    # 500 + 10 x micro-batch: 1,140 MiB at 64 examples, 820 at 32, 660 at 16.
    k, recompute, probe = memory_plan.choose([1, 2, 4, 8, 16, 32, 64], 64, 700 * MIB,
                                             _linear_probes(500, 10, 64, asked))
    assert (k, recompute, probe.peak) == (4, "", 660 * MIB)
    assert asked == [64, 4]  # The smallest, then a quarter of the batch: the fit is exact.


def test_a_fit_that_was_wrong_steps_down_to_the_next_count():
    asked = []
    peaks = {64: 900, 16: 905, 8: 910, 4: 960, 2: 1200, 1: 1500}  # Flat, then steep: not a line.

    def measure(k, recompute):
        asked.append(k)
        return memory_plan.Probe(peak=peaks[k] * MIB, state_bytes=0, jit_compile=True)

    k, _, probe = memory_plan.choose([1, 2, 4, 8, 16, 64], 64, 1000 * MIB, measure)
    assert (k, probe.peak) == (4, 960 * MIB)
    assert asked == [64, 4]  # 4 is the quarter: measured under the budget at once.
    asked.clear()
    k, _, _ = memory_plan.choose([1, 2, 4, 8, 16, 64], 64, 950 * MIB, measure)
    # The line through 64 and 4 predicts 1 and 2 over 950: 8 is tried, and fits.
    assert k == 8 and asked == [64, 4, 8]


def test_no_count_fits_is_one_line_with_the_budget_that_would():
    with pytest.raises(UserError) as raised:
        memory_plan.choose([1, 2, 4], 4, 400 * MIB, _linear_probes(500, 10, 4, []))
    line = str(raised.value)
    assert "\n" not in line
    assert "cannot hold this run: even 1 example(s) per micro-batch peak at 510 MiB" in line
    assert "persistent state 10 MiB" in line and "at least 510 MiB" in line


def _planned_config(budget="2GiB"):
    config = config_lib.base_config()
    config.train.batch_size = 64
    config.train.memory_budget = budget
    return config


class _Trainer:
    pass


def test_a_resume_takes_the_recorded_plan_and_a_changed_budget_plans_again(tmp_path, monkeypatch):
    config = _planned_config()
    recorded = memory_plan.Plan(accumulation_steps=4, recompute="", jit_compile=False,
                                predicted_peak=900 * MIB,
                                budget=2 * 2**30, planned_for=memory_plan.planned_for(config, 1))
    (tmp_path / "config.json").write_text(json.dumps({"resolved": {"memory_plan": recorded.as_record()}}))

    def measured(*args):
        measured.calls += 1
        return memory_plan.Plan(8, "dense", True, 700 * MIB, 2**30, memory_plan.planned_for(args[0], 1))
    measured.calls = 0
    monkeypatch.setattr(memory_plan, "_measure_plan", measured)
    planned, plan = memory_plan.planned(config, str(tmp_path), _Trainer, 1)
    assert plan == recorded and measured.calls == 0
    assert (planned.train.accumulation_steps, planned.jit_compile) == (4, False)
    assert config.train.accumulation_steps == 1  # The config given is left as it was.

    changed = _planned_config("1GiB")
    planned, plan = memory_plan.planned(changed, str(tmp_path), _Trainer, 1)
    assert measured.calls == 1 and planned.train.accumulation_steps == 8
    assert planned.train.recompute == "dense"


def test_without_a_budget_nothing_is_planned(tmp_path):
    config = config_lib.base_config()
    assert memory_plan.planned(config, str(tmp_path), _Trainer, 1) == (config, None)


def test_several_workers_and_a_script_s_trainer_are_refused_in_one_line(tmp_path):
    config = _planned_config()
    config.distribution = "multi_worker"
    with pytest.raises(ConfigError, match="multi_worker"):
        memory_plan.planned(config, str(tmp_path), _Trainer, 1)

    class Local:
        pass
    with pytest.raises(UserError, match="define the Trainer in a module"):
        memory_plan.planned(_planned_config(), str(tmp_path), Local, 1)


def _run(*args):
    """Runs `python -m mixloop.train args` in a fresh interpreter; its exit code and stderr."""
    line, env = cli_runs.command_line("mixloop.train", *args)
    finished = subprocess.run(line, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=600)
    return finished.returncode, finished.stderr


@pytest.mark.slow
def test_a_budget_between_the_probes_peaks_plans_accumulation_and_the_run_stays_under(tmp_path):
    """wide_activations_experiment's peak grows with the micro-batch (on an AMD EPYC, 64 examples
    about 1,220 MiB, 1 about 710); a budget of the two extremes' midpoint forces accumulation.
    The run peaks under it, and so does every probe that finished but the first."""
    directory = tmp_path / "run"
    probes = {k: memory_plan.run_probe(_wide_config(), k, "", "wide_activations_experiment."
                                       "WideActivationsTrainer", str(tmp_path / f"k{k}"))
              for k in (1, 64)}
    assert probes[1].peak > probes[64].peak + 100 * MIB  # The fixture's activations show.
    budget_mib = (probes[1].peak + probes[64].peak) // 2 // MIB
    returncode, stderr = _run(
        f"--config={WIDE_CONFIG}", f"--workdir={directory}",
        f"--config.train.memory_budget={budget_mib}MiB")
    assert returncode == 0, stderr[-2000:]
    assert "(measured): " in stderr
    plan = json.loads((directory / "config.json").read_text())["resolved"]["memory_plan"]
    assert plan["accumulation_steps"] > 1
    assert plan["predicted_peak"] <= budget_mib * MIB
    own_peak = int(re.search(r"Peak memory of this process: ([\d,]+) MiB", stderr)[1].replace(",", ""))
    assert own_peak <= budget_mib
    # Every probe but the first (the smallest micro-batch) is stopped once over the budget, read
    # every 20 ms: one that ended within those may have passed it by its last allocation.
    probe_peaks = [int(peak.replace(",", "")) for peak in
                   re.findall(r"Memory probe: .* peak at ([\d,]+) MiB", stderr)]
    assert len(probe_peaks) >= 2
    assert all(peak <= budget_mib * 1.05 for peak in probe_peaks[1:]), (probe_peaks, budget_mib)
    assert not list(directory.glob(".memory-probe-*"))  # The probes' folders are gone.

    # A resume keeps the plan unprobed; a changed budget plans again, in one line.
    longer = f"--config.train.num_steps={_wide_config().train.num_steps + 2}"
    result = cli_runs.run("mixloop.train", f"--config={WIDE_CONFIG}", f"--workdir={directory}",
                          f"--config.train.memory_budget={budget_mib}MiB", longer, prefix=["env"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "as config.json records for this workdir" in result.stderr
    assert "Memory probe" not in result.stderr
    result = cli_runs.run("mixloop.train", f"--config={WIDE_CONFIG}", f"--workdir={directory}",
                          f"--config.train.memory_budget={budget_mib + 1}MiB", longer, prefix=["env"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "planning again" in result.stderr and "Memory probe" in result.stderr


@pytest.mark.slow
def test_a_budget_no_plan_fits_is_one_error_line_and_exit_2(tmp_path):
    directory = tmp_path / "run"
    result = cli_runs.run("mixloop.train", f"--config={WIDE_CONFIG}", f"--workdir={directory}",
                          "--config.train.memory_budget=100MiB", prefix=["env"])
    assert result.returncode == 2
    (line,) = cli_runs.error_lines(result)
    assert "config.train.memory_budget=100 MiB cannot hold this run" in line
    assert "give a budget of at least" in line
    assert "Traceback" not in result.stderr
    assert not directory.exists() or not list(directory.iterdir())


def _wide_config():
    import wide_activations_experiment

    return wide_activations_experiment.get_config()


def _probes_with_recompute(peaks, seconds, asked):
    """A measure from tables by (k, recompute), whose smallest micro-batch's probe lists two layers
    of 4 and 2 MiB per example."""
    layers = ({"path": "mlp", "bytes_per_example": 4 * MIB, "cost_per_example": 8.0},
              {"path": "norm", "bytes_per_example": 2 * MIB, "cost_per_example": 1.0})

    def measure(k, recompute):
        asked.append((k, recompute))
        return memory_plan.Probe(peak=peaks[k, recompute] * MIB, state_bytes=0, jit_compile=False,
                                 seconds_per_update=seconds.get((k, recompute), 1.0), layers=layers)
    return measure


def test_recompute_is_chosen_when_one_micro_batch_fewer_with_it_is_faster():
    # 16 examples, plain 500 + 10 MiB per example of a micro-batch.
    peaks = {(16, ""): 510, (4, ""): 540, (2, ""): 580, (1, ""): 660, (2, "norm"): 570,
             (2, "norm|mlp"): 530}
    asked = []
    k, recompute, probe = memory_plan.choose(
        [1, 2, 4, 8, 16], 16, 566 * MIB,
        _probes_with_recompute(peaks, {(4, ""): 2.0, (2, "norm|mlp"): 1.5}, asked))
    # Fewest plain: 4 (540 MiB, 2.0 s). One fewer, 2: fitted 580 needs 14 MiB over 8 examples, so
    # "norm" (cheapest per byte, 2 MiB counted); it saved 10 of the 16 counted: scaled, both.
    assert (k, recompute, probe.peak) == (2, "norm|mlp", 530 * MIB)
    assert asked == [(16, ""), (4, ""), (2, "norm"), (2, "norm|mlp")]


def test_plain_accumulation_is_kept_when_recompute_is_slower_or_cannot_save_enough():
    peaks = {(16, ""): 510, (4, ""): 540, (2, ""): 580, (1, ""): 660, (2, "norm"): 556}
    k, recompute, _ = memory_plan.choose(
        [1, 2, 4, 8, 16], 16, 566 * MIB,
        _probes_with_recompute(peaks, {(4, ""): 1.0, (2, "norm"): 1.4}, []))
    assert (k, recompute) == (4, "")
    # Steeper, 30 MiB per example: a budget of 515 fits 16 micro-batches only; 8 would need
    # (510 + 30 x 1 - 515) / 2 = 12.5 MiB per example, more than both layers hold.
    peaks[4, ""] = 600
    k, recompute, _ = memory_plan.choose(
        [1, 2, 4, 8, 16], 16, 515 * MIB, _probes_with_recompute(peaks, {}, []))
    assert (k, recompute) == (16, "")


def test_when_no_count_fits_as_configured_recompute_at_the_most_can():
    peaks = {(4, ""): 900, (2, ""): 950, (4, "norm|mlp"): 890}
    asked = []
    k, recompute, _ = memory_plan.choose([1, 2, 4], 4, 896 * MIB,
                                         _probes_with_recompute(peaks, {}, asked))
    assert (k, recompute) == (4, "norm|mlp")  # 4 MiB to save: norm's 2, then mlp's 4.
    assert asked == [(4, ""), (2, ""), (4, "norm|mlp")]  # 1 micro-batch, larger than 2's: not tried.


def test_headroom_keeps_a_plan_a_margin_under_the_budget():
    # 500 + 10 x micro-batch; a budget of 690: 4 micro-batches (660) fit it, but not 5% under.
    k, _, probe = memory_plan.choose([1, 2, 4, 8, 16, 32, 64], 64, 690 * MIB,
                                     _linear_probes(500, 10, 64, []), headroom=0.05)
    assert (k, probe.peak) == (8, 580 * MIB)
    with pytest.raises(UserError, match="at least 537 MiB"):  # 510 / 0.95.
        memory_plan.choose([1, 2, 4], 4, 400 * MIB, _linear_probes(500, 10, 4, []), headroom=0.05)


@pytest.mark.slow
def test_a_stop_during_the_probes_ends_them_in_one_line_and_leaves_nothing(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()  # The probes' scratch folder goes inside an existing workdir.
    line, env = cli_runs.command_line("mixloop.train", f"--config={WIDE_CONFIG}",
                                      f"--workdir={workdir}", "--config.train.memory_budget=2GiB")
    log = tmp_path / "stderr"
    with open(log, "w") as stderr:
        process = subprocess.Popen(line, env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=stderr)
        for _ in range(1200):  # The first probe is measured: the second is running.
            if "Memory probe" in log.read_text() or process.poll() is not None:
                break
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 143
    assert cli_runs.error_lines(subprocess.CompletedProcess(line, 143, "", log.read_text())) == [
        "error: interrupted by SIGTERM before training started; nothing was written"]
    probes = subprocess.run(["pgrep", "-f", f"mixloop.tools.memory_probe {workdir}"],
                            capture_output=True, text=True)
    assert probes.stdout == ""  # No probe outlives the run.
    assert list(workdir.iterdir()) == []  # Its scratch folder removed.


def test_a_stopped_probe_bounds_the_counts_tried_and_a_killed_first_one_is_the_error():
    stopped = memory_plan.OVER_BUDGET // MIB
    peaks = {(16, ""): 510, (4, ""): stopped, (8, ""): 530, (4, "norm|mlp"): 600}
    asked = []
    k, recompute, _ = memory_plan.choose([1, 2, 4, 8, 16], 16, 560 * MIB,
                                         _probes_with_recompute(peaks, {}, asked))
    # 1 and 2 micro-batches (16 and 8 examples) are larger than the 4 examples that were stopped:
    # not probed; the line through 510 alone says 8 fits, and it does. Then 4 with recompute, by
    # the line through 510 and 530 (570 at 4 examples): over, and too far over for a second try.
    assert (k, recompute) == (8, "")
    assert asked == [(16, ""), (4, ""), (8, ""), (4, "norm|mlp")]
    with pytest.raises(UserError, match="was killed before it finished"):
        memory_plan.choose([1, 2], 2, 560 * MIB,
                           _probes_with_recompute({(2, ""): stopped}, {}, []))


def test_a_probe_without_a_speed_is_never_the_faster():
    slow, unknown = (memory_plan.Probe(1, 0, False, seconds_per_update=s) for s in (2.0, 0.0))
    assert memory_plan._faster(slow, unknown) and not memory_plan._faster(unknown, slow)


def test_a_record_no_run_writes_is_planned_again_and_a_tool_s_data_refused(tmp_path, monkeypatch):
    config = _planned_config()
    broken = memory_plan.Plan(accumulation_steps=0, recompute="", jit_compile=False,
                              predicted_peak=900 * MIB, budget=2 * 2**30,
                              planned_for=memory_plan.planned_for(config, 1))
    (tmp_path / "config.json").write_text(json.dumps({"resolved": {"memory_plan": broken.as_record()}}))
    fresh = memory_plan.Plan(2, "", False, 800 * MIB, 2 * 2**30, memory_plan.planned_for(config, 1))
    monkeypatch.setattr(memory_plan, "_measure_plan", lambda *args: fresh)
    assert memory_plan.planned(config, str(tmp_path), _Trainer, 1)[1] == fresh
    with pytest.raises(ConfigError, match="Trainer's own build_datasets"):
        memory_plan.planned(config, str(tmp_path), _Trainer, 1, own_data=False)


def test_a_budget_too_small_to_be_bytes_is_refused():
    assert config_lib.parse_memory_budget("0.1B") is None
    with pytest.raises(ConfigError, match="'6GiB'"):
        memory_plan.budget_bytes("lots", accelerator=False)


def test_a_heavier_smallest_micro_batch_does_not_end_the_plan():
    # A float16 run's precision probe weighed more with 64 micro-batches than with 4.
    peaks = {(16, ""): 1700, (4, ""): 1100, (8, ""): 1600, (2, ""): 1300, (1, ""): 1500}
    k, _, probe = memory_plan.choose([1, 2, 4, 8, 16], 16, 1200 * MIB,
                                     _probes_with_recompute(peaks, {}, []))
    assert (k, probe.peak) == (4, 1100 * MIB)
    with pytest.raises(UserError, match="even 4 example"):  # The lightest probe's micro-batch.
        memory_plan.choose([1, 2, 4, 8, 16], 16, 1000 * MIB, _probes_with_recompute(
            {**peaks, (4, "norm|mlp"): 1090, (16, "norm|mlp"): 1650}, {}, []))
