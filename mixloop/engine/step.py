"""The train step: one update per objective from one global batch, in explicit mixed precision.

The algorithm, once per call (a model with one loss has one objective)::

    on every replica, from its slice of the batch, the gradient source's gradients:
        micro-batches (engine/micro_batches.py), or GradCache's two passes (engine/batch_loss.py),
        each micro-step (engine/micro_step.py): cast inputs to the compute dtype; forward once;
        losses in float32; per objective due: its loss per weight times its own scale,
        differentiated by its own variables, unscaled into float32, weighted; added up in the
        accumulators (engine/accumulators.py)
    one all-reduce of every objective's gradients and sums (engine/replicas.py)
    per objective: average by its total weight; check finiteness; take the global norm; clip
    per objective due: apply the update to its master weights and run its post-update hooks
        (`after_update`, then the EMA), or skip it and roll its layer's non-trainable state back;
        adjust its loss scale
    count the step; report

Each feature is a seam of its own: the gradient source, the accumulators, the `Gradients` that carry
float8's overwritten new values apart from derivatives (engine/gradients.py), the overflow retries
around the compiled step (engine/retries.py), the post-update hooks. docs/step.md says why each
choice was made.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import keras
import tensorflow as tf

from mixloop.engine import keras_adapter, kernels, replicas, tracing
from mixloop.engine.accumulators import Accumulators
from mixloop.engine.batch_loss import TwoPasses
from mixloop.engine.ema import ExponentialMovingAverage
from mixloop.engine.gradients import Gradients, Partition, averaged, clipped, finite_per_variable
from mixloop.engine.loss_scale import LossScale, NoLossScale, leaves_finite
from mixloop.engine.micro_batches import BodyCompiler, MicroBatches
from mixloop.engine.micro_step import Batch, MicroStep, default_input_fn, when
from mixloop.engine.objective import (SINGLE, Objective, check_objectives, due_at, post_update_hook,
                                      with_loss_scales)
from mixloop.engine.policy import Policy, floating_leaves
from mixloop.engine.retries import OverflowRetries, without_retries

GradientSource = Callable[[Batch, tf.Tensor], tuple[dict[str, Gradients], dict[str, Any]]]


class TrainStep:
    """A compiled train step: forward, scaled backward, accumulation, finiteness check, update.

    Build it inside the `strategy.scope()` it will run under, with either one `model`, `optimizer`
    and `loss_scale` (one objective, named `model`) or several `objectives` (see `Objective`), whose
    losses `loss_fn` returns as a dict keyed by objective name from one forward pass of `model`.
    Calling it with one global batch (under a distribution strategy: a distributed batch, each
    replica its slice) splits each replica's slice into `accumulation_steps` micro-batches and
    makes at most one update per objective, with one all-reduce in total. Each call adds one to
    `global_step` (an int64 variable: the caller's, or one of the step's own), whose value after
    the update decides which objectives are due (`Objective.every_steps`).

    It returns `{"objectives": {name: report}, "inputs_finite": bool}` (`inputs_finite`: no inf or
    NaN in the batch's floating model inputs). Each objective's report is a dict of scalars: `loss`
    (float32, unscaled, averaged by weight over the micro-batches), `loss_scale` (the scale used),
    `grads_finite` (bool), `grad_norm` (float32, of the unscaled averaged gradient before clipping),
    `ran` (bool: the objective was due), `applied` (bool), `weight` (the total loss weight),
    `metrics` (the train metrics its `mixloop.Loss` carries, averaged by weight) and `retries`
    (int32: attempts redone before the last, see `overflow_retries`).

    A non-finite gradient skips that objective's update: its variables, its layer's non-trainable
    state, its optimizer's slots and iteration count stay bit-identical, and only its loss scale
    backs off. After each applied update its `after_update` runs, then, with `ema_decay` > 0, the
    moving average of its weights (`self.ema[name]`) advances. `accumulation_dtype="bfloat16"`
    accumulates micro-batches in bfloat16, rounded stochastically (engine/accumulators.py).
    `batch_loss=True` hands `loss_fn` the outputs of the whole global batch and takes that loss's
    exact gradient by GradCache's two passes (engine/batch_loss.py); otherwise `loss_fn` sees one
    micro-batch of one replica. `overflow_retries` > 0 takes a step whose updates all overflowed
    again on its batch at the backed-off scale, up to that many times (engine/retries.py).

    Raises:
      ValueError: for `accumulation_steps` below 1, a `clip_global_norm` that is not positive, both
        or neither of `optimizer` and `objectives`, or `jit_compile` with several replicas.
      UserError: for objectives `check_objectives` refuses.
    """

    def __init__(
        self,
        *,
        model: keras.Model,
        loss_fn: Callable[[Any, Batch], Any],
        policy: Policy,
        optimizer: Optional[keras.optimizers.Optimizer] = None,
        loss_scale: Optional[LossScale] = None,
        objectives: Optional[Mapping[str, Objective]] = None,
        accumulation_steps: int = 1,
        clip_global_norm: Optional[float] = None,
        jit_compile: bool = False,
        input_fn: Callable[[Batch], Any] = default_input_fn,
        ema_decay: float = 0.0,
        global_step: Optional[tf.Variable] = None,
        batch_loss: bool = False,
        overflow_retries: int = 0,
        accumulation_dtype: str = "float32",
    ):
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps!r}")
        if clip_global_norm is not None and not clip_global_norm > 0:
            raise ValueError(f"clip_global_norm must be positive or None, got {clip_global_norm!r}")
        if (objectives is None) == (optimizer is None) or (objectives and loss_scale is not None):
            raise ValueError("pass either optimizer (and loss_scale) or objectives, not both")
        if objectives is None:
            objectives = {SINGLE: Objective(model, optimizer, loss_scale)}
        check_objectives(objectives)
        self.objectives = with_loss_scales(dict(objectives), NoLossScale)
        self.model, self.policy = model, policy
        self.loss_fn, self.input_fn = tracing.hook(loss_fn), tracing.hook(input_fn)
        self.accumulation_steps = int(accumulation_steps)
        self.accumulation_dtype = tf.as_dtype(accumulation_dtype)
        self.clip_global_norm = clip_global_norm
        self.strategy = tf.distribute.get_strategy()
        # The two passes only where the loss would otherwise see part of the batch.
        self.two_pass = batch_loss and (self.accumulation_steps > 1
                                        or self.strategy.num_replicas_in_sync > 1)
        # Steps taken, skipped ones included; checkpointed by its owner, so a resumed run finds
        # each objective's cadence where it left it.
        self.global_step = global_step if global_step is not None else tf.Variable(
            0, dtype=tf.int64, trainable=False, name="global_step")
        self.partitions = {name: Partition(o.variables) for name, o in self.objectives.items()}
        self.micro_step = MicroStep(model, policy, self.loss_fn, self.input_fn, self.objectives,
                                    self.partitions)
        # Per objective and variable: non-finite in that objective's last overflowed attempt.
        self.nonfinite_gradients = {name: tf.Variable(
            tf.zeros([len(objective.variables)], tf.bool), trainable=False,
            name=f"nonfinite_gradients_{name}", synchronization=tf.VariableSynchronization.ON_WRITE,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        ) for name, objective in self.objectives.items()}
        # Per objective, with ema_decay > 0: the moving average of its weights over applied updates.
        self.ema = {name: ExponentialMovingAverage(
            self.partitions[name].split(objective.variables).derivatives, ema_decay, name=f"ema_{name}")
            for name, objective in self.objectives.items()} if ema_decay else {}
        # Per objective, what runs after each applied update, in order.
        self.post_update = {name: [hook for hook in (
            post_update_hook(name, objective), self.ema[name].update if self.ema else None)
            if hook is not None] for name, objective in self.objectives.items()}
        for objective in self.objectives.values():
            # Slots must exist before tracing: a lazily built optimizer cannot be traced inside a cond.
            objective.optimizer.build(objective.variables)
        if self.strategy.num_replicas_in_sync > 1:
            for objective in self.objectives.values():
                keras_adapter.leave_gradients_summed(objective.optimizer)
            if jit_compile:
                raise ValueError("jit_compile=True is not supported with more than one replica yet")
        self.jit_compile = jit_compile
        self.retries = OverflowRetries(self.objectives, overflow_retries, model, self.global_step)
        self._metric_names: Optional[dict[str, list[str]]] = None
        self.recompile()

    def __call__(self, batch: Batch) -> dict[str, Any]:
        """Runs the compiled step (with its retries) on one global batch.

        Raises:
          LossContractError: on the first call, when `loss_fn` returns what `as_losses` cannot read
            (raised here, from a trace of the loss alone, before the step's own trace).
        """
        if self._metric_names is None:
            self.metric_names(tf.nest.map_structure(self._global_spec, batch))
        if not self.retries.max_retries:
            return without_retries(self.compiled(batch))
        return self.retries(self.compiled, batch, self.jit_compile)

    @kernels.used
    def step(self, batch: Batch) -> dict[str, Any]:
        """The step's body, uncompiled, one attempt (no `retries` in its reports): for callers that
        trace it inside their own `tf.function`. In cross-replica context: the gradients on every
        replica, the decision to apply once per objective, the update on every replica again."""
        step_number = tf.convert_to_tensor(self.global_step) + 1  # The update this call makes.
        due = due_at(self.objectives, step_number)
        scales = {name: objective.loss_scale.scale for name, objective in self.objectives.items()}
        # What a skipped update puts back: the non-trainable state its forward pass moved.
        saved = {name: [tf.identity(v) for v in objective.state]
                 for name, objective in self.objectives.items()}
        grads, reports = self.strategy.run(self._replica_gradients, args=(batch, step_number))
        reports = tf.nest.map_structure(lambda value: replicas.first_replica(self.strategy, value),
                                        reports)
        objective_reports = {}
        for name, objective in self.objectives.items():
            report = dict(reports["objectives"][name])
            finite = report.pop("finite_per_variable")

            def update() -> tf.Tensor:
                applied = tf.cond(report["grads_finite"],
                                  lambda: self._apply(name, grads[name]),
                                  lambda: self._roll_back(name, saved[name], finite))
                objective.loss_scale.update(report["grads_finite"])
                return applied

            objective_reports[name] = {
                **report, "loss_scale": scales[name],
                "ran": tf.constant(True) if due[name] is None else due[name],
                "applied": when(due[name], update, lambda: tf.constant(False))}
        self.global_step.assign_add(1)
        return {"objectives": objective_reports, "inputs_finite": reports["inputs_finite"]}

    def _replica_gradients(self, batch: Batch, step_number: tf.Tensor) -> tuple[dict, dict[str, Any]]:
        """One replica's gradients from the gradient source, summed over the replicas once, then
        per objective averaged, checked and clipped."""
        nonfinite_inputs = _count_nonfinite_floats(self.input_fn(batch))
        grads, sums = self.gradient_source(batch, step_number)
        # The only communication of the update: every objective's derivatives and sums and the
        # input check in one all-reduce; the overwritten variables' new values by maximum.
        derivatives, sums, nonfinite_inputs = replicas.sum_over_replicas(
            ({name: g.derivatives for name, g in grads.items()}, sums, nonfinite_inputs))
        new_values = replicas.max_over_replicas({name: g.new_values for name, g in grads.items()})
        # Every replica now holds the same sums, so the local verdicts are already the global ones.
        checked = {name: self._checked(name, Gradients(derivatives[name], new_values[name]), sums[name])
                   for name in self.objectives}
        return ({name: grads for name, (grads, _) in checked.items()},
                {"objectives": {name: report for name, (_, report) in checked.items()},
                 "inputs_finite": tf.equal(nonfinite_inputs, 0.0)})

    def _checked(self, name: str, grads: Gradients, sums: dict[str, Any]) -> tuple[Gradients, dict]:
        """Objective `name`'s summed gradients averaged by its total weight, checked for finiteness
        (after the division: a total weight of 0 makes NaN), and clipped by their global norm."""
        weight = sums["weight"]
        grads = averaged(grads, weight)
        finite = finite_per_variable(self.partitions[name], grads)
        grad_norm = tf.linalg.global_norm(grads.derivatives)
        return clipped(grads, self.clip_global_norm, grad_norm), {
            "loss": sums["loss"] / weight, "grads_finite": tf.reduce_all(finite),
            "grad_norm": grad_norm, "weight": weight,
            "metrics": {metric: value / weight for metric, value in sums["metrics"].items()},
            "finite_per_variable": finite}

    def _apply(self, name: str, grads: Gradients) -> tf.Tensor:
        """Applies objective `name`'s (per-replica) gradients on every replica, then its
        post-update hooks, in cross-replica context: outside any layer call, they read the master
        weights as stored and each assign writes every replica alike."""
        partition, optimizer = self.partitions[name], self.objectives[name].optimizer
        # Variables the loss does not reach are left alone, as `model.fit` leaves them: no update,
        # no weight decay, no moment decay.
        self.strategy.run(optimizer.apply, args=(partition.reached(partition.merged(grads)),
                                                 partition.reached(partition.variables)))
        for hook in self.post_update[name]:
            hook()
        return tf.constant(True)

    def _roll_back(self, name: str, saved_state: list, finite_per_variable: tf.Tensor) -> tf.Tensor:
        """Restores one objective's non-trainable state (e.g. BatchNorm statistics) updated by the
        forward pass, and records which of its gradients were non-finite."""
        for variable, value in zip(self.objectives[name].state, saved_state):
            variable.assign(value)
        self.nonfinite_gradients[name].assign(tf.logical_not(finite_per_variable))
        return tf.constant(False)

    # ----- Compiling, per compile mode. -----

    def recompile(self) -> None:
        """Forgets the traced step in both compile modes, so the next call traces it anew: after a
        layer's dtype policy changed (the automatic placement moving a layer to float32), as
        tracing reads it."""
        self._compiled_by_mode: dict[bool, tuple[Callable, GradientSource]] = {}

    @property
    def compiled(self) -> Callable:
        """The step compiled in the current mode (`jit_compile`): one attempt on a batch (and, with
        retries, an attempt number); each mode's is traced once and kept, so switching modes back
        and forth (the compile-mode probe) traces nothing again."""
        return self._in_current_mode()[0]

    @property
    def gradient_source(self) -> GradientSource:
        """The gradient source the current mode's step calls on each replica (its loop bodies
        compiled by XLA on their own under XLA with several micro-batches)."""
        return self._in_current_mode()[1]

    def _in_current_mode(self) -> tuple[Callable, GradientSource]:
        if self.jit_compile not in self._compiled_by_mode:
            self._compiled_by_mode[self.jit_compile] = self._compile(self.jit_compile)
        return self._compiled_by_mode[self.jit_compile]

    def _compile(self, jit_compile: bool) -> tuple[Callable, GradientSource]:
        """(the step, its gradient source) with or without XLA. With XLA and several micro-batches,
        the micro-batch loops stay in the graph and XLA compiles their bodies on their own: XLA on
        a CPU runs a convolution's backward pass many times slower inside a compiled while loop
        than outside one (docs/step.md)."""
        loop_in_graph = jit_compile and self.accumulation_steps > 1
        body_compiler: BodyCompiler = ((lambda body: tracing.function(body, jit_compile=True))
                                       if loop_in_graph else (lambda body: body))
        step = self.retries.attempt(self.step) if self.retries.max_retries else self.step
        return (tracing.function(step, jit_compile=jit_compile and not loop_in_graph),
                self._gradient_source(body_compiler))

    def _gradient_source(self, compile_body: BodyCompiler) -> GradientSource:
        accumulators = Accumulators(self.partitions, self.accumulation_dtype)
        num_replicas = self.strategy.num_replicas_in_sync
        if self.two_pass:
            return TwoPasses(self.model, self.policy, self.loss_fn, self.input_fn, self.objectives,
                             self.partitions, self.accumulation_steps, accumulators, num_replicas,
                             compile_body)
        return MicroBatches(self.micro_step, self.accumulation_steps, accumulators,
                            self._loss_metric_names, num_replicas, compile_body)

    # ----- What the loss sees, and reports. -----

    def metric_names(self, batch_spec: Any) -> dict[str, list[str]]:
        """Per objective, the names of the metrics `loss_fn` returns beside its loss, for global
        batches of `batch_spec` (a structure of `tf.TensorSpec`): from one trace (never run) of the
        forward pass and the loss on what the loss sees of them (`loss_batch_spec`), then kept.
        Loops that carry the metrics must know them before they trace their body.

        Raises:
          LossContractError: when `loss_fn` returns what `as_losses` cannot read.
          UserError: when `loss_fn` fails on a batch whose batch dimension is unknown, naming the
            leaf of the data without a static one.
        """
        return self._loss_metric_names(self.loss_batch_spec(batch_spec))

    def loss_batch_spec(self, batch_spec: Any) -> Any:
        """What `loss_fn` sees of global batches of `batch_spec`: the whole batch with the two
        passes (`batch_loss`), else one micro-batch of one replica, whose batch dimension is the
        global one divided by replicas x `accumulation_steps` (unknown where the global one is)."""
        return self.gradient_source.loss_batch_spec(batch_spec)

    def _loss_metric_names(self, loss_spec: Any) -> dict[str, list[str]]:
        if self._metric_names is None:
            self._metric_names = self.micro_step.metric_names(loss_spec)
        return self._metric_names

    def _global_spec(self, value: Any) -> tf.TensorSpec:
        """The spec of the global batch's leaf a distributed `value` holds one replica's slice of."""
        local = replicas.first_replica(self.strategy, value)  # A tensor, or a NumPy array.
        shape = tf.TensorShape(local.shape)
        if shape.rank and shape[0] is not None:
            shape = [shape[0] * self.strategy.num_replicas_in_sync, *shape[1:]]
        return tf.TensorSpec(shape, tf.as_dtype(local.dtype))

    def nonfinite_variable_paths(self, name: str = SINGLE) -> list[str]:
        """Paths of the variables whose gradients were non-finite in objective `name`'s last
        overflowed attempt (a skipped update, or an attempt a retry then cured)."""
        return masked_paths(self.objectives[name].variables, self.nonfinite_gradients[name])


def masked_paths(variables: list, mask: tf.Variable) -> list[str]:
    """Paths of the `variables` whose entry in the boolean `mask` is True."""
    return [v.path for v, marked in zip(variables, mask.numpy()) if marked]


def _count_nonfinite_floats(tree: Any) -> tf.Tensor:
    """How many floating tensors of `tree` hold an inf or NaN, as a float32 scalar."""
    floats = floating_leaves(tree)
    if not floats:
        return tf.constant(0.0)
    return tf.reduce_sum(tf.cast(tf.logical_not(leaves_finite(floats)), tf.float32))
