"""Replicas: choosing the `tf.distribute` strategy and feeding each replica its shard of the batch.

The step's own replica logic (one all-reduce per update, agreed finiteness) lives in step.py; this
module owns everything around it: which devices take part and how data reaches them.
"""

from __future__ import annotations

import os
from typing import Callable

import tensorflow as tf

from mixloop.config import DISTRIBUTIONS
from mixloop.errors import UserError

_COLLECTIVE_KEY_STRIDE = 100_000  # Far more group keys than one strategy ever takes.

def make_strategy(name: str) -> tf.distribute.Strategy:
    """The strategy `config.distribution` names; call it before TensorFlow runs any op.

    `auto` mirrors over the local GPUs when there are several and otherwise uses the default
    (single-device) strategy; `multi_worker` reads the cluster from the `TF_CONFIG` variable.
    """
    # Physical, not logical, devices: listing logical ones starts the runtime, after which a
    # multi-worker strategy can no longer configure its collective ops.
    gpus = tf.config.list_physical_devices("GPU")
    if name == "auto":
        name = "mirrored" if len(gpus) > 1 else "default"
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy("/gpu:0" if gpus else "/cpu:0")
    if name == "mirrored":
        # All GPUs; without GPUs, every logical CPU (tests split the CPU into several).
        devices = None if gpus else [d.name for d in tf.config.list_logical_devices("CPU")]
        _fresh_collective_keys(tf.distribute.MirroredStrategy)
        return tf.distribute.MirroredStrategy(devices)
    if name == "multi_worker":
        if "TF_CONFIG" not in os.environ:
            raise UserError("config.distribution='multi_worker' needs the TF_CONFIG variable set")
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver()
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    raise UserError(f"config.distribution={name!r} is not allowed: one of {', '.join(DISTRIBUTIONS)}")


def _fresh_collective_keys(strategy_class: type) -> None:
    """Moves the keys the next strategy of `strategy_class` numbers its collective ops from.

    Every MirroredStrategy numbers its all-reduces from the same keys, and TensorFlow keeps a key's
    shape for the life of the process: a second Trainer in one process (a sweep, a notebook) whose
    all-reduce carries another shape would abort with "Shape mismatch in the collective instance".
    `_collective_key_base` is TensorFlow's own offset for this (private; pinned by
    test_distribution.py::test_two_mirrored_trainers_in_one_process).
    """
    strategy_class._collective_key_base += _COLLECTIVE_KEY_STRIDE


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True on the worker that writes summaries, exports and the checkpoints users resume from."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or resolver.task_type is None:
        return True
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return resolver.task_type == "chief" or (not has_chief and resolver.task_id == 0)


def worker_index(strategy: tf.distribute.Strategy) -> int:
    """This process's task index in a multi-worker cluster, 0 otherwise."""
    resolver = getattr(strategy, "cluster_resolver", None)
    return int(resolver.task_id) if resolver is not None and resolver.task_type else 0


def shard_global_batches(
    dataset: tf.data.Dataset, global_batch_size: int, input_context: tf.distribute.InputContext
) -> tf.data.Dataset:
    """Splits a dataset of global batches so each replica reads its own slice of every batch.

    Every global batch is cut into one piece per input pipeline (worker), this worker keeps its
    piece, and the piece is cut again into one batch per local replica. The replicas of one update
    therefore see exactly the examples a single device would, in the same order.
    """
    num_pipelines = input_context.num_input_pipelines
    replicas = input_context.num_replicas_in_sync
    if global_batch_size % replicas:
        raise UserError(
            f"config.train.batch_size={global_batch_size} is not divisible by the "
            f"{replicas} replicas in sync"
        )
    if num_pipelines == 1 and replicas == 1:
        return dataset
    pipeline_batch = global_batch_size // num_pipelines
    return (dataset.rebatch(pipeline_batch, drop_remainder=True)
            .shard(num_pipelines, input_context.input_pipeline_id)
            .rebatch(global_batch_size // replicas, drop_remainder=True))


def distribute(
    strategy: tf.distribute.Strategy, make_dataset: Callable[[], tf.data.Dataset], global_batch_size: int
):
    """`distribute_datasets_from_function` over `make_dataset()`'s global batches."""
    return strategy.distribute_datasets_from_function(
        lambda context: shard_global_batches(make_dataset(), global_batch_size, context)
    )


def describe(strategy: tf.distribute.Strategy) -> str:
    """A line for the log: strategy type and replica count."""
    return f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replica(s)"


def has_accelerator() -> bool:
    """Whether this machine has a GPU or TPU (whose memory a run's peak is measured in); it
    starts no device."""
    return bool(tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU"))
