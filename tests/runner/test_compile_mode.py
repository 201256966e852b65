"""jit_compile="auto": the probe's choice (with its measurement pinned), its record, and a run it
leaves exactly as a run configured in the chosen mode."""

import collections
import glob
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
import cli_runs
import slow_start_experiment
import tiny_experiment
from tensorflow.python.eager import context

from mixloop.config import ConfigError
from mixloop.errors import UserError
from mixloop import machine as mixloop_machine
from mixloop.runner import compile_cache, compile_mode


def make_trainer(workdir, **overrides):
    config = tiny_experiment.get_config()
    config.train.num_steps = 20
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    return tiny_experiment.TinyTrainer(config, str(workdir))


KNOWN_RULE = compile_mode._known_rule  # The fixture below turns it off; some tests put it back.


@pytest.fixture
def pinned_speeds(monkeypatch):
    """The probe measures every run, however short, and sees the speeds the test sets: seconds per
    loop by mode ({True: XLA, False: graph, "elementwise": graph with XLA fusing elementwise ops};
    unless a test says otherwise, "elementwise" is the slowest). The loops still run. Yields the
    modes timed."""
    monkeypatch.setattr(compile_mode, "MIN_PROBED_UPDATES", 0)
    monkeypatch.setattr(compile_mode, "PROBE_SHARE", math.inf)  # Every mode, however short the run.
    monkeypatch.setattr(compile_mode, "_known_rule", lambda compute_dtype, model: None)  # No rule.
    seconds, timed = {True: 1.0, False: 1.0, "elementwise": 10.0}, []

    def seconds_of_loop(run, num_updates):
        run.train_loop(num_updates)
        timed.append(run.jit_compile)
        return seconds[run.jit_compile]

    monkeypatch.setattr(compile_mode, "seconds_of_loop", seconds_of_loop)
    yield seconds, timed


def resolved(workdir):
    """The compile mode config.json records ({} when none)."""
    with open(os.path.join(workdir, "config.json")) as f:
        record = json.load(f).get("resolved", {})
    return {key: value for key, value in record.items() if key == compile_mode.KEY}


@pytest.mark.parametrize("mode_seconds, expected", [
    ((5.0, 1.0, 5.0), False), ((1.0, 5.0, 5.0), True), ((5.0, 5.0, 1.0), "elementwise")])
def test_auto_picks_the_fastest_mode_and_records_it(tmp_path, pinned_speeds, mode_seconds, expected):
    seconds, timed = pinned_speeds
    seconds.update(zip((True, False, "elementwise"), mode_seconds))
    trainer = make_trainer(tmp_path)
    trainer.train()
    assert trainer.run.jit_compile == expected
    assert trainer.run.train_step.jit_compile is (expected is True)  # Else the graph-mode step.
    # tiny_experiment accumulates 2 micro-batches: XLA compiles the loop's body.
    assert getattr(trainer.run.train_step.gradient_source.bodies[0], "_jit_compile",
                   False) is (expected is True)
    assert set(timed) == {True, False, "elementwise"}
    assert timed.count(True) == timed.count(False) == timed.count("elementwise")
    assert resolved(tmp_path) == {"jit_compile": expected}
    # The probe's trace of the chosen loop and step is the one the run goes on with.
    assert trainer.run._train_loop.experimental_get_tracing_count() == 1
    assert trainer.run.train_step.compiled.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("mode_seconds, chosen", [
    ((5.0, 1.0, 5.0), False), ((1.0, 5.0, 5.0), True), ((5.0, 5.0, 1.0), "elementwise")])
def test_the_probe_leaves_the_run_bit_identical_to_one_configured_in_the_chosen_mode(
        tmp_path, pinned_speeds, mode_seconds, chosen):
    pinned_speeds[0].update(zip((True, False, "elementwise"), mode_seconds))
    probed = make_trainer(tmp_path / "auto")
    probed_metrics = probed.train()
    explicit = make_trainer(tmp_path / "explicit", jit_compile=chosen)
    explicit_metrics = explicit.train()
    assert probed.run.jit_compile == chosen
    assert int(probed.run.global_step.numpy()) == int(explicit.run.global_step.numpy()) == 20
    for a, b in zip(probed.model.get_weights(), explicit.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(probed.objectives["model"].optimizer.variables,
                    explicit.objectives["model"].optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    timing = {"steps_per_sec", "examples_per_sec"}
    assert ({k: v for k, v in probed_metrics.items() if k not in timing}
            == {k: v for k, v in explicit_metrics.items() if k not in timing})
    assert "eval_loss" in probed_metrics


def test_a_resume_reuses_the_recorded_choice_without_probing(tmp_path, pinned_speeds):
    seconds, timed = pinned_speeds
    seconds.update({True: 5.0, False: 1.0})
    make_trainer(tmp_path).train()
    assert resolved(tmp_path) == {"jit_compile": False}
    seconds.update({True: 1.0, False: 5.0})  # XLA would now win, but the record stands.
    timed.clear()
    resumed = make_trainer(tmp_path, **{"train.num_steps": 30})
    resumed.train()
    assert int(resumed.run.global_step.numpy()) == 30
    assert resumed.run.jit_compile is False and timed == []
    assert resolved(tmp_path) == {"jit_compile": False}


def test_a_resume_with_another_accumulation_policy_or_model_measures_again(tmp_path, pinned_speeds):
    seconds, timed = pinned_speeds
    seconds.update({True: 5.0, False: 1.0})
    make_trainer(tmp_path).train()
    seconds.update({True: 1.0, False: 5.0})
    timed.clear()
    resumed = make_trainer(tmp_path, **{"train.num_steps": 30, "train.accumulation_steps": 1})
    resumed.train()
    assert resumed.run.jit_compile is True and timed  # Measured again, for the new accumulation.
    assert resolved(tmp_path) == {"jit_compile": True}


def test_a_deterministic_run_is_not_timed(tmp_path, pinned_speeds):
    seconds, timed = pinned_speeds
    seconds.update({True: 5.0, False: 1.0})
    trainer = make_trainer(tmp_path, deterministic=True)
    trainer.train()
    assert trainer.run.jit_compile is True and timed == []  # XLA, as for a short run.


@pytest.mark.parametrize("jit_compile", [True, False, "elementwise"])
def test_an_explicit_mode_is_never_probed_or_overridden(tmp_path, pinned_speeds, jit_compile):
    seconds, timed = pinned_speeds
    seconds.update({mode: 5.0 if mode == jit_compile else 1.0 for mode in seconds})  # Others win.
    trainer = make_trainer(tmp_path, jit_compile=jit_compile)
    trainer.train()
    assert trainer.run.jit_compile == jit_compile and timed == []
    assert getattr(trainer.run.train_step.gradient_source.bodies[0], "_jit_compile",
                   False) is (jit_compile is True)
    assert resolved(tmp_path) == {}


def _optimized_ops(trainer, num_updates):
    """How many of each op the graphs TensorFlow ran for `num_updates` updates hold, as optimized."""
    context.enable_run_metadata()
    try:
        trainer.run.train_loop(num_updates)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    return collections.Counter(node.op for graph in metadata.function_graphs
                               for node in graph.post_optimization_graph.node)


@pytest.mark.parametrize("jit_compile, fused", [("elementwise", True), (False, False)])
def test_elementwise_mode_fuses_with_xla_and_leaves_the_matrix_products_to_tensorflow(
        tmp_path, jit_compile, fused):
    """What "elementwise" is for: the matrix products stay TensorFlow's kernels (oneDNN's bfloat16
    on a CPU), while XLA clusters the rest; the same step without it has no cluster."""
    ops = _optimized_ops(make_trainer(tmp_path, jit_compile=jit_compile), 2)
    assert (ops["_XlaCompile"] > 0 and ops["_XlaRun"] > 0) is fused
    assert sum(count for op, count in ops.items() if "MatMul" in op) > 0


# Prints the clusters the elementwise step calls and the BiasAddGrad ops left outside them.
ELEMENTWISE_OPS = """
import collections, tempfile
import tiny_experiment  # Imports mixloop, which sets TF_XLA_FLAGS before TensorFlow's runtime starts.
from tensorflow.python.eager import context
config = tiny_experiment.get_config()
config.jit_compile = "elementwise"
trainer = tiny_experiment.TinyTrainer(config, tempfile.mkdtemp())
context.enable_run_metadata()
trainer.run.train_loop(2)
ops = collections.Counter(node.op for graph in context.export_run_metadata().function_graphs
                          for node in graph.post_optimization_graph.node)
print(ops["_XlaRun"], ops["BiasAddGrad"])
"""


def test_elementwise_mode_leaves_the_gradient_reductions_to_tensorflow():
    """Clustered together, the layers' gradient reductions kept every layer's gradient alive to the
    end of the backward pass (compile_mode.CLUSTERED_OPS). In a process of its own: TensorFlow reads
    TF_XLA_FLAGS once, when its runtime starts, which conftest.py does before mixloop is imported,
    so this process clusters with TensorFlow's defaults."""
    env = {name: value for name, value in os.environ.items() if name != "TF_XLA_FLAGS"}
    result = subprocess.run([sys.executable, "-c", ELEMENTWISE_OPS], cwd=cli_runs.FIXTURES_DIR,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    num_clusters, num_bias_gradients = map(int, result.stdout.split())
    assert num_clusters > 0 and num_bias_gradients > 0


@pytest.mark.parametrize("jit_compile", [True, "elementwise"])
def test_a_mode_with_xla_is_refused_for_several_replicas(jit_compile):
    with pytest.raises(ConfigError, match=rf"^config.jit_compile={jit_compile} is not supported with "
                                          r"more than one replica yet; set it to False or 'auto'$"):
        compile_mode.configured(jit_compile, 2)
    assert compile_mode.configured(jit_compile, 1) == (jit_compile, f"config.jit_compile={jit_compile}")


def test_a_short_run_takes_xla_unprobed_and_several_replicas_graph_mode(tmp_path):
    # 20 updates, under MIN_PROBED_UPDATES; float32, which no known rule keeps from XLA.
    short = make_trainer(tmp_path / "short", **{"precision.policy": "float32"})
    short.train()
    assert short.run.jit_compile is True
    mirrored = make_trainer(tmp_path / "mirrored", distribution="mirrored")
    assert mirrored.run.jit_compile is False  # Decided at construction: XLA does not compile replicas.


@pytest.mark.parametrize("policy, failing_mode, error, chosen", [
    ("float32", True, tf.errors.UnimplementedError(None, None, "no XLA kernel for this op"), False),
    ("float32", True, tf.errors.ResourceExhaustedError(None, None, "out of memory"), False),
    # An error of the data: the run meets it in the mode that reports it, and says it in one line.
    ("float32", False, tf.errors.InvalidArgumentError(None, None, "indices[3] = 7 is not in [0, 3)"),
     False),
    # Graph mode out of memory under the float16 rule: not the heavier XLA the rule leaves out.
    ("mixed_float16", False, tf.errors.ResourceExhaustedError(None, None, "out of memory"),
     "elementwise"),
])
def test_a_mode_that_fails_in_the_probe(tmp_path, monkeypatch, policy, failing_mode, error, chosen):
    monkeypatch.setattr(compile_mode, "MIN_PROBED_UPDATES", 0)
    monkeypatch.setattr(compile_mode, "PROBE_SHARE", math.inf)  # Every mode, however short the run.
    real = compile_mode.seconds_of_loop

    def failing(run, num_updates):
        if run.jit_compile is failing_mode:
            raise error
        return real(run, num_updates)

    monkeypatch.setattr(compile_mode, "seconds_of_loop", failing)
    trainer = make_trainer(tmp_path, **{"precision.policy": policy})
    trainer.train()
    assert trainer.run.jit_compile == chosen and type(trainer.run.jit_compile) is type(chosen) and int(trainer.run.global_step.numpy()) == 20
    assert resolved(tmp_path) == {}  # Nothing measured, nothing recorded.


OPS_TO_CLUSTER = f"--tf_xla_ops_to_cluster={compile_mode.CLUSTERED_OPS}"


@pytest.mark.parametrize("before, after", [
    ("", f"{OPS_TO_CLUSTER} --tf_xla_min_cluster_size=8"),
    ("--tf_xla_min_cluster_size=3 --tf_xla_auto_jit=2",
     f"--tf_xla_min_cluster_size=3 --tf_xla_auto_jit=2 {OPS_TO_CLUSTER}"),
    ("--tf_xla_ops_to_cluster=MatMul", "--tf_xla_ops_to_cluster=MatMul --tf_xla_min_cluster_size=8"),
])
def test_the_clustering_flags_are_added_unless_the_user_set_them(monkeypatch, before, after):
    monkeypatch.setenv("TF_XLA_FLAGS", before)
    compile_mode._cluster_elementwise_ops_only()
    assert os.environ["TF_XLA_FLAGS"] == after


def edit_resolved(workdir, edit):
    """config.json with its `resolved` record passed through `edit` (a hand edit); the record."""
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["resolved"] = edit(config["resolved"])
    with open(path, "w") as f:
        json.dump(config, f)
    return config["resolved"]


@pytest.mark.parametrize("edit, message", [
    (lambda record: {**record, "jit_compile": 1},
     "records resolved.jit_compile=1, which is not a compile mode: true, false or \"elementwise\"; "
     "repair it, or delete the key from the 'resolved' record to choose it again"),
    (lambda record: {**record, "jit_compile": "xla"},
     "records resolved.jit_compile=\"xla\", which is not a compile mode"),
    (lambda record: [record],
     ": its 'resolved' record is an array, not a JSON object of the values the 'auto' settings "
     "chose; repair it, or delete the record to choose them again"),
], ids=["1", "a string", "a list"])
@pytest.mark.parametrize("policy", ["mixed_float16", "float32"])  # float32: no precision probe reads it first.
def test_a_hand_edited_record_is_refused_in_one_line_before_any_probe(tmp_path, pinned_speeds,
                                                                     edit, message, policy):
    """1 == True in Python: read as XLA, it would have logged "with XLA" and run graph mode."""
    seconds, timed = pinned_speeds
    seconds.update({True: 5.0, False: 1.0})
    make_trainer(tmp_path, **{"precision.policy": policy}).train()
    record = edit_resolved(tmp_path, edit)
    timed.clear()
    with pytest.raises(UserError) as raised:
        make_trainer(tmp_path, **{"train.num_steps": 30, "precision.policy": policy}).train()
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert str(raised.value).startswith(os.path.join(tmp_path, "config.json"))
    assert timed == []
    assert json.load(open(os.path.join(tmp_path, "config.json")))["resolved"] == record  # Kept.
    assert not os.path.exists(os.path.join(tmp_path, ".lock"))


# ----- The cache of measured choices (compile_cache) and the known rule. -----


def test_a_new_workdir_of_the_same_setup_reuses_the_measured_choice(tmp_path, pinned_speeds, caplog):
    seconds, timed = pinned_speeds
    seconds.update({True: 5.0, False: 5.0, "elementwise": 1.0})
    first = make_trainer(tmp_path / "first")
    first.train()
    assert first.run.jit_compile == "elementwise"
    probed = len(timed)
    second = make_trainer(tmp_path / "second")
    with caplog.at_level(logging.INFO):
        second.train()
    assert second.run.jit_compile == "elementwise" and len(timed) == probed  # Nothing timed.
    assert any("as measured for this setup on this machine" in r.getMessage() for r in caplog.records)
    assert resolved(tmp_path / "second") == {"jit_compile": "elementwise"}  # A resume keeps it.


@pytest.mark.parametrize("change", [{"train.batch_size": 64}, {"precision.policy": "mixed_bfloat16"}])
def test_a_changed_batch_or_policy_measures_again(tmp_path, pinned_speeds, change):
    timed = pinned_speeds[1]
    make_trainer(tmp_path / "first").train()
    probed = len(timed)
    make_trainer(tmp_path / "changed", **change).train()
    assert len(timed) == 2 * probed


def test_with_the_cache_off_every_workdir_measures(tmp_path, pinned_speeds, monkeypatch):
    monkeypatch.setenv(compile_cache.CACHE_ENV, compile_cache.OFF)
    timed = pinned_speeds[1]
    make_trainer(tmp_path / "first").train()
    probed = len(timed)
    make_trainer(tmp_path / "second").train()
    assert len(timed) == 2 * probed


@pytest.mark.parametrize("explicit", [True, False, "elementwise"])
def test_an_explicit_mode_is_never_overridden_by_the_cache(tmp_path, explicit):
    trainer = make_trainer(tmp_path, jit_compile=explicit)
    other = next(mode for mode in compile_mode.MODES if mode != explicit)
    compile_cache.store(compile_cache.key_of(compile_cache.setup(trainer.run)), other, {})
    assert compile_mode.choose(trainer.run) is False and trainer.run.jit_compile == explicit
    trainer.train()
    assert trainer.run.jit_compile == explicit


@pytest.mark.parametrize("policy, flags, expected", [
    ("mixed_bfloat16", "avx512f avx512_bf16", False), ("mixed_bfloat16", "avx2 amx_bf16", False),
    ("mixed_bfloat16", "avx2 avx512f", True), ("mixed_float16", "avx512_bf16", False),
    ("mixed_float16", "avx2", False), ("float32", "avx512_bf16 amx_bf16", True)])
def test_a_short_run_takes_graph_mode_for_bfloat16_with_its_instructions_and_for_float16(
        tmp_path, monkeypatch, caplog, policy, flags, expected):
    monkeypatch.setattr(mixloop_machine, "cpu", lambda: {"model": "a CPU", "flags": flags})
    trainer = make_trainer(tmp_path, **{"precision.policy": policy})
    with caplog.at_level(logging.INFO):
        trainer.train()
    assert trainer.run.jit_compile is expected
    assert resolved(tmp_path) == {"jit_compile": expected}  # A resume keeps it.
    [line] = [r.getMessage() for r in caplog.records if "does not measure a run of" in r.getMessage()]
    reason = ("stays lighter than float32 in graph mode" if policy == "mixed_float16"
              else "runs fastest on TensorFlow's kernels")
    assert (reason in line) is (expected is False)


def test_a_deterministic_run_never_takes_a_timed_choice_from_the_cache(tmp_path):
    trainer = make_trainer(tmp_path, deterministic=True, **{"precision.policy": "float32"})
    compile_cache.store(compile_cache.key_of(compile_cache.setup(trainer.run)), "elementwise", {})
    trainer.train()
    assert trainer.run.jit_compile is True and resolved(tmp_path) == {"jit_compile": True}


def test_the_probe_compiles_no_mode_past_its_share_of_the_run(tmp_path, pinned_speeds, monkeypatch,
                                                            caplog):
    """With the share spent by the first mode's compile, the run takes it, measured alone."""
    timed = pinned_speeds[1]
    monkeypatch.setattr(compile_mode, "PROBE_SHARE", 1e-9)
    trainer = make_trainer(tmp_path)
    with caplog.at_level(logging.INFO):
        trainer.train()
    assert set(timed) == {True} and trainer.run.jit_compile is True
    [line] = [r.getMessage() for r in caplog.records if "jit_compile=auto measured" in r.getMessage()]
    assert line.endswith("not timed without XLA, with XLA fusing its elementwise ops: the probe "
                         "stays under 0% of the run's estimated time")
    assert compile_mode._over_budget(10.0, 1, 1000, {True: 0.1}) is True  # 20 s > 5% of 100 s.
    monkeypatch.setattr(compile_mode, "PROBE_SHARE", 0.05)
    assert compile_mode._over_budget(10.0, 1, 1000, {True: 0.1}) is True
    assert compile_mode._over_budget(2.0, 1, 1000, {True: 0.1}) is False  # 4 s < 5 s.
    assert compile_mode._over_budget(3.0, 2, 1000, {True: 0.3, False: 0.1}) is False  # 4.5 s < 5 s.


@pytest.mark.parametrize("policy, first", [("mixed_bfloat16", "elementwise"),
                                           ("mixed_float16", False)])
def test_a_probe_with_room_for_one_mode_times_the_rules_first(tmp_path, pinned_speeds, monkeypatch,
                                                              policy, first):
    """Under a known rule a run whose budget holds one mode gets the rule's first: for bfloat16
    XLA fusing the elementwise ops (the faster measured), for float16 graph mode (the lighter)."""
    timed = pinned_speeds[1]
    monkeypatch.setattr(compile_mode, "PROBE_SHARE", 1e-9)
    monkeypatch.setattr(compile_mode, "_known_rule", KNOWN_RULE)
    monkeypatch.setattr(mixloop_machine, "cpu", lambda: {"model": "a CPU", "flags": "avx512_bf16"})
    trainer = make_trainer(tmp_path, **{"precision.policy": policy})
    trainer.train()
    assert timed and set(timed) == {first} and trainer.run.jit_compile == first


def test_a_bfloat16_probe_on_a_cpu_with_its_instructions_leaves_plain_xla_out(tmp_path, pinned_speeds,
                                                                              monkeypatch, caplog):
    timed = pinned_speeds[1]
    monkeypatch.setattr(compile_mode, "_known_rule", KNOWN_RULE)
    monkeypatch.setattr(mixloop_machine, "cpu", lambda: {"model": "a CPU", "flags": "avx512_bf16"})
    trainer = make_trainer(tmp_path, **{"precision.policy": "mixed_bfloat16"})
    with caplog.at_level(logging.INFO):
        trainer.train()
    assert set(timed) == {False, "elementwise"} and trainer.run.jit_compile is False
    [line] = [r.getMessage() for r in caplog.records if "jit_compile=auto measured" in r.getMessage()]
    assert "2 mode(s) compiled" in line and "; not timed with XLA: a bfloat16 policy" in line
    # What the probe cost beyond compiling the loop the run keeps, which it would compile anyway.
    probe, extra = map(float, re.search(r"probe: ([\d.]+) s, ([\d.]+) s more than compiling the "
                                        r"loop the run keeps", line).groups())
    assert 0 < extra < probe


def test_the_float16_rule_leaves_a_model_with_convolutions_to_xla():
    """TensorFlow's float16 convolutions on a CPU are slow: such a model may still take XLA."""
    dense = keras.Sequential([keras.Input((8, 3)), keras.layers.Dense(4)])
    nested = keras.Sequential([keras.Input((8, 3)),
                               keras.Sequential([keras.layers.SeparableConv1D(4, 3)])])
    assert "a float16 policy on a CPU, for a model without convolutions" in KNOWN_RULE("float16",
                                                                                       dense)
    assert KNOWN_RULE("float16", nested) is None
    assert KNOWN_RULE("float32", dense) is None


def test_a_cached_xla_choice_that_a_known_rule_leaves_out_is_measured_again(tmp_path, pinned_speeds,
                                                                             monkeypatch, caplog):
    """A float16 setup measured fastest with XLA before the float16 rule (a cache of an earlier
    version): the rule's modes are measured, not the cached XLA taken."""
    seconds, timed = pinned_speeds
    seconds.update({True: 1.0, False: 2.0, "elementwise": 5.0})
    make_trainer(tmp_path / "first").train()
    assert compile_cache.lookup(compile_cache.key_of(compile_cache.setup(
        make_trainer(tmp_path / "first").run)))["mode"] is True
    monkeypatch.setattr(compile_mode, "_known_rule", KNOWN_RULE)
    timed.clear()
    second = make_trainer(tmp_path / "second")
    with caplog.at_level(logging.INFO):
        second.train()
    assert set(timed) == {False, "elementwise"} and second.run.jit_compile is False
    assert not any("as measured for this setup" in r.getMessage() for r in caplog.records)


def test_the_probe_costs_the_run_all_but_the_compilation_of_the_loop_it_keeps():
    probe = compile_mode.Probe({True: 100.0, False: 80.0}, seconds=10.0,
                               compile_seconds={True: 7.0, False: 2.0})
    assert probe.extra_seconds(True) == 3.0 and probe.extra_seconds(False) == 8.0


@pytest.mark.slow
def test_a_stop_while_the_probe_compiles_ends_the_command_within_seconds(tmp_path):
    """The loss takes a minute to trace (slow_start_experiment's `trace` variant), as a long
    compilation does; SIGTERM comes then. The command ends within seconds, nothing written but
    its config (the campaign's case: 5-16 s later, once the compilation in C++ was done)."""
    process = cli_runs.start(
        "mixloop.train", f"--config={slow_start_experiment.__file__}:trace", f"--workdir={tmp_path}",
        "--config.precision.policy=float32", "--config.jit_compile=auto",
        "--config.train.num_steps=300")  # Long enough to be probed.
    try:
        while (line := process.stderr.readline()) and slow_start_experiment.TRACING not in line:
            pass
        assert glob.glob(str(tmp_path / ".compile-probe-*")), "not in the compile-mode probe"
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        stderr = process.communicate(timeout=30)[1]
        seconds = time.monotonic() - signalled
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert seconds < 5, seconds
    assert ("Stopped by SIGTERM during the compile-mode probe at step 0, which kept nothing: "
            "nothing to save, as a new start repeats this one. Run the same command to resume."
            in stderr)
    assert "Traceback" not in stderr
    assert os.listdir(tmp_path) == ["config.json"]  # No checkpoint, probe folder or lock.


@pytest.mark.slow
def test_a_kill_during_the_probe_leaves_a_copy_of_the_state_the_next_start_removes(tmp_path):
    """SIGKILL while the probe traces (slow_start_experiment's `trace` variant): its copy of the
    state stays behind; the next run of the workdir removes it and trains."""
    args = (f"--workdir={tmp_path}", "--config.precision.policy=float32")
    process = cli_runs.start("mixloop.train", f"--config={slow_start_experiment.__file__}:trace",
                             *args, "--config.jit_compile=auto", "--config.train.num_steps=300")
    try:
        while (line := process.stderr.readline()) and slow_start_experiment.TRACING not in line:
            pass
        process.kill()
        process.wait(timeout=30)
    finally:
        process.kill()
    left = glob.glob(str(tmp_path / ".compile-probe-*"))
    assert len(left) == 1 and os.listdir(left[0]), "the probe's copy of the state"

    result = cli_runs.run("mixloop.train", f"--config={cli_runs.TINY_CONFIG}", *args,
                          "--config.jit_compile=False")  # The same workdir, no probe this time.
    assert result.returncode == 0, result.stderr
    assert f"Removing {left[0]}, a probe's temporary folder an interrupted run left" in result.stderr
    assert not glob.glob(str(tmp_path / ".compile-probe-*"))
    assert cli_runs.checkpoint_steps(tmp_path) == [20, 40]


def test_a_stop_during_the_probe_ends_it_at_its_next_loop_and_the_run_saves(tmp_path, pinned_speeds,
                                                                           monkeypatch, caplog):
    """SIGTERM after the probe's first timed loop: no further loop, the state put back, nothing
    recorded (a resume measures), and the run saves step 0 and exits as a stop does."""
    timed = pinned_speeds[1]
    pinned = compile_mode.seconds_of_loop

    def terminated_once_timed(run, num_updates):
        taken = pinned(run, num_updates)
        os.kill(os.getpid(), signal.SIGTERM)  # The run's handler only records the request.
        return taken

    monkeypatch.setattr(compile_mode, "seconds_of_loop", terminated_once_timed)
    trainer = make_trainer(tmp_path)
    with caplog.at_level(logging.INFO):
        trainer.train()
    assert timed == [True] and int(trainer.run.global_step.numpy()) == 0
    assert resolved(tmp_path) == {}
    assert os.path.exists(tmp_path / "checkpoints" / "ckpt-0.index")
    messages = [r.getMessage() for r in caplog.records]
    assert "jit_compile=auto: the probe gave up for the stop request, state restored" in messages
    assert any(m.startswith("Stopped by SIGTERM at step 0; checkpoint saved") for m in messages)


class PythonInTheLoss(tiny_experiment.TinyTrainer):
    """A loss calling Python (`tf.py_function`): graph mode runs it, XLA has no kernel for it."""

    def compute_loss(self, outputs, batch):
        python = tf.reshape(tf.py_function(lambda: 0.0, [], tf.float32), [])
        return super().compute_loss(outputs, batch) + python


def test_an_unprobed_xla_choice_xla_cannot_compile_falls_back_to_graph_mode(tmp_path, caplog):
    """A short run takes XLA unmeasured: the first loop finds XLA cannot compile the step, and the
    run goes on in graph mode from the same batch, the choice recorded (a resume keeps it)."""
    config = tiny_experiment.get_config()
    config.precision.policy = "float32"
    config.train.num_steps = 20
    trainer = PythonInTheLoss(config, str(tmp_path))
    reference_config = tiny_experiment.get_config()
    reference_config.precision.policy, reference_config.train.num_steps = "float32", 20
    reference_config.jit_compile = False
    reference = PythonInTheLoss(reference_config, str(tmp_path / "graph"))
    with caplog.at_level(logging.WARNING):
        trainer.train()
    reference.train()
    assert trainer.run.jit_compile is False and resolved(tmp_path) == {"jit_compile": False}
    assert int(trainer.run.global_step.numpy()) == 20
    assert [r.getMessage() for r in caplog.records if "cannot run this step" in r.getMessage()] == [
        "Train step without XLA: jit_compile=auto had chosen with XLA, which cannot run this step "
        "(XLA cannot compile EagerPyFunc (No registered 'EagerPyFunc' OpKernel for XLA_CPU_JIT "
        "devices)); recorded"]
    for a, b in zip(trainer.model.get_weights(), reference.model.get_weights()):  # No batch lost.
        np.testing.assert_array_equal(a, b)
