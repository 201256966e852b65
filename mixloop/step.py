"""The train step: one optimizer update from `accumulation_steps` micro-batches in explicit mixed precision.

The order of operations, once per call::

    split the batch into k micro-batches
    for each micro-batch:
        cast floating inputs to the compute dtype; forward in the compute dtype
        cast outputs to float32; loss in float32, as (loss_sum, weight) and metrics
        scale the loss per weight; differentiate; unscale the gradients into float32 and weight them;
        add them, the loss, the weight and the weighted metrics to the accumulators
    average the accumulated gradients by the total weight (over micro-batches and replicas)
    check finiteness once; take the global norm; clip the true (unscaled) gradient
    apply the update to the float32 master weights, or skip it and roll back non-trainable state
    adjust the loss scale; report float32/bool metrics
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import keras
import tensorflow as tf

from mixloop.loss import Loss, LossContractError, LossOutput, as_loss
from mixloop.loss_scale import NoLossScale, _LossScale, leaves_finite
from mixloop.policy import Policy

Batch = Any


def default_input_fn(batch: Batch) -> Any:
    """Keras's convention: a tuple `(inputs, targets, ...)` feeds its first element to the model."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def split_micro_batches(batch: Batch, num_micro_batches: int) -> Batch:
    """Reshapes every tensor of `batch` from [B, ...] to [k, B/k, ...] (no copy).

    Raises:
      ValueError: when a static batch dimension is not divisible by `num_micro_batches`.
    """

    def split(tensor):
        size = tensor.shape[0]
        if size is not None and size % num_micro_batches:
            raise ValueError(
                f"batch dimension {size} is not divisible by accumulation_steps={num_micro_batches}"
            )
        micro_size = -1 if size is None else size // num_micro_batches
        return tf.reshape(tensor, tf.concat([[num_micro_batches, micro_size], tf.shape(tensor)[1:]], 0))

    return tf.nest.map_structure(split, batch)


def forward(model: keras.Model, policy: Policy, inputs: Any, *, training: bool) -> Any:
    """The model on `inputs` in `policy`: floating inputs cast to the compute dtype, floating outputs
    to the output dtype (float32), which is what a loss reads. The step, eval, the doctor and the
    benchmark all run the model through here."""
    return policy.cast_to_output(model(policy.cast_to_compute(inputs), training=training))


class TrainStep:
    """A compiled train step: forward, scaled backward, accumulation, finiteness check, update.

    Build it inside the `strategy.scope()` it will run under. Calling it with one batch of the global
    batch size (under a distribution strategy: a distributed batch, each replica its slice) splits
    the batch into `accumulation_steps` micro-batches and performs at most one optimizer
    update. It returns a dict of scalars: `loss` (float32, unscaled, averaged by weight over the
    micro-batches), `loss_scale` (the scale used), `grads_finite` (bool), `grad_norm` (float32, of the
    unscaled averaged gradient before clipping), `applied` (bool), `weight` (the total loss weight),
    `inputs_finite` (bool: no inf or NaN in the batch's floating model inputs) and `train_metrics`
    (a dict: each metric a `mixloop.Loss` from `loss_fn` carries, averaged by weight).

    A non-finite gradient skips the update through a graph conditional: model variables (including
    BatchNorm statistics), optimizer slots and the optimizer's iteration count stay bit-identical,
    so learning-rate schedules and weight decay advance once per applied update.
    """

    def __init__(
        self,
        *,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        loss_fn: Callable[[Any, Batch], LossOutput],
        policy: Policy,
        loss_scale: Optional[_LossScale] = None,
        accumulation_steps: int = 1,
        clip_global_norm: Optional[float] = None,
        jit_compile: bool = False,
        input_fn: Callable[[Batch], Any] = default_input_fn,
    ):
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps!r}")
        if clip_global_norm is not None and not clip_global_norm > 0:
            raise ValueError(f"clip_global_norm must be positive or None, got {clip_global_norm!r}")
        if not model.trainable_variables:
            raise ValueError("the model has no trainable variables yet: build it before the step")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.policy = policy
        self.loss_scale = loss_scale if loss_scale is not None else NoLossScale()
        self.accumulation_steps = int(accumulation_steps)
        self.clip_global_norm = clip_global_norm
        self.input_fn = input_fn
        self.strategy = tf.distribute.get_strategy()
        self._traced_metric_names: Optional[list[str]] = None
        # Per trainable variable: whether its gradient was non-finite in the last skipped update.
        self.nonfinite_gradients = tf.Variable(
            tf.zeros([len(model.trainable_variables)], tf.bool), trainable=False,
            name="nonfinite_gradients", synchronization=tf.VariableSynchronization.ON_WRITE,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        # Slots must exist before tracing: a lazily built optimizer cannot be traced inside a cond.
        optimizer.build(model.trainable_variables)
        if self.strategy.num_replicas_in_sync > 1:
            # The step all-reduces the gradients itself, before checking and clipping them; Keras
            # would otherwise sum the already summed gradients over the replicas a second time.
            optimizer._all_reduce_sum_gradients = list
            if jit_compile:
                raise ValueError("jit_compile=True is not supported with more than one replica yet")
        self._compiled = tf.function(self.step, jit_compile=jit_compile)

    def __call__(self, batch: Batch) -> dict[str, tf.Tensor]:
        """Runs the compiled step on one global batch.

        Raises:
          LossContractError: on the first call, when `loss_fn` returns what `as_loss` cannot read
            (raised here, before tracing, where TensorFlow would wrap it in its staging error).
        """
        if self._traced_metric_names is None:
            self.metric_names(tf.nest.map_structure(
                lambda t: tf.TensorSpec.from_tensor(self._first_replica(t)), batch))
        return self._compiled(batch)

    def step(self, batch: Batch) -> dict[str, tf.Tensor]:
        """The step's body, uncompiled: for callers that trace it inside their own `tf.function`.

        Runs in cross-replica context: the gradient phase runs on every replica, the decision to
        apply is taken once, and the update itself runs on every replica again.
        """
        scale = self.loss_scale.scale
        rollback = [tf.identity(v) for v in self.model.non_trainable_variables]
        grads, metrics = self.strategy.run(self._replica_gradients, args=(batch,))
        metrics = tf.nest.map_structure(self._first_replica, metrics)
        finite_per_variable = metrics.pop("finite_per_variable")
        applied = tf.cond(
            metrics["grads_finite"],
            lambda: self._apply(grads),
            lambda: self._roll_back(rollback, finite_per_variable),
        )
        self.loss_scale.update(metrics["grads_finite"])
        return {**metrics, "loss_scale": scale, "applied": applied}

    def _replica_gradients(self, batch: Batch) -> tuple[list, dict[str, Any]]:
        """One replica's accumulated gradients, summed over replicas once, averaged, checked, clipped."""
        nonfinite_inputs = _count_nonfinite_floats(self.input_fn(batch))
        grads, sums = self._accumulate(batch, self.model.trainable_variables)
        # The only communication of the update: gradients, loss sums and the input check together.
        grads, sums, nonfinite_inputs = _sum_over_replicas((grads, sums, nonfinite_inputs))
        weight = sums["weight"]
        grads = [g / weight for g in grads]
        # Every replica now holds the same sums, so the local verdict is already the global one.
        finite_per_variable = leaves_finite(grads)
        grad_norm = tf.linalg.global_norm(grads)
        if self.clip_global_norm is not None:
            grads, _ = tf.clip_by_global_norm(grads, self.clip_global_norm, use_norm=grad_norm)
        metrics = {"loss": sums["loss"] / weight, "grads_finite": tf.reduce_all(finite_per_variable),
                   "grad_norm": grad_norm, "weight": weight,
                   "inputs_finite": tf.equal(nonfinite_inputs, 0.0),
                   "train_metrics": {name: value / weight for name, value in sums["metrics"].items()},
                   "finite_per_variable": finite_per_variable}
        return grads, metrics

    def _first_replica(self, value: Any) -> tf.Tensor:
        """The value of the first local replica (all replicas hold the same reduced metrics)."""
        return self.strategy.experimental_local_results(value)[0]

    def _accumulate(self, batch: Batch, variables: list) -> tuple[list, dict[str, Any]]:
        """Sums unscaled float32 gradients and the loss's weighted sums over the micro-batches."""
        if self.accumulation_steps == 1:
            return self._micro_step(batch, variables)
        micro_batches = split_micro_batches(batch, self.accumulation_steps)

        def micro_batch(i):
            return tf.nest.map_structure(lambda t: t[i], micro_batches)

        def body(i, grads, sums):
            micro_grads, micro_sums = self._micro_step(micro_batch(i), variables)
            grads = [a + g for a, g in zip(grads, micro_grads)]
            return i + 1, grads, tf.nest.map_structure(tf.add, sums, micro_sums)

        zeros = [tf.zeros(v.shape, tf.float32) for v in variables]
        names = self.metric_names(tf.nest.map_structure(tf.TensorSpec.from_tensor, micro_batch(0)))
        zero_sums = _weighted_sums(Loss(0.0, 0.0, {name: 0.0 for name in names}))
        _, grads, sums = tf.while_loop(
            lambda i, *_: i < self.accumulation_steps, body, (tf.constant(0), zeros, zero_sums))
        return grads, sums

    def metric_names(self, batch_spec: Any) -> list[str]:
        """The names of the metrics `loss_fn` returns beside the loss, for batches of `batch_spec`
        (a structure of `tf.TensorSpec`; the batch dimension is ignored).

        Loops that carry the metrics must know them before they trace their body, so the forward
        pass and the loss are traced once more on their own (never run) to read them.
        """
        if self._traced_metric_names is None:
            names, errors = [], []

            def forward_and_loss(batch):
                outputs = forward(self.model, self.policy, self.input_fn(batch), training=True)
                try:
                    names.extend(as_loss(self.loss_fn(outputs, batch)).metrics)
                except LossContractError as error:  # Autograph would wrap it in many lines.
                    errors.append(error)

            spec = tf.nest.map_structure(
                lambda s: tf.TensorSpec([None, *s.shape[1:]], s.dtype), batch_spec)
            tf.function(forward_and_loss).get_concrete_function(spec)
            if errors:
                raise errors[0]
            self._traced_metric_names = names
        return self._traced_metric_names

    def _micro_step(self, micro_batch: Batch, variables: list) -> tuple[list, dict[str, Any]]:
        """Forward in the compute dtype, loss in float32, scaled backward, unscaled float32 gradients.

        The scale multiplies the micro-batch's *mean* loss (sum / weight), so a token-weighted sum
        over thousands of tokens reaches the 16-bit backward with a mean's magnitudes; the weight goes
        back onto the gradients in float32, which keeps the accumulated update exactly token-weighted.
        """
        with tf.GradientTape() as tape:
            outputs = forward(self.model, self.policy, self.input_fn(micro_batch), training=True)
            loss = as_loss(self.loss_fn(outputs, micro_batch))
            scaled_loss = self.loss_scale.scale_loss(per_weight(loss.value, tf.stop_gradient(loss.weight)))
        scaled_grads = tape.gradient(scaled_loss, variables)
        # Which variables the loss does not reach is known while tracing. They get zero gradients
        # here, which change neither the norm nor the finiteness check, and no update (see _apply).
        self.unused_variables = [grad is None for grad in scaled_grads]
        grads = self.loss_scale.unscale(
            [tf.zeros(v.shape, tf.float32) if g is None else g for g, v in zip(scaled_grads, variables)])
        return [_times_weight(g, loss.weight) for g in grads], _weighted_sums(loss)

    def _apply(self, grads: Any) -> tf.Tensor:
        """Applies the (per-replica) gradients to the float32 master weights on every replica."""
        # Variables the loss does not reach are left alone, as `model.fit` leaves them: no update,
        # no weight decay, no moment decay.
        used = [not unused for unused in self.unused_variables]
        self.strategy.run(self.optimizer.apply, args=(
            _select(grads, used), _select(self.model.trainable_variables, used)))
        return tf.constant(True)

    def _roll_back(self, saved_values: list, finite_per_variable: tf.Tensor) -> tf.Tensor:
        """Restores non-trainable model state (e.g. BatchNorm statistics) updated by the forward pass,
        and records which gradients were non-finite."""
        for variable, value in zip(self.model.non_trainable_variables, saved_values):
            variable.assign(value)
        self.nonfinite_gradients.assign(tf.logical_not(finite_per_variable))
        return tf.constant(False)

    def nonfinite_variable_paths(self) -> list[str]:
        """Paths of the variables whose gradients were non-finite in the last skipped update."""
        return masked_paths(self.model.trainable_variables, self.nonfinite_gradients)


def masked_paths(variables: list, mask: tf.Variable) -> list[str]:
    """Paths of the `variables` whose entry in the boolean `mask` is True."""
    return [v.path for v, marked in zip(variables, mask.numpy()) if marked]


def _weighted_sums(loss: Loss) -> dict[str, Any]:
    """A micro-batch's loss, weight and metrics (times the weight): sums to add up over
    micro-batches and replicas, and to divide by the total weight at the end."""
    return {"loss": loss.value, "weight": loss.weight,
            "metrics": {name: value * loss.weight for name, value in loss.metrics.items()}}


def per_weight(value: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
    """`value / weight` (0 for a weight of 0); `value` itself for the weight 1 of a plain mean loss.

    The loss scale multiplies a micro-batch's loss per weight (its mean), whatever the loss's form.
    """
    return value if tf.get_static_value(weight) == 1.0 else tf.math.divide_no_nan(value, weight)


def _times_weight(value: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
    """`value * weight`; `value` itself for the weight 1 of a plain mean loss."""
    return value if tf.get_static_value(weight) == 1.0 else value * weight


def _select(values: list, keep: list[bool]) -> list:
    """The `values` whose entry in `keep` is True."""
    return [value for value, kept in zip(values, keep) if kept]


def _count_nonfinite_floats(tree: Any) -> tf.Tensor:
    """How many floating tensors of `tree` hold an inf or NaN, as a float32 scalar."""
    floats = [t for t in tf.nest.flatten(tree) if tf.as_dtype(t.dtype).is_floating]
    if not floats:
        return tf.constant(0.0)
    return tf.reduce_sum(tf.cast(tf.logical_not(leaves_finite(floats)), tf.float32))


def _sum_over_replicas(value: Any) -> Any:
    """Sums `value` over the replicas of a `tf.distribute` strategy; identity on one replica."""
    replica_context = tf.distribute.get_replica_context()
    if replica_context is None or replica_context.num_replicas_in_sync == 1:
        return value
    return replica_context.all_reduce(tf.distribute.ReduceOp.SUM, value)
