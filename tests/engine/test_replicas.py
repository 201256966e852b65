"""What crosses replicas (engine/replicas.py): on one replica nothing does; on two logical CPUs
(tests/conftest.py) one sum, a NaN-keeping maximum, gathered rows in replica order and the first
replica's share."""

import numpy as np
import tensorflow as tf

from mixloop.engine import replicas
from mixloop.runner import distribution


def test_on_one_replica_every_function_is_the_identity():
    value = {"a": tf.constant([1.0, 2.0])}
    for function in (replicas.sum_over_replicas, replicas.max_over_replicas,
                     replicas.gather_replicas, replicas.on_first_replica):
        assert function(value) is value
    assert replicas.replica_rows(value, 1) is value


def test_maximum_keeps_a_nan_that_xla_would_drop():
    a, b = tf.constant([1.0, float("nan"), 3.0]), tf.constant([2.0, 0.0, float("nan")])
    result = replicas.maximum(a, b).numpy()
    assert result[0] == 2.0 and np.isnan(result[1]) and np.isnan(result[2])


def test_two_replicas_sum_take_the_maximum_gather_and_count_the_first_once():
    strategy = distribution.make_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2

    def per_replica():
        index = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        rows = tf.stack([index, index + 10.0])[:, None]  # Two rows each.
        gathered = replicas.gather_replicas(rows)
        return (replicas.sum_over_replicas(index + 1.0),
                replicas.max_over_replicas(tf.where(index > 0, float("nan"), 5.0)),
                gathered, replicas.replica_rows(gathered, 2),
                replicas.sum_over_replicas(replicas.on_first_replica(tf.constant(7.0))))

    results = strategy.run(tf.function(per_replica))
    first = [replicas.first_replica(strategy, value).numpy() for value in results]
    assert first[0] == 3.0  # 1 + 2, once.
    assert np.isnan(first[1])  # The second replica's NaN wins the maximum.
    assert first[2].ravel().tolist() == [0.0, 10.0, 1.0, 11.0]  # Replica order, static shape.
    assert first[3].ravel().tolist() == [0.0, 10.0]  # The first replica's own rows.
    assert first[4] == 7.0  # Counted once over two replicas.
