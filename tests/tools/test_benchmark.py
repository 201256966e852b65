"""Speed: `python -m mixloop.benchmark` end to end, its variants and ratios, and what the numbers rest
on: the inner loop is traced once, whatever the loop lengths, and entered from Python once per loop."""

import json
import logging
import math
import sys
import time
from types import SimpleNamespace

import cli_runs
import keras
import pytest
import tensorflow as tf
import tiny_experiment

from cli_runs import TINY_CONFIG
from mixloop.doctor import memory
from mixloop.tools import benchmark, benchmark_results, benchmark_variants



def run_cli(*args):
    return cli_runs.run("mixloop.benchmark", *args)


@pytest.mark.slow
def test_quick_run_prints_the_table_and_writes_every_ratio(tmp_path):
    output = tmp_path / "speed.json"
    result = run_cli(f"--config={TINY_CONFIG}", "--quick", f"--output={output}")
    assert result.returncode == 0, result.stderr

    report = json.loads(output.read_text())
    assert (tmp_path / "speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # The chart beside it.
    names = [row["name"] for row in report["variants"]]
    # jit_compile=auto: the configured run (mixed_float16) in the mode the probe picked; every
    # policy in the three modes; each variant named by what differs from the configured run.
    auto = report["auto_compile_mode"]
    speeds, chosen = auto["examples_per_sec"], auto["mode"]
    modes = {"xla": True, "graph": False, "elementwise": "elementwise"}
    assert set(speeds) == set(modes) and all(speed > 0 for speed in speeds.values())
    assert speeds[next(key for key, mode in modes.items() if mode == chosen)] == max(speeds.values())
    others = [f"jit_compile={mode}" for mode in modes.values() if mode != chosen]

    def in_every_mode(name):
        return [name + ("" if mode == chosen else f" jit_compile={mode}") for mode in modes.values()]

    assert names == ["keras-fit", "keras-fit-tuned", "bare", *[f"bare {o}" for o in others],
                     "mixloop", "mixloop accumulation_steps=1", "mixloop accumulation_steps=4",
                     "mixloop accumulation_steps=8",
                     *[name for o in others
                       for name in (f"mixloop accumulation_steps=1 {o}", f"mixloop {o}")],
                     *in_every_mode("mixloop policy=float32"),
                     *in_every_mode("mixloop policy=mixed_bfloat16"),
                     "mixloop loss_scale=none", "mixloop float8_layers=auto",
                     "mixloop policy=mixed_bfloat16 float8_layers=auto",
                     "mixloop ema_decay=0.999", "mixloop +metric", "mixloop lighter",
                     "mixloop overflow_retries=0"]
    # XLA: fit leaves it off on a CPU, the tuned fit turns it on, the rest as the probe picked
    # unless named for another mode.
    named = {f"jit_compile={mode}": mode for mode in modes.values()}
    assert [row["xla"] for row in report["variants"]] == [False, True] + [
        named.get(name.rpartition(" ")[2], chosen) for name in names[2:]]
    assert report["repeats"] == 3 and report["quick"] is True
    assert report["updates_per_repeat"] == 5 and report["examples_per_repeat"] == 5 * 32
    for row in report["variants"]:
        assert len(row["seconds"]) == 3 and all(s > 0 for s in row["seconds"])
        speed = row["examples_per_sec"]
        assert 0 < speed["min"] <= speed["median"] <= speed["max"]
    assert list(report["ratios"]) == list(benchmark_results.RATIOS)
    assert all(math.isfinite(r) and r > 0 for r in report["ratios"].values()), report["ratios"]

    # Peak memory: --quick measures the variants that differ from the configured run in their
    # policy alone, and the lighter settings, each in a process of its own (a TensorFlow process:
    # hundreds of MB).
    rows = {row["name"]: row for row in report["variants"]}
    measured = ["mixloop", "mixloop policy=float32", "mixloop policy=mixed_bfloat16",
                "mixloop lighter"]
    assert [name for name, row in rows.items() if row["peak_bytes"] is not None] == measured
    assert all(100e6 < rows[name]["peak_bytes"] < 100e9 for name in measured)
    float16, float32, bfloat16, lighter = (rows[name]["peak_bytes"] for name in measured)
    assert report["memory_ratios"] == {"mixed_bfloat16/float32": round(bfloat16 / float32, 3),
                                       "mixed_float16/float32": round(float16 / float32, 3),
                                       "lighter/float32": round(lighter / float32, 3)}

    table = result.stdout.splitlines()
    assert "| variant | policy | accumulation | loss scale | XLA | examples/s |" in result.stdout
    peak_column = [line.rsplit("|", 2)[1].strip() for line in table if line.startswith("| mixloop")]
    assert peak_column[:2] == [memory.format_bytes(float16), "n/a"]  # mixloop, accumulation_steps=1
    assert [line.split("|")[1].strip() for line in table if line.startswith("| ")][1:] == names
    assert "mixloop/keras-fit" in table[-1] and "k8/k1" in table[-1]
    assert table[-3].startswith("16-bit vs float32, each in its fastest compile mode: mixed_bfloat16 ")
    assert ("; peak memory vs float32's, all in the configured compile mode: mixed_bfloat16 "
            f"{report['memory_ratios']['mixed_bfloat16/float32']:.2f}x, mixed_float16 "
            f"{report['memory_ratios']['mixed_float16/float32']:.2f}x, lighter "
            f"{report['memory_ratios']['lighter/float32']:.2f}x") in table[-3]
    assert "jit_compile=auto picks" in table[-3]


@pytest.mark.slow
def test_a_variant_that_does_not_fit_is_one_line_and_exit_2():
    result = run_cli(f"--config={TINY_CONFIG}", "--quick", "--config.train.batch_size=36",
                     "--config.train.accumulation_steps=1")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "mixloop accumulation_steps=8" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_an_existing_chart_beside_the_output_is_refused_before_the_work(tmp_path):
    (tmp_path / "speed.png").write_bytes(b"an earlier chart")
    result = run_cli(f"--config={TINY_CONFIG}", "--quick", f"--output={tmp_path}/speed.json")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert cli_runs.error_lines(result) == [
        f"error: --output={tmp_path}/speed.json writes its chart to {tmp_path}/speed.png, which "
        "exists; name a new place, or move it away"], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["speed.png"]


def _in_three_modes(name):
    return [name, f"{name} jit_compile=False", f"{name} jit_compile=elementwise"]


@pytest.mark.parametrize("policy, loss_scale, expected", [
    ("mixed_float16", "dynamic", [*_in_three_modes("mixloop policy=float32"),
                                  *_in_three_modes("mixloop policy=mixed_bfloat16"),
                                  "mixloop loss_scale=none"]),
    ("mixed_bfloat16", "dynamic", [*_in_three_modes("mixloop policy=float32"),
                                   *_in_three_modes("mixloop policy=mixed_float16"),
                                   "mixloop policy=mixed_float16 loss_scale=none"]),
    ("float32", "none", [*_in_three_modes("mixloop policy=mixed_float16"),
                         *_in_three_modes("mixloop policy=mixed_bfloat16"),
                         "mixloop policy=mixed_float16 loss_scale=dynamic"]),
])
def test_variations_change_settings_and_skip_what_the_configured_run_measures(
        policy, loss_scale, expected):
    config = tiny_experiment.get_config()
    config.precision.policy, config.precision.loss_scale = policy, loss_scale
    config.jit_compile = True
    names = list(benchmark_variants.mixloop_configs(config))
    accumulation = ["mixloop accumulation_steps=1", "mixloop accumulation_steps=4",
                    "mixloop accumulation_steps=8",
                    "mixloop accumulation_steps=1 jit_compile=False", "mixloop jit_compile=False",
                    "mixloop accumulation_steps=1 jit_compile=elementwise",
                    "mixloop jit_compile=elementwise"]
    float8 = [f"mixloop {'' if other == policy else f'policy={other} '}float8_layers=auto"
              for other in ("mixed_float16", "mixed_bfloat16")]
    assert names == ["mixloop", *accumulation, *expected, *float8]


@pytest.mark.parametrize("policy, loss_scale, rows", [
    ("mixed_float16", "dynamic", {"mixed_float16": "mixloop", "float32": "mixloop policy=float32",
                                  "mixed_bfloat16": "mixloop policy=mixed_bfloat16"}),
    # float16 under its dynamic scale, not the configured none.
    ("float32", "none", {"float32": "mixloop",
                         "mixed_float16": "mixloop policy=mixed_float16 loss_scale=dynamic",
                         "mixed_bfloat16": "mixloop policy=mixed_bfloat16"}),
])
def test_memory_compares_the_variants_that_change_the_policy_alone(policy, loss_scale, rows):
    config = tiny_experiment.get_config()
    config.precision.policy, config.precision.loss_scale = policy, loss_scale
    config.jit_compile = True
    assert benchmark_results.policy_rows(benchmark_variants.mixloop_configs(config)) == rows

    peaks = {rows["float32"]: 400, rows["mixed_float16"]: 300, rows["mixed_bfloat16"]: 200,
             benchmark_variants.LIGHTER: 100}
    variants = [benchmark_variants.Variant(name, "float32", 2, "none", True, False, False, lambda: None,
                                  peak_bytes=peaks.get(name))
                for name in [*benchmark_variants.mixloop_configs(config), benchmark_variants.LIGHTER]]
    assert benchmark_results.memory_ratios(variants, config) == {
        "mixed_bfloat16/float32": 0.5, "mixed_float16/float32": 0.75, "lighter/float32": 0.25}
    without_lighter = [v for v in variants if v.name != benchmark_variants.LIGHTER]
    assert benchmark_results.memory_ratios(without_lighter, config)["lighter/float32"] is None


def test_a_lighter_config_benchmarks_its_other_policies_with_float32_weights(tmp_path):
    """bfloat16 master weights need a policy computing in bfloat16: the float32 and float16 rows
    of a lighter config keep float32 weights, and each of them builds."""
    config = tiny_experiment.get_config()
    config.precision.policy, config.precision.master_weights = "mixed_bfloat16", "bfloat16"
    config.train.num_steps = 5
    configs = benchmark_variants.mixloop_configs(config)
    for name, changed in configs.items():
        policy = changed.precision.policy
        assert changed.precision.master_weights == ("bfloat16" if policy == "mixed_bfloat16"
                                                    else "float32"), name
    float32 = configs["mixloop policy=float32 jit_compile=True"]
    assert tiny_experiment.TinyTrainer(float32, str(tmp_path)).run.model.trainable_variables[0].dtype == "float32"


def test_the_lighter_variant_needs_the_configs_adam():
    config = tiny_experiment.get_config()
    trainer_class = tiny_experiment.TinyTrainer
    assert config.optimizer.name == "adamw" and benchmark_variants.lighter_fits(trainer_class, config)
    config.optimizer.name = "sgd"  # int8 moments are Adam's.
    assert not benchmark_variants.lighter_fits(trainer_class, config)
    config.optimizer.name = "adam"
    own_optimizer = type("OwnOptimizer", (trainer_class,),
                         {"build_optimizer": lambda self: keras.optimizers.Adam()})
    assert not benchmark_variants.lighter_fits(own_optimizer, config)


def test_a_peak_ratio_that_was_not_measured_reads_n_a_in_the_headline():
    # gan_digits has two objectives, so no lighter variant: its ratio is None, printed as n/a.
    report = dict(trainer="GanTrainer", updates_per_repeat=20, batch_size=64, repeats=5,
                  machine=dict(processor="cpu", cpu_count=2, tensorflow="2", keras="3"),
                  variants=[], ratios={name: 1.25 for name in benchmark_results.RATIOS},
                  memory_ratios={"mixed_bfloat16/float32": 1.05, "mixed_float16/float32": 1.02,
                                 "lighter/float32": None})
    headline = benchmark_results.format_table(report).splitlines()[-3]
    assert headline.endswith("mixed_bfloat16 1.05x, mixed_float16 1.02x, lighter n/a"), headline


def test_with_xla_off_the_variations_turn_it_on():
    config = tiny_experiment.get_config()
    config.jit_compile = False
    names = list(benchmark_variants.mixloop_configs(config))
    assert "mixloop jit_compile=True" in names and "mixloop policy=float32 jit_compile=True" in names


def test_a_loss_over_the_whole_batch_is_timed_beside_plain_accumulation():
    config = tiny_experiment.get_config()
    assert not any("batch_loss" in name for name in benchmark_variants.mixloop_configs(config))
    config.train.batch_loss = True
    configs = benchmark_variants.mixloop_configs(config)
    assert "mixloop batch_loss=False" in configs
    plain = configs["mixloop batch_loss=False"]
    assert not plain.train.batch_loss
    assert plain.train.accumulation_steps == config.train.accumulation_steps == 2
    assert all(c.train.batch_loss for name, c in configs.items() if name != "mixloop batch_loss=False")


def test_ratios_pair_repeats_before_taking_the_median():
    def variant(seconds):
        return benchmark_variants.Variant("v", "float32", 1, "none", False, False, False, run_fn=lambda: None, seconds=seconds)

    # A noisy second repeat slows both: per-repeat ratios 2, 2, 0.5 have median 2; the ratio of
    # the median speeds would say 1.
    fast, slow = variant([1.0, 4.0, 4.0]), variant([2.0, 8.0, 2.0])
    assert benchmark_results.pairwise_ratio(fast, slow) == 2.0


def test_a_policy_is_compared_with_float32_each_in_its_faster_compile_mode():
    def variant(name, policy, xla, seconds, scale="none"):
        return benchmark_variants.Variant(name, policy, 2, scale, xla, False, False, run_fn=lambda: None, seconds=seconds)

    variants = [
        variant("mixloop", "float32", True, [2.0, 2.0, 2.0]),
        variant("mixloop jit_compile=False", "float32", False, [2.5, 2.5, 2.5]),
        variant("mixloop policy=mixed_bfloat16", "mixed_bfloat16", True, [3.0, 3.0, 3.0]),
        variant("mixloop policy=mixed_bfloat16 jit_compile=False", "mixed_bfloat16", False,
                [1.0, 1.25, 1.0]),
        variant("mixloop policy=mixed_float16", "mixed_float16", True, [4.0, 4.0, 4.0], "dynamic"),
        variant("mixloop policy=mixed_float16 loss_scale=none", "mixed_float16", True,
                [1.0, 1.0, 1.0]),  # Faster, but not the dynamic scale a float16 run uses.
        variant("mixloop +metric", "mixed_bfloat16", False, [0.5, 0.5, 0.5]),  # Not a mode variant.
    ]
    assert benchmark_results.fastest_mode(variants, policy="float32").name == "mixloop"
    best = benchmark_results.fastest_mode(variants, policy="mixed_bfloat16")
    assert best.name == "mixloop policy=mixed_bfloat16 jit_compile=False"
    assert benchmark_results.pairwise_ratio(best, variants[0]) == 2.0  # Repeats: 2, 1.6, 2.
    assert benchmark_results.fastest_mode(variants, policy="mixed_float16",
                                  loss_scale="dynamic").name == "mixloop policy=mixed_float16"


def test_what_model_fit_cannot_train_is_timed_without_the_keras_and_bare_rows():
    pairs = tf.data.Dataset.from_tensors((tf.zeros([2, 8]), tf.zeros([2])))
    images = tf.data.Dataset.from_tensors(tf.zeros([2, 8, 8, 1]))
    config = tiny_experiment.get_config()
    one = SimpleNamespace(objectives={"model": None}, config=config)
    two = SimpleNamespace(objectives={"a": None, "b": None}, config=config)
    assert benchmark_variants.without_keras(one, pairs) == ""
    assert benchmark_variants.without_keras(one, images).startswith("train batches that are not (inputs, targets)")
    assert benchmark_variants.without_keras(two, pairs) == "2 objectives (one loss each)"
    config.train.batch_loss = True
    assert benchmark_variants.without_keras(one, pairs).startswith("a loss over the whole batch")
    assert benchmark_results.pairwise_ratio(benchmark_variants.Variant("v", "float32", 1, "none", False, False, False,
                                                      lambda: None, [1.0]), None) is None
    assert benchmark_results._shown(None) == "n/a" and benchmark_results._shown(1.234) == "1.23"


def make_trainer(workdir, **overrides):
    config = tiny_experiment.get_config()
    for key, value in overrides.items():
        section, field = key.split(".")
        config[section][field] = value
    return tiny_experiment.TinyTrainer(config, str(workdir))


# Loops end at every multiple of 7, 10, 15 and 20 and at 43: lengths 7, 3, 4, 1, 5, 1, 7, 2, ...
UNEVEN_LOOPS = {"train.num_steps": 43, "train.steps_per_loop": 7, "train.log_every_steps": 10,
                "eval.every_steps": 15, "checkpoint.every_steps": 20}


def test_the_inner_loop_and_the_step_are_traced_once_over_a_whole_run(tmp_path):
    trainer = make_trainer(tmp_path, **UNEVEN_LOOPS)
    trainer.train()

    assert int(trainer.run.global_step.numpy()) == 43
    assert trainer.run._train_loop.experimental_get_tracing_count() == 1
    assert trainer.run.train_step.compiled.experimental_get_tracing_count() == 1
    assert trainer.run.evaluation.step.experimental_get_tracing_count() == 1


def test_python_enters_the_inner_loop_once_per_loop_and_the_loop_holds_no_python(tmp_path):
    config = tiny_experiment.get_config()
    config.train.num_steps, config.train.steps_per_loop, config.train.log_every_steps = 40, 10, 20
    config.jit_compile = True  # Decided before the run: the loop below is the one it calls.
    trainer = tiny_experiment.TinyTrainer(config, str(tmp_path))
    compiled_loop, loop_lengths = trainer.run._train_loop, []

    def counted_loop(iterator, num_steps):
        loop_lengths.append(int(num_steps))
        return compiled_loop(iterator, num_steps)

    trainer.run._train_loop = counted_loop
    trainer.train()

    assert loop_lengths == [1, 9, 10, 10, 10]  # The first, which compiles, is timed apart.
    graph = compiled_loop.get_concrete_function(trainer.run.train_iterator, tf.constant(10)).graph
    op_types = {op.type for op in graph.get_operations()}
    op_types |= {node.op for function in graph.as_graph_def().library.function
                 for node in function.node_def}
    assert not op_types & {"PyFunc", "PyFuncStateless", "EagerPyFunc"}
    assert "While" in op_types or "StatelessWhile" in op_types  # The steps loop inside the graph.


def test_the_metric_variant_adds_one_train_metric_and_keeps_the_loss(tmp_path):
    plain = make_trainer(tmp_path / "plain", **{"train.num_steps": 5})
    with_metric = tiny_experiment.TinyTrainer(plain.config, str(tmp_path / "metric"),
                                              train_metrics=benchmark_variants.extra_metric)
    assert with_metric.run.train_metric_names == {"model": [benchmark_variants.EXTRA_METRIC]}
    outputs, batch = tf.constant([[1.0, 2.0, 3.0]]), (tf.zeros([1, 8]), tf.constant([2]))
    loss = with_metric.run.loss_fn(outputs, batch)
    assert float(loss.value) == pytest.approx(float(plain.compute_loss(outputs, batch)))
    assert float(loss.metrics[benchmark_variants.EXTRA_METRIC]) == pytest.approx(2.0)


def test_the_keras_fit_loss_gives_compute_loss_its_integer_labels_back(tmp_path):
    """Keras casts a loss function's targets to the outputs' dtype; a compute_loss comparing them
    with an integer argmax (charlm's accuracy) needs them back as integers."""

    class AccuracyTrainer(tiny_experiment.TinyTrainer):
        def compute_loss(self, outputs, batch):
            correct = tf.equal(tf.argmax(outputs, -1, output_type=tf.int32), batch[1])
            return super().compute_loss(outputs, batch) + 0.0 * tf.reduce_mean(
                tf.cast(correct, tf.float32))

    trainer = AccuracyTrainer(tiny_experiment.get_config(), str(tmp_path))
    loss = benchmark_variants._keras_loss(trainer, tf.int32)(tf.constant([2.0]), tf.constant([[0.0, 0.0, 9.0]]))
    assert float(loss) == pytest.approx(math.log1p(2 * math.exp(-9.0)), rel=1e-3)  # float32 softmax


def test_timing_logs_each_warm_up_and_each_repeat_as_it_goes(caplog):
    caplog.set_level(logging.INFO)
    variants = [benchmark_variants.Variant(name, "float32", 1, "none", False, False, False, lambda: time.sleep(0.01))
                for name in ("bare", "mixloop")]
    benchmark.time_interleaved(variants, repeats=2, examples_per_repeat=100)

    messages = [record.getMessage() for record in caplog.records]
    assert [m.split(":")[0] for m in messages] == [
        "warm-up 1 of 2, bare", "warm-up 2 of 2, mixloop", "repeat 1 of 2, bare",
        "repeat 1 of 2, mixloop", "repeat 2 of 2, bare", "repeat 2 of 2, mixloop"]
    speeds = [float(m.split(": ")[1].split()[0]) for m in messages[2:]]
    expected = [100 / seconds for pair in zip(*(v.seconds for v in variants)) for seconds in pair]
    assert speeds == pytest.approx(expected, rel=1e-3)
    assert all(speed < 100 / 0.01 for speed in speeds)  # Each repeat slept 10 ms.


def _row(name, policy, xla, seconds, accumulation_steps=1, loss_scale="none"):
    return dict(name=name, policy=policy, xla=xla, seconds=seconds,
                accumulation_steps=accumulation_steps, loss_scale=loss_scale)


# A run configured in mixed_bfloat16, auto picking graph mode: float32 is fastest with XLA (1.6 s a
# repeat), so every bar is 1.6 s over the row's seconds.
CHART_REPORT = dict(
    trainer="experiments.charlm.CharLMTrainer", batch_size=32, repeats=3,
    auto_compile_mode=dict(mode=False),
    machine=dict(processor="Test CPU @ 2.00GHz", cpu_count=2),
    variants=[
        _row("keras-fit", "mixed_bfloat16", False, [0.1] * 3),  # Not mixloop: left out.
        _row("bare", "mixed_bfloat16", False, [0.1] * 3),
        _row("mixloop", "mixed_bfloat16", False, [1.0, 1.0, 1.0]),
        _row("mixloop accumulation_steps=4", "mixed_bfloat16", False, [0.1] * 3, 4),
        _row("mixloop jit_compile=True", "mixed_bfloat16", True, [2.0, 2.0, 2.0]),
        _row("mixloop jit_compile=elementwise", "mixed_bfloat16", "elementwise", [0.8, 0.8, 0.8]),
        _row("mixloop policy=float32", "float32", False, [2.0, 2.0, 2.0]),
        _row("mixloop policy=float32 jit_compile=True", "float32", True, [1.6, 1.6, 1.6]),
        _row("mixloop policy=float32 jit_compile=elementwise", "float32", "elementwise",
             [1.7, 1.7, 1.7]),
        _row("mixloop policy=mixed_float16", "mixed_float16", False, [4.0] * 3, loss_scale="dynamic"),
        _row("mixloop policy=mixed_float16 jit_compile=True", "mixed_float16", True, [3.2] * 3,
             loss_scale="dynamic"),
        _row("mixloop policy=mixed_float16 jit_compile=elementwise", "mixed_float16", "elementwise",
             [2.0] * 3, loss_scale="dynamic"),
        _row("mixloop policy=mixed_float16 loss_scale=none", "mixed_float16", False, [0.1] * 3),
        _row("mixloop policy=mixed_float16 float8_layers=auto", "mixed_float16", False, [6.4] * 3,
             loss_scale="dynamic"),
        _row("mixloop float8_layers=auto", "mixed_bfloat16", False, [3.2] * 3),
        _row("mixloop ema_decay=0.999", "mixed_bfloat16", False, [0.1] * 3),
        _row("mixloop +metric", "mixed_bfloat16", False, [0.1] * 3),
        _row("mixloop overflow_retries=0", "mixed_float16", False, [0.1] * 3, loss_scale="dynamic"),
    ])


def test_the_chart_is_a_png_of_each_policy_in_each_mode_over_float32_at_its_fastest(tmp_path):
    path = tmp_path / "speed.png"
    speeds = benchmark_results.plot(CHART_REPORT, str(path))

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    # Groups in MODES' order, bars in POLICIES' order then the float8 rows (the configured mode
    # only); the loss_scale=none, accumulation and side variants are not bars.
    assert {mode: list(by_policy) for mode, by_policy in speeds.items()} == {
        "XLA": ["float32", "mixed_float16", "mixed_bfloat16"],
        "graph": ["float32", "mixed_float16", "mixed_bfloat16", "mixed_float16 + float8",
                  "mixed_bfloat16 + float8"],
        "elementwise": ["float32", "mixed_float16", "mixed_bfloat16"]}
    assert speeds["XLA"]["float32"] == 1.0
    assert speeds == {
        "XLA": pytest.approx({"float32": 1.0, "mixed_float16": 0.5, "mixed_bfloat16": 0.8}),
        "graph": pytest.approx({"float32": 0.8, "mixed_float16": 0.4, "mixed_bfloat16": 1.6,
                                "mixed_float16 + float8": 0.25, "mixed_bfloat16 + float8": 0.5}),
        "elementwise": pytest.approx({"float32": 1.6 / 1.7, "mixed_float16": 0.8,
                                      "mixed_bfloat16": 2.0})}


def test_chart_bars_pair_repeats_as_the_headline_does():
    rows = [_row("mixloop", "mixed_bfloat16", True, [1.0, 4.0, 4.0]),
            _row("mixloop policy=float32", "float32", True, [2.0, 8.0, 2.0])]
    report = dict(CHART_REPORT, variants=rows)
    assert benchmark_results.policy_speeds(report) == {"XLA": {"float32": 1.0, "mixed_bfloat16": 2.0}}


def test_without_matplotlib_the_chart_is_one_line_naming_the_install(tmp_path, caplog, monkeypatch):
    for module in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, module, None)  # Importing it raises ImportError.
    caplog.set_level(logging.INFO)
    path = tmp_path / "speed.png"
    assert benchmark_results.plot(CHART_REPORT, str(path)) is None
    assert not path.exists()
    assert [record.getMessage() for record in caplog.records] == [
        f"matplotlib is not installed, so no {path} (pip install -e '.[plot]')"]


def test_the_chart_goes_beside_the_json():
    assert benchmark.chart_path("runs/speed.json") == "runs/speed.png"
    assert benchmark.chart_path("speed") == "speed.png"
    assert benchmark.chart_path("speed.png") == "speed.png.png"  # Never the JSON's own path.


def test_mixloop_over_the_bare_loop_compares_one_micro_batch_each():
    """The bare loop takes the whole batch at once: its ratio pairs it with mixloop at one
    micro-batch, in the same compile mode, not with the configured run's two."""
    config = tiny_experiment.get_config()  # Two micro-batches.
    config.jit_compile = True
    variants = [benchmark_variants.Variant(name, *benchmark_variants.settings_of(changed),
                                           lambda: None)
                for name, changed in benchmark_variants.mixloop_configs(config).items()]
    variants += [benchmark_variants.Variant(name, "mixed_float16", 1, "none", xla, False, False,
                                            lambda: None)
                 for name, xla in (("bare", True), ("bare jit_compile=False", False))]
    mixloop, bare = benchmark_results.like_for_like_bare(variants, config)
    assert (mixloop.accumulation_steps, mixloop.xla, mixloop.loss_scale) == (1, True, "dynamic")
    assert mixloop.name == "mixloop accumulation_steps=1" and bare.name == "bare"
