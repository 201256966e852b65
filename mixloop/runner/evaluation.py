"""Evaluation: the mean of the eval metrics over the eval set, with the EMA weights swapped in, and the
run's random states put back afterwards."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import keras
import tensorflow as tf

from mixloop import errors
from mixloop.engine import tracing
from mixloop.engine.ema import ExponentialMovingAverage
from mixloop.engine.micro_batches import in_micro_batches
from mixloop.engine.micro_step import forward
from mixloop.engine.policy import Policy
from mixloop.errors import UserError


class Evaluation:
    """The eval step of `model` in `policy` on batches of `data` (`num_batches` of them; 0 for
    all), its inputs from `input_fn` and its metrics from `metrics_fn(outputs, batch)`, the
    model's forward in `micro_batches` micro-batches of each batch (the metrics on all of it)."""

    def __init__(self, model: keras.Model, policy: Policy, input_fn: Callable[[Any], Any],
                 metrics_fn: Callable[[Any, Any], Mapping[str, Any]], num_batches: int,
                 micro_batches: int = 1):
        self.model, self.policy = model, policy
        self.input_fn, self.metrics_fn = input_fn, metrics_fn
        self.num_batches, self.micro_batches = num_batches, micro_batches
        self.forget()

    def forget(self) -> None:
        """Forgets the traced eval step (after a layer moved to float32)."""
        self.step = tracing.function(self._eval_batch)  # The eval step, traced per batch shape.

    def mean_metrics(self, data: tf.data.Dataset) -> dict[str, float]:
        """The mean of each metric over the examples of `data`: a batch's metrics count by its
        number of examples, so a short last batch counts as little as it holds.

        Raises:
          UserError: when `data` has no batch.
        """
        if self.num_batches:
            data = data.take(self.num_batches)
        sums, num_examples = {}, 0
        for batch in data:
            metrics, size = self.step(batch)
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value) * int(size)
            num_examples += int(size)
        if not num_examples:
            raise UserError(errors.EMPTY_EVAL_DATA)
        return {name: total / num_examples for name, total in sums.items()}

    def _eval_batch(self, batch: Any) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
        """One eval batch's metrics and its number of examples."""
        outputs = in_micro_batches(
            lambda inputs: forward(self.model, self.policy, inputs, training=False),
            tracing.hook(self.input_fn)(batch), self.micro_batches)
        metrics = {name: tf.cast(value, tf.float32)
                   for name, value in tracing.hook(self.metrics_fn)(outputs, batch).items()}
        return metrics, tf.shape(tf.nest.flatten(batch)[0])[0]


def micro_batches(config: Any) -> int:
    """The forwards per eval batch `config.eval.micro_batches` asks: 0 takes the train step's
    number of micro-batches (so an eval batch as large as the train batch, on one replica, holds
    no more activations than a train micro-batch)."""
    return config.eval.micro_batches or config.train.accumulation_steps


@contextlib.contextmanager
def ema_swapped_in(averages: Mapping[str, ExponentialMovingAverage],
                   strategy: tf.distribute.Strategy) -> Iterator[None]:
    """Each of `averages` (by objective) in its weights for the `with` block."""
    with contextlib.ExitStack() as stack, strategy.scope():
        for average in averages.values():
            stack.enter_context(average.swapped_in())
        yield


@contextlib.contextmanager
def states_kept(states: list, strategy: tf.distribute.Strategy) -> Iterator[None]:
    """Each variable of `states` put back as it was after the `with` block."""
    saved = [tf.identity(state) for state in states]
    try:
        yield
    finally:
        with strategy.scope():
            for state, value in zip(states, saved):
                state.assign(value)


def random_states(model: keras.Model, research_state: Mapping[str, Any]) -> list:
    """The variables that hold random states: each Keras `SeedGenerator`'s in `model` (Keras lists
    them in `variables` but not in `weights`) and each `tf.random.Generator`'s in `research_state`."""
    weights = {id(weight) for weight in model.weights}
    return ([v for v in model.variables if id(v) not in weights]
            + [value.state for value in research_state.values()
               if isinstance(value, tf.random.Generator)])
