"""The step under tf.distribute: MirroredStrategy on two logical CPUs, and two worker processes."""

import json
import socket

import cli_runs
import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny_experiment

import mixloop
from mixloop.runner import distribution

FIXTURES_DIR = cli_runs.FIXTURES_DIR


def mirrored():
    strategy = distribution.make_strategy("mirrored")  # Fresh collective keys, whatever ran before.
    assert strategy.num_replicas_in_sync == 2, "conftest.py splits the CPU into two logical devices"
    return strategy


def make_data(num_examples=32, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(num_examples, 8)).astype("float32"),
            rng.normal(size=(num_examples, 3)).astype("float32"))


def mse(outputs, batch):
    return tf.reduce_mean(tf.square(outputs - batch[1]))


def build_step(strategy, policy="float32", accumulation_steps=1, clip_global_norm=None,
               loss_scale=None):
    """A small MLP and its TrainStep built in `strategy`'s scope from fixed initial weights."""
    keras.utils.set_random_seed(7)
    policy = mixloop.Policy.from_string(policy)
    with strategy.scope():
        def build():
            inputs = keras.Input((8,))
            hidden = keras.layers.Dense(16, activation="tanh")(inputs)
            return keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))

        model = mixloop.build_model(build, policy)
        step = mixloop.TrainStep(
            model=model, optimizer=keras.optimizers.Adam(0.05), loss_fn=mse, policy=policy,
            loss_scale=loss_scale() if loss_scale else mixloop.DynamicLossScale(),
            accumulation_steps=accumulation_steps, clip_global_norm=clip_global_norm,
        )
    return step


def run_steps(strategy, step, data, num_steps, global_batch=16):
    """Runs `num_steps` updates over `data` in global batches, sharded as the Trainer does."""
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(global_batch, drop_remainder=True)
    iterator = iter(distribution.distribute(strategy, lambda: dataset.repeat(), global_batch))

    @tf.function
    def one_update():
        return step(next(iterator))

    return [tf.nest.map_structure(lambda v: v.numpy(), one_update()["objectives"]["model"])
            for _ in range(num_steps)]


def replica_weights(step):
    """Each replica's copy of every trainable variable, as NumPy arrays."""
    return [[np.array(local) for local in step.strategy.experimental_local_results(v)]
            for v in step.model.trainable_variables]


@pytest.mark.parametrize("policy, rtol, atol", [
    ("float32", 1e-5, 1e-7),
    # Mixed: each replica reduces its half of the batch in float16 and the halves are summed in
    # float32, where one device reduces the whole batch in float16: the gradients differ by float16
    # rounding (2**-11 relative). Measured: 8.8e-5 largest weight difference after 5 Adam steps of
    # lr 0.05 (0.2% of one step). A reduction error (a replica counted twice or not at all) moves
    # weights by whole steps, far beyond 2.5e-4.
    ("mixed_float16", 1e-3, 2.5e-4),
])
def test_mirrored_matches_single_device(policy, rtol, atol):
    data = make_data()
    single = build_step(tf.distribute.get_strategy(), policy)
    run_steps(tf.distribute.get_strategy(), single, data, 5)
    replicated = build_step(mirrored(), policy)
    run_steps(replicated.strategy, replicated, data, 5)

    for expected, copies in zip(single.model.get_weights(), replica_weights(replicated)):
        for copy in copies:
            np.testing.assert_allclose(copy, expected, rtol=rtol, atol=atol)


def test_overflow_on_one_replica_skips_everywhere_and_backs_off_once():
    features, targets = make_data(16)
    features[8:] *= 1e5  # Only the second replica's half: beyond float16's 65504, inf there.
    step = build_step(mirrored(), "mixed_float16")
    before = replica_weights(step)
    [metrics] = run_steps(step.strategy, step, (features, targets), 1)

    assert not metrics["applied"] and not metrics["grads_finite"]
    assert float(step.objectives["model"].loss_scale.scale) == 2.0**14
    assert int(step.objectives["model"].optimizer.iterations.numpy()) == 0
    for old, new in zip(before, replica_weights(step)):
        for old_copy, new_copy in zip(old, new):
            np.testing.assert_array_equal(old_copy, new_copy)


@pytest.fixture
def all_reduce_calls(monkeypatch):
    """Records the graph of every replica all-reduce traced, to see where communication happens."""
    calls = []
    original = tf.distribute.ReplicaContext.all_reduce

    def recording(self, reduce_op, value, options=None):
        calls.append(tf.compat.v1.get_default_graph().name)
        return original(self, reduce_op, value, options)

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", recording)
    return calls


@pytest.mark.parametrize("accumulation_steps", [1, 8])
def test_accumulation_communicates_once_per_update(accumulation_steps, all_reduce_calls):
    data = make_data(64)
    single = build_step(tf.distribute.get_strategy(), accumulation_steps=accumulation_steps)
    run_steps(tf.distribute.get_strategy(), single, data, 3, global_batch=32)
    all_reduce_calls.clear()  # The default strategy's all-reduce is an identity; count replicas'.

    replicated = build_step(mirrored(), accumulation_steps=accumulation_steps)
    run_steps(replicated.strategy, replicated, data, 3, global_batch=32)

    # Traced once per replica, outside the micro-batch while-loop and outside the update's cond
    # (the optimizer does not reduce again): one all-reduce per update, whatever k is.
    assert len(all_reduce_calls) == replicated.strategy.num_replicas_in_sync
    assert not any("while" in graph for graph in all_reduce_calls)
    for expected, copies in zip(single.model.get_weights(), replica_weights(replicated)):
        for copy in copies:
            np.testing.assert_allclose(copy, expected, rtol=1e-5, atol=1e-7)


def test_clipping_acts_on_the_global_gradient():
    data = make_data()
    single = build_step(tf.distribute.get_strategy(), clip_global_norm=0.05)
    single_metrics = run_steps(tf.distribute.get_strategy(), single, data, 3)
    replicated = build_step(mirrored(), clip_global_norm=0.05)
    replicated_metrics = run_steps(replicated.strategy, replicated, data, 3)

    assert all(m["grad_norm"] > 0.05 for m in single_metrics)  # Clipping really acted.
    for a, b in zip(single_metrics, replicated_metrics):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    for expected, copies in zip(single.model.get_weights(), replica_weights(replicated)):
        for copy in copies:
            np.testing.assert_allclose(copy, expected, rtol=1e-5, atol=1e-7)


def make_trainer(workdir, **overrides):
    config = tiny_experiment.get_config()
    config.model.dropout = 0.0  # Replicas draw their own dropout masks; compare without dropout.
    config.deterministic = True
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    return tiny_experiment.TinyTrainer(config, str(workdir))


def test_resume_under_mirrored_strategy(tmp_path):
    straight = make_trainer(tmp_path / "straight", distribution="mirrored")
    straight.train()
    make_trainer(tmp_path / "resumed", distribution="mirrored", **{"train.num_steps": 20}).train()
    resumed = make_trainer(tmp_path / "resumed", distribution="mirrored")
    resumed.train()

    assert resumed.run.strategy.num_replicas_in_sync == 2
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint_weights(directory):
    reader = tf.train.load_checkpoint(directory)
    names = sorted(name for name in reader.get_variable_to_shape_map()
                   if name.startswith("model_variables/"))
    return {name: reader.get_tensor(name) for name in names}


@pytest.mark.slow
def test_two_worker_processes_match_a_single_process(tmp_path):
    args = ["mixloop.train", f"--config={FIXTURES_DIR}/tiny_experiment.py",
            "--config.model.dropout=0.0", "--config.train.num_steps=20",
            "--config.deterministic=True", "--config.precision.policy=float32"]
    workers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    processes = []
    for index in range(2):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        processes.append(cli_runs.start(
            *args, f"--workdir={tmp_path / 'cluster'}", "--config.distribution=multi_worker",
            env={"TF_CONFIG": json.dumps(tf_config)}))
    single = cli_runs.run(*args, f"--workdir={tmp_path / 'single'}")
    try:
        outputs = [p.communicate(timeout=300)[1] for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert single.returncode == 0, single.stderr
    assert [p.returncode for p in processes] == [0, 0], outputs

    chief = checkpoint_weights(tmp_path / "cluster" / "checkpoints")
    other = checkpoint_weights(tmp_path / "cluster" / "worker-1" / "checkpoints")
    reference = checkpoint_weights(tmp_path / "single" / "checkpoints")
    assert chief.keys() == other.keys() == reference.keys() and chief
    for name in chief:
        np.testing.assert_array_equal(chief[name], other[name])
        np.testing.assert_allclose(chief[name], reference[name], rtol=1e-5, atol=1e-6)
    assert (tmp_path / "cluster" / "model.keras").exists()
    assert not (tmp_path / "cluster" / "worker-1" / "model.keras").exists()


def test_same_seed_same_run_on_every_strategy(tmp_path):
    """The data order and the initial weights do not depend on the strategy: a reshuffling dataset
    gives each new iterator another order, so a run must make exactly one, whatever the strategy."""
    weights = {}
    for name in ("default", "one_device", "mirrored"):
        # float32: two replicas sum the gradient in another order, which float16's rounding
        # amplified past any fixed bound on some CPUs; in float32 it moves 20 updates' weights by
        # about 1e-7, where another data order moves them by about 1e-2.
        trainer = make_trainer(tmp_path / name, distribution=name,
                               **{"train.num_steps": 20, "precision.policy": "float32"})
        trainer.train()
        weights[name] = trainer.model.get_weights()
    for a, b in zip(weights["default"], weights["one_device"]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(weights["default"], weights["mirrored"]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_two_mirrored_trainers_in_one_process(tmp_path):
    """Every MirroredStrategy numbers its collectives alike; without fresh keys the second run, whose
    all-reduce has another shape, aborted with "Shape mismatch in the collective instance"."""
    for width in (16, 8):
        trainer = make_trainer(tmp_path / str(width), distribution="mirrored",
                               **{"model.width": width, "train.num_steps": 10})
        trainer.train()
        assert int(trainer.run.global_step.numpy()) == 10
