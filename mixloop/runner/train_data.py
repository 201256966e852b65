"""The train data: startup checks of its element spec, its iterator, how a resume finds its place.

`build_datasets()` returns global batches. Every one must hold `config.train.batch_size` examples,
known before the first step: accumulation and the replicas cut each batch by that number, so a
short last batch would fail only at the end of the first pass. The element spec says it at startup.

A resume continues the data where the checkpoint left it in one of two ways. A plain `tf.data`
iterator (the default strategy's) goes into the checkpoint. TensorFlow can checkpoint neither a
distributed iterator nor one whose pipeline holds Python state (`Dataset.from_generator`,
`py_function`); those are made on first use and fast-forwarded by the restored step
(`dataset.skip`), which reads the skipped batches again.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any, Callable, Optional

import keras
import tensorflow as tf
from absl import logging

from mixloop.errors import UserError
from mixloop.runner import distribution


def check_batches(element_spec: Any, batch_size: int) -> None:
    """The first dimension of the train data's leaves, where known, must be `batch_size`, and at
    least one leaf must know it.

    A leaf may lose its static batch dimension in a `map` (`tf.fill(tf.shape(x)[:1], ...)`) while
    its siblings keep it; a dataset batched without `drop_remainder=True` has it in none. Scalar
    leaves (rank 0) have no batch dimension; ragged and sparse leaves are checked like dense ones.

    Raises:
      UserError: naming a leaf, its shape and the fix, for another batch dimension or when no leaf
        knows it.
    """
    batched = [(path, spec.shape) for path, spec in keras.tree.flatten_with_path(element_spec)
               if getattr(spec, "shape", None) is not None and spec.shape.rank != 0]
    known = [(path, shape) for path, shape in batched if shape.rank and shape[0] is not None]
    for path, shape in known:
        if shape[0] != batch_size:
            raise UserError(
                f"the train dataset's batches hold {shape[0]} examples "
                f"({_describe_leaf(path, shape)}), but config.train.batch_size={batch_size}: "
                f"build_datasets() must batch the train data by config.train.batch_size (whole "
                f"global batches; the framework splits them over replicas and micro-batches)")
    if batched and not known:
        path, shape = batched[0]
        raise UserError(
            f"the train dataset's batch dimension is unknown ({_describe_leaf(path, shape)}): "
            f"batch it with drop_remainder=True (a generator: put the batch size in its "
            f"output_signature) so every batch has config.train.batch_size={batch_size} examples")


def _describe_leaf(path: tuple, shape: tf.TensorShape) -> str:
    """A nested element's place and shape, like `element [0] of shape (None, 8)`."""
    place = "".join(f"[{key!r}]" for key in path)
    return f"element {place} of shape {shape}" if place else f"shape {shape}"


def make_iterator(strategy: tf.distribute.Strategy, dataset: tf.data.Dataset, *, repeat: bool,
                  start_step: int, batch_size: int):
    """An iterator over `dataset`'s global batches, distributed, `start_step` batches in.

    The data repeats when `repeat` says so; otherwise it may run out.
    """
    data = dataset.repeat() if repeat else dataset
    data = data.skip(start_step).prefetch(tf.data.AUTOTUNE)
    return iter(distribution.distribute(strategy, lambda: data, batch_size))


def checkpointed_iterator(strategy: tf.distribute.Strategy,
                          iterator_from: Callable[[int], Any]) -> Optional[tf.data.Iterator]:
    """The run's iterator (`iterator_from(start_step)` makes one), made now from the first batch,
    when a checkpoint can hold it; otherwise None, and the run makes its iterator on first use,
    fast-forwarded by the restored step.

    Only the default strategy's iterator is a plain `tf.data` one. Whether TensorFlow can
    serialize it is tried once, here, rather than found out at the first save; a pipeline it
    cannot serialize is announced once.
    """
    if strategy is not tf.distribute.get_strategy():
        return None
    iterator = iterator_from(0)
    problem = _serialization_problem(iterator)
    if problem is None:
        return iterator
    logging.info("The train data cannot be checkpointed mid-stream (%s; Dataset.from_generator and "
                 "py_function hold Python state): a resumed run reads it again from the start and "
                 "skips the batches already trained on", problem)
    return None


def _serialization_problem(iterator: tf.data.Iterator) -> Optional[str]:
    """TensorFlow's reason it cannot checkpoint `iterator` (e.g. "PyFunc is stateful"), or None.

    Found by writing it once to a temporary folder: a fresh iterator's state is small.
    """
    with tempfile.TemporaryDirectory(prefix="mixloop-iterator-") as folder:
        try:
            tf.train.Checkpoint(iterator=iterator).write(os.path.join(folder, "probe"))
        except (tf.errors.FailedPreconditionError, tf.errors.UnimplementedError) as error:
            # "{{function_node ...}} PyFunc is stateful. [Op:SerializeIterator] name: "
            return error.message.split("}}")[-1].split("[Op:")[0].strip().rstrip(".")
    return None


def failed_reading(error: tf.errors.OpError) -> bool:
    """Whether a train loop's op `error` came from reading the data (a generator or `py_function`
    that raised, a file that went missing) rather than from the step.

    TensorFlow names the failing node last, in `[[...]]`: reading is an `IteratorGetNext`
    (`MultiDeviceIteratorGetNextFromShard` for a distributed iterator).
    """
    return bool(re.search(r"\[\[[^\]]*IteratorGetNext[^\]]*\]\]", error.message))
