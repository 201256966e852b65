"""The train step: one update per objective from `accumulation_steps` micro-batches in explicit mixed precision.

The order of operations, once per call (a model with one loss has one objective)::

    split the batch into k micro-batches
    for each micro-batch:
        cast floating inputs to the compute dtype; forward in the compute dtype, once
        cast outputs to float32; each objective's loss in float32, as (loss_sum, weight) and metrics
        per objective due at this step (`every_steps`; the others get zeros, no backward):
            scale its loss per weight by its own scale; differentiate with respect to its own
            variables; unscale the gradients into float32 and weight them
        add them, the losses, the weights and the weighted metrics to the accumulators
    sum everything over the replicas in one all-reduce
    per objective due at this step:
        average its gradients by its total weight; check finiteness once; take the global norm;
            clip the true (unscaled) gradient
        apply the update to its float32 master weights, run its `after_update` (a target network,
            a projection) and advance its EMA; or skip it and roll back its layer's non-trainable state
        adjust its loss scale
    count the step; report float32/bool metrics
    if every update due was skipped for an overflow the backed-off scales may cure
    (`overflow_retries`): take the same step again, on the same batch

A variable Keras overwrites with its "gradient" (`overwrite_with_gradient`: float8's scales and
amax histories, whose "gradient" is their new value) is carried as what it is: never unscaled or
weighted, combined across micro-batches and replicas by maximum (as Keras's accumulation does),
left out of the norm, the clipping and the EMA, checked for finiteness like any gradient and
written by the optimizer with the update (so a skip leaves it).

With `batch_loss=True`, for losses that couple a batch's examples (contrastive ones), the loop
over micro-batches becomes GradCache's two passes (engine/batch_loss.py): the loss is computed
once, on the outputs of the whole global batch, and each micro-batch's backward starts from its
share of that loss's output gradients; the rest is the same.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import keras
import tensorflow as tf

from mixloop.engine import batch_loss as global_batch
from mixloop.engine import gelu, keras_adapter, low_bit, matmul_gradient, tracing
from mixloop.engine.ema import ExponentialMovingAverage
from mixloop.engine.loss import Loss, LossContractError, as_losses, per_weight
from mixloop.engine.loss_scale import DynamicLossScale, NoLossScale, LossScale, leaves_finite
from mixloop.engine.objective import SINGLE, Objective, check_objectives, with_loss_scales
from mixloop.engine.policy import Policy
from mixloop.errors import UserError, described

# Keras's broadcast matrix products (attention projections) differentiated as one 2-D product each,
# and its GELU of 16-bit inputs computed in float32, rounded once.
matmul_gradient.install()
gelu.install()

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


def micro_batch_at(micro_batches: Batch, index: tf.Tensor) -> Batch:
    """Micro-batch `index` of what `split_micro_batches` made."""
    return tf.nest.map_structure(lambda t: t[index], micro_batches)


def _batch_divided(spec: tf.TensorSpec, num_slices: int) -> tf.TensorSpec:
    """`spec` with its batch (first) dimension divided by `num_slices`: unknown where it is
    unknown or does not divide; a scalar's as it is."""
    if not spec.shape.rank:
        return spec
    size = spec.shape[0]
    sliced = size // num_slices if size is not None and size % num_slices == 0 else None
    return tf.TensorSpec([sliced, *spec.shape[1:]], spec.dtype)


def _unknown_batch_leaf(spec: Any) -> Optional[str]:
    """'element [1] of shape (None, 3)': the first leaf of `spec` whose batch dimension is
    unknown, or None when every leaf knows it."""
    for path, leaf in keras.tree.flatten_with_path(spec):
        if leaf.shape.rank and leaf.shape[0] is None:
            place = "".join(f"[{key!r}]" for key in path)
            return f"element {place} of shape {leaf.shape}" if place else f"shape {leaf.shape}"
    return None


def forward(model: keras.Model, policy: Policy, inputs: Any, *,
            training: Optional[bool] = None) -> Any:
    """The model on `inputs` in `policy`: floating inputs cast to the compute dtype, floating outputs
    to the output dtype (float32), which is what a loss reads. The step, eval, the doctor and the
    benchmark all run the model through here.

    Raises:
      TypeError: when `policy` is not a `Policy` (a string such as "mixed_float16"), `training` is
        not given as True or False, or `model` is not callable: one line, even from a traced loss.
    """
    _check_forward_arguments(model, policy, training)
    return policy.cast_to_output(model(policy.cast_to_compute(inputs), training=training))


def _check_forward_arguments(model: Any, policy: Any, training: Any) -> None:
    """Refuses what `forward` cannot run, in a line that names the argument and what to pass."""
    if not isinstance(policy, Policy):
        raise TypeError(f"mixloop.forward: policy={policy!r} is a {type(policy).__name__}, not a "
                        "mixloop.Policy; pass self.policy (the run's), or "
                        "mixloop.Policy.from_string(...)")
    if not isinstance(training, bool):
        raise TypeError(f"mixloop.forward: training={training!r}; pass training=True (dropout and "
                        "BatchNorm as in training, inside compute_loss) or training=False")
    if not callable(model):
        raise TypeError(f"mixloop.forward: model is a {type(model).__name__}, not a Keras model "
                        "or layer; pass the model to run (self.model, or a layer of it)")


class TrainStep:
    """A compiled train step: forward, scaled backward, accumulation, finiteness check, update.

    Build it inside the `strategy.scope()` it will run under, with either one `model`, `optimizer`
    and `loss_scale` (one objective, named `model`) or several `objectives` (see `Objective`), whose
    losses `loss_fn` returns as a dict keyed by objective name from one forward pass of `model`.
    Calling it with one batch of the global batch size (under a distribution strategy: a
    distributed batch, each replica its slice) splits the batch into `accumulation_steps`
    micro-batches and performs at most one update per objective, with one all-reduce in total.

    It returns `{"objectives": {name: report}, "inputs_finite": bool}` (`inputs_finite`: no inf or
    NaN in the batch's floating model inputs). Each objective's report is a dict of scalars: `loss`
    (float32, unscaled, averaged by weight over the micro-batches), `loss_scale` (the scale used),
    `grads_finite` (bool), `grad_norm` (float32, of the unscaled averaged gradient before clipping),
    `ran` (bool: the objective was due at this step, see `Objective.every_steps`), `applied` (bool),
    `weight` (the total loss weight) and `metrics` (the train metrics its `mixloop.Loss` carries,
    averaged by weight).

    Each call adds one to `global_step` (an int64 variable: the Trainer's, or one of the step's
    own), whose value after the update decides which objectives are due.

    With `accumulation_dtype="bfloat16"` the micro-batch accumulators hold bfloat16 (half the
    bytes), each sum computed in float32 and rounded stochastically with draws keyed by the step
    and the micro-batch, so that a resumed run rounds as the straight one did; the accumulated
    gradient reaches the all-reduce and the update in float32.

    After each applied update of an objective, its `after_update` runs (a momentum target network,
    weight clipping: see `Objective`), then, with `ema_decay` > 0, an `ExponentialMovingAverage`
    of its weights (`self.ema[name]`) advances.

    With `batch_loss=True`, `loss_fn` sees the outputs of the whole global batch (every micro-batch
    and replica; each output's first dimension must be the batch) and the whole batch, and the
    gradient is that loss's, exactly, with the memory of `accumulation_steps` micro-batches:
    GradCache's two passes (engine/batch_loss.py), one more forward pass per micro-batch. Random
    draws from Keras `SeedGenerator`s and the model's statistics (BatchNorm) are put back between
    the passes, so the second pass draws the noise the first drew and the statistics move once per
    micro-batch; a stateful `tf.random` op outside a `SeedGenerator` would draw anew. Without it,
    `loss_fn` sees one micro-batch of one replica at a time.

    A non-finite gradient skips that objective's update through a graph conditional: its variables,
    its layer's non-trainable state (e.g. BatchNorm statistics), its optimizer's slots and
    iteration count stay bit-identical, so learning-rate schedules and weight decay advance once per
    applied update, and only its loss scale backs off.

    With `overflow_retries` > 0, a step whose due updates were all skipped for an overflow that a
    lower scale may cure (finite inputs and loss, and every such scale backed off) is taken again on
    the same batch, as the same step (the global step and the cadences do not move), up to that
    many times: the batch is not lost to the scale's search. Each retry starts from the model's
    non-trainable state as the first attempt found it (BatchNorm statistics, the Keras seed
    states: the same dropout and noise; a `tf.random.Generator` outside the model draws anew).
    A step no retry cures is skipped, reports its first attempt's scale and leaves the scale one
    back-off below it, as without retries (an overflow no scale cures must not drive the scale
    down faster). A step where some objective applied its update is not retried (the retry would
    apply it twice). Each objective's report also holds `retries`, the attempts redone before the
    last (int32; 0 without retries). The retry loop runs in the caller's graph around the
    compiled step, which stays one trace: XLA does not compile the loop.
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
        self.model = model
        self.loss_fn = tracing.hook(loss_fn)
        self.policy = policy
        self.accumulation_steps = int(accumulation_steps)
        self.accumulation_dtype = tf.as_dtype(accumulation_dtype)
        self.clip_global_norm = clip_global_norm
        self.input_fn = tracing.hook(input_fn)
        self.strategy = tf.distribute.get_strategy()
        # The two passes only where the loss would otherwise see part of the batch.
        self.two_pass = batch_loss and (self.accumulation_steps > 1
                                        or self.strategy.num_replicas_in_sync > 1)
        # Steps taken, skipped ones included; checkpointed by its owner, so a resumed run finds
        # each objective's cadence where it left it.
        self.global_step = global_step if global_step is not None else tf.Variable(
            0, dtype=tf.int64, trainable=False, name="global_step")
        self._traced_metric_names: Optional[dict[str, list[str]]] = None
        # Per objective and trainable variable: its "gradient" is its new value (float8's scales and
        # amax histories; see Objective.overwritten), combined by maximum, never scaled or clipped.
        self._overwritten = {name: o.overwritten for name, o in self.objectives.items()}
        # Per objective and trainable variable: non-finite in that objective's last overflowed
        # attempt (a skipped update, or an attempt a retry then cured).
        self.nonfinite_gradients = {name: tf.Variable(
            tf.zeros([len(objective.variables)], tf.bool), trainable=False,
            name=f"nonfinite_gradients_{name}", synchronization=tf.VariableSynchronization.ON_WRITE,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        ) for name, objective in self.objectives.items()}
        # Per objective and trainable variable, known while tracing: the loss does not reach it.
        self.unused_variables: dict[str, list[bool]] = {}
        # Per objective, with ema_decay > 0: the moving average of its weights over applied updates.
        self.ema = {name: ExponentialMovingAverage(
            _select(objective.variables, _negated(self._overwritten[name])), ema_decay, name=f"ema_{name}")
            for name, objective in self.objectives.items()} if ema_decay else {}
        for objective in self.objectives.values():
            # Slots must exist before tracing: a lazily built optimizer cannot be traced inside a cond.
            objective.optimizer.build(objective.variables)
        if self.strategy.num_replicas_in_sync > 1:
            for objective in self.objectives.values():
                keras_adapter.leave_gradients_summed(objective.optimizer)
            if jit_compile:
                raise ValueError("jit_compile=True is not supported with more than one replica yet")
        self.jit_compile = jit_compile
        # Only a dynamic scale backs off, so only under one can a retry end otherwise.
        self.overflow_retries = int(overflow_retries) if any(
            isinstance(o.loss_scale, DynamicLossScale) for o in self.objectives.values()) else 0
        # What a retry must put back beyond the skipped objectives' own rollbacks: the model's
        # non-trainable state outside every objective updated at each step.
        rolled_back = {id(v) for o in self.objectives.values() if o.every_steps == 1 for v in o.state}
        self._retry_state = [v for v in model.non_trainable_variables if id(v) not in rolled_back]
        self.recompile()

    def recompile(self) -> None:
        """Forgets the traced step in both compile modes, so the next call traces it anew: after a
        layer's dtype policy changed (the automatic placement moving a layer to float32), as
        tracing reads it."""
        self._compiled_by_mode: dict[bool, tuple[Callable, dict[str, Callable]]] = {}

    @property
    def _compiled(self) -> Callable:
        """The step compiled in the current mode (`jit_compile`); each mode's is traced once and kept,
        so switching modes back and forth (`compile_mode`'s probe) traces nothing again."""
        if self.jit_compile not in self._compiled_by_mode:
            self._compiled_by_mode[self.jit_compile] = self._compile(self.jit_compile)
        return self._compiled_by_mode[self.jit_compile][0]

    def _body(self, name: str) -> Callable:
        """The micro-batch loop body `name` ("add_micro_batch", or the two passes' "forward" and
        "add_backward") as the current mode compiles it."""
        self._compiled  # Made together.
        return self._compiled_by_mode[self.jit_compile][1][name]

    def _compile(self, jit_compile: bool) -> tuple[Callable, dict[str, Callable]]:
        """(the step, the bodies of its micro-batch loops) as `tf.function`s, with or without XLA.

        With XLA and several micro-batches, the micro-batch loops stay in the graph and XLA
        compiles their bodies (the forward, backward and accumulation of one micro-batch) on their
        own: XLA on a CPU runs a convolution's backward pass 20-35x slower inside a compiled while
        loop than outside one (openxla's CPU backend, as jax-ml/jax#12868 reports for the forward),
        which made a small GAN's step with 2 micro-batches 12x slower than with one.
        """
        loop_in_graph = jit_compile and self.accumulation_steps > 1
        bodies = {"add_micro_batch": self._add_micro_batch, "forward": self._forward_micro_batch,
                  "add_backward": self._add_backward}
        return (tracing.function(self.step, jit_compile=jit_compile and not loop_in_graph),
                {name: tracing.function(body, jit_compile=True) if loop_in_graph else body
                 for name, body in bodies.items()})

    def __call__(self, batch: Batch) -> dict[str, Any]:
        """Runs the compiled step on one global batch.

        Raises:
          LossContractError: on the first call, when `loss_fn` returns what `as_losses` cannot read
            (raised here, from a trace of the loss alone, before the step's own trace).
        """
        if self._traced_metric_names is None:
            self.metric_names(tf.nest.map_structure(self._global_spec, batch))
        if not self.overflow_retries:
            report = self._compiled(batch)
            for objective_report in report["objectives"].values():
                objective_report["retries"] = tf.constant(0)
            return report
        return self._retrying_overflows(batch)

    def _retrying_overflows(self, batch: Batch) -> dict[str, Any]:
        """The compiled step on `batch`, called again while its report says `retry` (the step
        decides, and puts its number and state back, itself: see `step`). XLA never compiles the
        loop of retries, which runs in the caller's graph."""
        def attempt(number, again, report):
            del again
            report = self._compiled(batch, number)
            return number + 1, report["retry"], report

        def settled_from(number, report, first_scales):
            attempts, _, report = tf.while_loop(lambda _, again, __: again, attempt,
                                                (number, tf.constant(True), report))
            return self._settled(attempts, report, first_scales)

        first_scales = {name: objective.loss_scale.scale for name, objective in self.objectives.items()}
        if self.jit_compile:
            # The loop only where the first attempt overflowed: around every step it cost T5's
            # 8 ms XLA step 8%, the conditional 1.5%. XLA compiles the step once for both calls.
            first = self._compiled(batch, tf.constant(0))
            return tf.cond(first["retry"], lambda: settled_from(tf.constant(1), first, first_scales),
                           lambda: self._settled(tf.constant(1), first, {}))
        # Graph mode would inline a second call site's step into the graph again (charlm:
        # compiling 5 s → 10 s); the loop around one call costs its steps 0.5%.
        outputs = self._compiled.get_concrete_function(batch, tf.constant(0)).structured_outputs
        unset = tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype), outputs)
        return settled_from(tf.constant(0), unset, first_scales)

    def _settled(self, attempts: tf.Tensor, report: dict[str, Any], first_scales: dict) -> dict[str, Any]:
        """The last attempt's report with each objective's `retries`; an objective no retry cured
        (given `first_scales`, the scales of the batch's first attempt; none where nothing was
        retried) counts as a plain skip: its first scale in the report, one back-off from it."""
        report = {**report, "objectives": {name: dict(r) for name, r in report["objectives"].items()}}
        del report["retry"]
        for name, objective in self.objectives.items():
            objective_report = report["objectives"][name]
            objective_report["retries"] = tf.where(objective_report["ran"], attempts - 1, 0)
            if name in first_scales and isinstance(objective.loss_scale, DynamicLossScale):
                uncured = tf.logical_and(objective_report["retries"] > 0,
                                         tf.logical_not(objective_report["applied"]))
                objective_report["loss_scale"] = tf.where(uncured, first_scales[name],
                                                          objective_report["loss_scale"])
                objective.loss_scale.back_off_once_from(first_scales[name], uncured)
        return report

    def _curable_overflow(self, reports: dict[str, dict], inputs_finite: tf.Tensor) -> tf.Tensor:
        """Whether this attempt skipped every update due, each for non-finite gradients from
        finite inputs and a finite loss, with its scale now lower than the one it used."""
        due_and_curable, any_due = [], []
        for name, objective in self.objectives.items():
            r = reports[name]
            curable = tf.logical_and(tf.logical_not(r["applied"]), tf.math.is_finite(r["loss"]))
            curable = tf.logical_and(curable, objective.loss_scale.scale < r["loss_scale"])
            due_and_curable.append(tf.logical_or(tf.logical_not(r["ran"]), curable))
            any_due.append(r["ran"])
        return tf.logical_and(inputs_finite, tf.logical_and(tf.reduce_all(due_and_curable),
                                                            tf.reduce_any(any_due)))

    def step(self, batch: Batch, attempt: Optional[tf.Tensor] = None) -> dict[str, Any]:
        """The step's body, uncompiled: for callers that trace it inside their own `tf.function`
        (one attempt: no retries, and no `retries` in its reports).

        Runs in cross-replica context: the gradient phase runs on every replica, the decision to
        apply is taken once per objective, and the updates themselves run on every replica again.
        With `attempt` (0 for a batch's first; `overflow_retries` > 0) the report also says whether
        to `retry`, and a step to be retried leaves its number and the model's state as it found
        them: all inside the compiled step, where XLA fuses it.
        """
        scales = {name: objective.loss_scale.scale for name, objective in self.objectives.items()}
        saved_states = {name: [tf.identity(v) for v in objective.state]
                        for name, objective in self.objectives.items()}
        retry_state = [tf.identity(v) for v in self._retry_state] if attempt is not None else []
        step_number = tf.convert_to_tensor(self.global_step) + 1  # The step this update makes.
        grads, reports = self.strategy.run(self._replica_gradients, args=(batch, step_number))
        reports = tf.nest.map_structure(self._first_replica, reports)
        due = self._due(step_number)
        objective_reports = {}
        for name, objective in self.objectives.items():
            report = dict(reports["objectives"][name])
            finite_per_variable = report.pop("finite_per_variable")

            def update():
                applied = tf.cond(
                    report["grads_finite"],
                    lambda: self._apply(name, grads[name]),
                    lambda: self._roll_back(name, saved_states[name], finite_per_variable),
                )
                objective.loss_scale.update(report["grads_finite"])
                return applied

            objective_reports[name] = {**report, "loss_scale": scales[name],
                                       "ran": tf.constant(True) if due[name] is None else due[name],
                                       "applied": _when(due[name], update, lambda: tf.constant(False))}
        report = {"objectives": objective_reports, "inputs_finite": reports["inputs_finite"]}
        if attempt is None:
            self.global_step.assign_add(1)
            return report
        retry = tf.logical_and(attempt < self.overflow_retries,
                               self._curable_overflow(objective_reports, reports["inputs_finite"]))
        # A step to be taken again is the same step: its number (and so every cadence) stays, and
        # so does the state of the layers no skip rolled back (an objective not due, the model's own
        # seed generators).
        self.global_step.assign_add(1 - tf.cast(retry, tf.int64))
        for variable, value in zip(self._retry_state, retry_state):
            variable.assign(tf.where(retry, value, variable))
        return {**report, "retry": retry}

    def _due(self, step_number: tf.Tensor) -> dict[str, Optional[tf.Tensor]]:
        """Per objective, whether update `step_number` is one of its (a bool tensor), or None for
        an objective updated on every step (no conditional in the graph)."""
        return {name: None if objective.every_steps == 1
                else tf.equal(step_number % objective.every_steps, 0)
                for name, objective in self.objectives.items()}

    def _replica_gradients(self, batch: Batch, step_number: tf.Tensor) -> tuple[dict, dict[str, Any]]:
        """One replica's accumulated gradients, summed over replicas once, averaged, checked, clipped."""
        nonfinite_inputs = _count_nonfinite_floats(self.input_fn(batch))
        accumulate = self._accumulate_two_passes if self.two_pass else self._accumulate
        grads, sums = accumulate(batch, step_number)
        # The only communication of the update: every objective's gradients and sums, and the input
        # check, in one all-reduce (and the overwritten variables' new values in a second, by maximum).
        new_values = {name: _select(grads[name], self._overwritten[name]) for name in self.objectives}
        derivatives = {name: _select(grads[name], _negated(self._overwritten[name]))
                       for name in self.objectives}
        derivatives, sums, nonfinite_inputs = _sum_over_replicas((derivatives, sums, nonfinite_inputs))
        new_values = _max_over_replicas(new_values)
        grads = {name: _merged(self._overwritten[name], new_values[name], derivatives[name])
                 for name in self.objectives}
        # Every replica now holds the same sums, so the local verdicts are already the global ones.
        checked = {name: self._check_and_clip(name, grads[name], sums[name]) for name in self.objectives}
        return ({name: grads for name, (grads, _) in checked.items()},
                {"objectives": {name: report for name, (_, report) in checked.items()},
                 "inputs_finite": tf.equal(nonfinite_inputs, 0.0)})

    def _check_and_clip(self, name: str, grads: list, sums: dict[str, Any]) -> tuple[list, dict[str, Any]]:
        """Objective `name`'s summed gradients averaged by its weight, checked for finiteness,
        clipped; the new values of its overwritten variables only checked."""
        weight = sums["weight"]
        overwritten = self._overwritten[name]
        new_values = _select(grads, overwritten)
        derivatives = [g / weight for g in _select(grads, _negated(overwritten))]
        # After the division (a total weight of 0 makes NaN); a non-finite new value overflows too.
        finite_per_variable = leaves_finite(_merged(overwritten, new_values, derivatives))
        grad_norm = tf.linalg.global_norm(derivatives)
        if self.clip_global_norm is not None:
            derivatives, _ = tf.clip_by_global_norm(derivatives, self.clip_global_norm, use_norm=grad_norm)
        return _merged(overwritten, new_values, derivatives), {"loss": sums["loss"] / weight, "grads_finite": tf.reduce_all(finite_per_variable),
                       "grad_norm": grad_norm, "weight": weight,
                       "metrics": {name: value / weight for name, value in sums["metrics"].items()},
                       "finite_per_variable": finite_per_variable}

    def _first_replica(self, value: Any) -> tf.Tensor:
        """The value of the first local replica (all replicas hold the same reduced metrics)."""
        return self.strategy.experimental_local_results(value)[0]

    def _accumulate(self, batch: Batch, step_number: tf.Tensor) -> tuple[dict, dict[str, Any]]:
        """Sums each objective's unscaled float32 gradients and weighted sums over the micro-batches."""
        if self.accumulation_steps == 1:
            return self._micro_step(batch, step_number)
        micro_batches = split_micro_batches(batch, self.accumulation_steps)

        names = self._loss_metric_names(tf.nest.map_structure(
            lambda t: tf.TensorSpec(t.shape[1:], t.dtype), micro_batches))
        zeros = (self._no_gradients(self.accumulation_dtype),
                 {name: _weighted_sums(Loss(0.0, 0.0, {metric: 0.0 for metric in names[name]}))
                  for name in self.objectives})
        grads, sums = self._micro_batch_loop(
            lambda i, accumulated: self._body("add_micro_batch")(micro_batches, i, step_number,
                                                                 accumulated), zeros)
        return _as_float32(grads), sums

    def _micro_batch_loop(self, body: Callable[[tf.Tensor, Any], Any], initial: Any,
                          start: int = 0) -> Any:
        """`initial` carried through `body(i, carried)` for micro-batches i = start .. k-1, one at a
        time: a while loop runs up to 10 iterations at once by default, which keeps that many
        micro-batches' activations alive (charlm at d_model 512, batch 256, 4 micro-batches in
        graph mode: 2,933 MiB peak, one at a time 1,678 MiB, with the same losses and speed)."""
        _, carried = tf.while_loop(lambda i, _: i < self.accumulation_steps,
                                   lambda i, carried: (i + 1, body(i, carried)),
                                   (tf.constant(start), initial), parallel_iterations=1)
        return carried

    def _accumulate_two_passes(self, batch: Batch, step_number: tf.Tensor) -> tuple[dict, dict[str, Any]]:
        """What `_accumulate` returns, for the loss of the whole global batch: GradCache's two passes
        (engine/batch_loss.py). Every replica computes that loss alike; the first one reports it."""
        micro_batches = split_micro_batches(batch, self.accumulation_steps)
        state = self.model.non_trainable_variables  # Seed states, BatchNorm statistics.
        saved = [tf.identity(variable) for variable in state]
        outputs = self._concatenated(lambda i: self._body("forward")(micro_batches, i))
        for variable, value in zip(state, saved):
            variable.assign(value)  # The second pass draws the first's noise; statistics move once.
        losses, output_grads = global_batch.loss_and_output_gradients(
            self.loss_fn, global_batch.gather_replicas(outputs), global_batch.gather_replicas(batch),
            list(self.objectives))
        num_rows = tf.shape(tf.nest.flatten(batch)[0])[0]
        output_grads = split_micro_batches(global_batch.replica_rows(output_grads, num_rows),
                                           self.accumulation_steps)

        grads = _as_float32(self._micro_batch_loop(
            lambda i, accumulated: self._body("add_backward")(micro_batches, output_grads, i,
                                                              step_number, accumulated),
            self._no_gradients(self.accumulation_dtype)))
        grads = {name: self._weighted(name, grads[name], losses[name].weight) for name in self.objectives}
        return grads, global_batch.on_first_replica(
            {name: _weighted_sums(loss) for name, loss in losses.items()})

    def _concatenated(self, forward_fn: Callable[[tf.Tensor], Any]) -> Any:
        """`forward_fn(i)`'s outputs for every micro-batch index i, concatenated along the batch (in
        a `tf.while_loop`; the first outside it, which gives the outputs' structure)."""
        first = forward_fn(tf.constant(0))
        arrays = [tf.TensorArray(t.dtype, size=self.accumulation_steps, element_shape=t.shape).write(0, t)
                  for t in tf.nest.flatten(first)]

        arrays = self._micro_batch_loop(
            lambda i, arrays: [array.write(i, t) for array, t in zip(arrays, tf.nest.flatten(forward_fn(i)))],
            arrays, start=1)
        return tf.nest.pack_sequence_as(first, [
            tf.reshape(array.stack(), tf.concat([[-1], tf.shape(t)[1:]], 0))
            for array, t in zip(arrays, tf.nest.flatten(first))])

    def _forward_micro_batch(self, micro_batches: Batch, index: tf.Tensor) -> Any:
        """The first pass on micro-batch `index`: the float32 outputs of a forward without a tape."""
        micro_batch = micro_batch_at(micro_batches, index)
        outputs = forward(self.model, self.policy, self.input_fn(micro_batch), training=True)
        return global_batch.batch_shaped(outputs, _num_rows(micro_batch), self._joined_over())

    def _joined_over(self) -> str:
        """'joined over 2 micro-batches and 2 replicas': what the two passes join outputs over."""
        counts = {"micro-batches": self.accumulation_steps,
                  "replicas": self.strategy.num_replicas_in_sync}
        return "joined over " + " and ".join(f"{n} {what}" for what, n in counts.items() if n > 1)

    def _add_backward(self, micro_batches: Batch, output_grads: dict, index: tf.Tensor,
                      step_number: tf.Tensor, accumulated: dict) -> dict:
        """The second pass on micro-batch `index`: `accumulated` plus, per objective due, its
        unscaled float32 gradients from the forward again and a backward that starts at the
        outputs with the loss scale times `output_grads` (the whole batch's loss's gradient with
        respect to those outputs, [k, micro-batch, ...] per floating output)."""
        inputs = self.input_fn(micro_batch_at(micro_batches, index))
        with tf.GradientTape(persistent=len(self.objectives) > 1) as tape:
            leaves = global_batch.floating_leaves(
                forward(self.model, self.policy, inputs, training=True))
        due = self._due(step_number)
        grads = {}
        for name, objective in self.objectives.items():
            def gradients():
                seeds = [objective.loss_scale.scale_loss(g[index]) for g in output_grads[name]]
                return self._unscaled(name, tape.gradient(leaves, objective.variables,
                                                          output_gradients=seeds))

            grads[name] = _when(due[name], gradients, lambda: self._no_gradients()[name])
        return self._added(accumulated, grads, _rounding_seed(step_number, index))

    def _no_gradients(self, dtype: tf.DType = tf.float32) -> dict[str, list]:
        """What adds nothing to accumulated gradients, shaped as each objective's variables: zeros
        in `dtype`, and the lowest float32 for an overwritten variable (combined by maximum)."""
        return {name: [tf.fill(v.shape, tf.float32.min) if overwritten else tf.zeros(v.shape, dtype)
                       for v, overwritten in zip(objective.variables, self._overwritten[name])]
                for name, objective in self.objectives.items()}

    def _added(self, accumulated: dict[str, list], grads: dict[str, list],
               seed: tf.Tensor) -> dict[str, list]:
        """Per objective, float32 `grads` added to `accumulated`; for an overwritten variable, their
        maximum (Keras's gradient accumulation keeps the largest amax a micro-batch saw, not the
        last). A bfloat16 accumulator (`accumulation_dtype`) gets the float32 sum rounded
        stochastically, each variable with its own draws from `seed`: a plain rounding would drop
        a micro-batch's gradient wherever it is below half the accumulated value's spacing."""
        def add(a, g, overwritten, index):
            if overwritten:
                return _maximum(a, g)
            if a.dtype == tf.float32:
                return a + g
            return low_bit.stochastic_round_to_bfloat16(
                tf.cast(a, tf.float32) + g, seed + tf.constant([0, 1]) * index)

        return {name: [add(a, g, overwritten, index) for index, (a, g, overwritten) in enumerate(
                    zip(accumulated[name], grads[name], self._overwritten[name]))]
                for name in accumulated}

    def _weighted(self, name: str, grads: list, weight: tf.Tensor) -> list:
        """Objective `name`'s gradients times the loss `weight`; new values as they are."""
        return [g if overwritten else _times_weight(g, weight)
                for g, overwritten in zip(grads, self._overwritten[name])]

    def _unscaled(self, name: str, scaled_grads: list) -> list:
        """Objective `name`'s gradients from its scaled backward, unscaled into float32; the new
        values of its overwritten variables as they came.

        Which variables the loss does not reach is known while tracing (`unused_variables`). They
        get zero gradients here, which change neither the norm nor the finiteness check, and no
        update (see _apply).
        """
        objective = self.objectives[name]
        self.unused_variables[name] = [grad is None for grad in scaled_grads]
        grads = [_zeros_if_none(g, v) for g, v in zip(scaled_grads, objective.variables)]
        # A new value is not scaled by the loss scale (an output-gradient amax is measured on the
        # scaled backward it will quantize, as under Keras's LossScaleOptimizer).
        overwritten = self._overwritten[name]
        return _merged(overwritten, _select(grads, overwritten),
                       objective.loss_scale.unscale(_select(grads, _negated(overwritten))))

    def _add_micro_batch(self, micro_batches: Batch, index: tf.Tensor, step_number: tf.Tensor,
                         accumulated: tuple) -> tuple:
        """`accumulated` (gradients and sums) plus those of micro-batch `index` of `micro_batches`."""
        grads, sums = self._micro_step(micro_batch_at(micro_batches, index), step_number)
        return (self._added(accumulated[0], grads, _rounding_seed(step_number, index)),
                tf.nest.map_structure(tf.add, accumulated[1], sums))

    def metric_names(self, batch_spec: Any) -> dict[str, list[str]]:
        """Per objective, the names of the metrics `loss_fn` returns beside its loss, for global
        batches of `batch_spec` (a structure of `tf.TensorSpec`).

        Loops that carry the metrics must know them before they trace their body, so the forward
        pass and the loss are traced once more on their own (never run) to read them, on the
        shapes the step will give them (`loss_batch_spec`): a loss may loop over its batch
        dimension in Python (`range(x.shape[0])`).

        Raises:
          LossContractError: when `loss_fn` returns what `as_losses` cannot read.
          UserError: when `loss_fn` fails on a batch whose batch dimension is unknown (a leaf of
            the data without a static one), naming that leaf.
        """
        return self._loss_metric_names(self.loss_batch_spec(batch_spec))

    def loss_batch_spec(self, batch_spec: Any) -> Any:
        """What `loss_fn` sees of global batches of `batch_spec`: the whole batch with the two
        passes (`batch_loss`), else one micro-batch of one replica, whose batch dimension is the
        global one divided by replicas x `accumulation_steps` (unknown where the global one is)."""
        if self.two_pass:
            return batch_spec
        num_slices = self.strategy.num_replicas_in_sync * self.accumulation_steps
        return tf.nest.map_structure(lambda spec: _batch_divided(spec, num_slices), batch_spec)

    def _global_spec(self, value: Any) -> tf.TensorSpec:
        """The spec of the global batch's leaf a distributed `value` holds one replica's slice of."""
        local = self._first_replica(value)  # A tensor, or a NumPy array called with.
        shape = tf.TensorShape(local.shape)
        if shape.rank and shape[0] is not None:
            shape = [shape[0] * self.strategy.num_replicas_in_sync, *shape[1:]]
        return tf.TensorSpec(shape, tf.as_dtype(local.dtype))

    def _loss_metric_names(self, loss_spec: Any) -> dict[str, list[str]]:
        """`metric_names`, from a trace of the forward pass and `loss_fn` on a batch of
        `loss_spec` (what the loss sees: see `loss_batch_spec`), once; then as it found them."""
        if self._traced_metric_names is None:
            names, errors = {}, []

            def forward_and_loss(batch):
                outputs = forward(self.model, self.policy, self.input_fn(batch), training=True)
                try:
                    losses = as_losses(self.loss_fn(outputs, batch), self.objectives)
                except LossContractError as error:  # Raised after the trace, in one line.
                    errors.append(error)
                    return
                names.update({name: list(loss.metrics) for name, loss in losses.items()})

            try:
                tracing.function(forward_and_loss).get_concrete_function(loss_spec)
            except (TypeError, ValueError) as error:
                unknown = _unknown_batch_leaf(loss_spec)
                if unknown is None:
                    raise
                raise UserError(
                    f"compute_loss failed on a batch whose batch dimension is unknown ({unknown}): "
                    f"{described(error)}; give every element of the train data a static batch "
                    f"dimension (batch with drop_remainder=True; after a map, set_shape), or read "
                    f"the batch size as tf.shape(x)[0]") from None
            if errors:
                raise errors[0]
            self._traced_metric_names = names
        return self._traced_metric_names

    def _micro_step(self, micro_batch: Batch, step_number: tf.Tensor) -> tuple[dict, dict[str, Any]]:
        """Forward in the compute dtype, losses in float32, scaled backward, unscaled float32
        gradients: per objective due at `step_number`, of its own loss with respect to its own
        variables (zeros for the others, whose backward is not run).

        The scale multiplies the micro-batch's *mean* loss (sum / weight), so a token-weighted sum
        over thousands of tokens reaches the 16-bit backward with a mean's magnitudes; the weight goes
        back onto the gradients in float32, which keeps the accumulated update exactly token-weighted.
        """
        with tf.GradientTape(persistent=len(self.objectives) > 1) as tape:
            outputs = forward(self.model, self.policy, self.input_fn(micro_batch), training=True)
            losses = as_losses(self.loss_fn(outputs, micro_batch), self.objectives)
            scaled_losses = {
                name: objective.loss_scale.scale_loss(
                    per_weight(losses[name].value, tf.stop_gradient(losses[name].weight)))
                for name, objective in self.objectives.items()}
        due = self._due(step_number)
        grads = {}
        for name, objective in self.objectives.items():
            def gradients():
                unscaled = self._unscaled(name, tape.gradient(scaled_losses[name], objective.variables))
                return self._weighted(name, unscaled, losses[name].weight)

            grads[name] = _when(due[name], gradients, lambda: self._no_gradients()[name])
        return grads, {name: _weighted_sums(loss) for name, loss in losses.items()}

    def _apply(self, name: str, grads: list) -> tf.Tensor:
        """Applies one objective's (per-replica) gradients to its float32 master weights on every
        replica, then its `after_update` and its EMA."""
        # Variables the loss does not reach are left alone, as `model.fit` leaves them: no update,
        # no weight decay, no moment decay.
        used = [not unused for unused in self.unused_variables[name]]
        objective = self.objectives[name]
        self.strategy.run(objective.optimizer.apply, args=(
            _select(grads, used), _select(objective.variables, used)))
        if objective.after_update is not None:
            # Here in cross-replica context, outside any layer call: it reads the float32 master
            # weights (not Keras's autocast copies) and each assign writes every replica alike.
            tracing.hook(objective.after_update)()
        if self.ema:
            self.ema[name].update()
        return tf.constant(True)

    def _roll_back(self, name: str, saved_state: list, finite_per_variable: tf.Tensor) -> tf.Tensor:
        """Restores one objective's non-trainable state (e.g. BatchNorm statistics) updated by the
        forward pass, and records which of its gradients were non-finite."""
        for variable, value in zip(self.objectives[name].state, saved_state):
            variable.assign(value)
        self.nonfinite_gradients[name].assign(tf.logical_not(finite_per_variable))
        return tf.constant(False)

    def nonfinite_variable_paths(self, name: str = SINGLE) -> list[str]:
        """Paths of the variables whose gradients were non-finite in objective `name`'s last
        overflowed attempt (see `nonfinite_gradients`)."""
        return masked_paths(self.objectives[name].variables, self.nonfinite_gradients[name])


def masked_paths(variables: list, mask: tf.Variable) -> list[str]:
    """Paths of the `variables` whose entry in the boolean `mask` is True."""
    return [v.path for v, marked in zip(variables, mask.numpy()) if marked]


def _weighted_sums(loss: Loss) -> dict[str, Any]:
    """A micro-batch's loss, weight and metrics (times the weight): sums to add up over
    micro-batches and replicas, and to divide by the total weight at the end."""
    return {"loss": loss.value, "weight": loss.weight,
            "metrics": {name: value * loss.weight for name, value in loss.metrics.items()}}


def _num_rows(batch: Batch) -> Any:
    """The batch dimension of `batch`: an int where a leaf knows it statically (the first such),
    else the first leaf's as a tensor."""
    leaves = tf.nest.flatten(batch)
    static = next((leaf.shape[0] for leaf in leaves if leaf.shape.rank and leaf.shape[0] is not None),
                  None)
    return static if static is not None else tf.shape(leaves[0])[0]


def _rounding_seed(step_number: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
    """The stateless seed of micro-batch `index`'s stochastic roundings at step `step_number`
    (the same in a resumed run: both come from the checkpointed step); variables then add their
    position to its second element, in steps of 2^16, so no two draws share a seed."""
    return tf.stack([tf.cast(step_number, tf.int32), tf.cast(index, tf.int32) * (1 << 16)])


def _as_float32(grads: dict[str, list]) -> dict[str, list]:
    """Accumulated gradients in float32, whatever the accumulators held."""
    return tf.nest.map_structure(lambda g: tf.cast(g, tf.float32), grads)


def _times_weight(value: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
    """`value * weight`; `value` itself for the weight 1 of a plain mean loss."""
    return value if tf.get_static_value(weight) == 1.0 else value * weight


def _when(due: Optional[tf.Tensor], fn: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
    """`fn()` where an objective is `due` and `otherwise()` where not, in a graph conditional that
    runs only one of them; `fn()` itself for an objective due on every step (`due` None)."""
    return fn() if due is None else tf.cond(due, fn, otherwise)


def _zeros_if_none(grad: Optional[tf.Tensor], variable: tf.Variable) -> tf.Tensor:
    """`grad`, or float32 zeros of `variable`'s shape for a variable the loss does not reach."""
    return tf.zeros(variable.shape, tf.float32) if grad is None else grad


def _select(values: list, keep: list[bool]) -> list:
    """The `values` whose entry in `keep` is True."""
    return [value for value, kept in zip(values, keep) if kept]


def _maximum(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """The element-wise maximum, NaN where either is NaN: XLA's maximum on a CPU drops a NaN
    (max(1, NaN) = 1), which would hide an overflowed micro-batch's new value."""
    return tf.where(tf.math.is_nan(a + b), a + b, tf.maximum(a, b))


def _nan_kept(maximum: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """`maximum` (of `values` along their first axis), NaN where any of them is NaN."""
    nan = tf.reduce_any(tf.math.is_nan(values), axis=0)
    return tf.where(nan, tf.constant(float("nan"), maximum.dtype), maximum)


def _negated(flags: list[bool]) -> list[bool]:
    """Each of `flags` negated."""
    return [not flag for flag in flags]


def _merged(chosen: list[bool], when_chosen: list, otherwise: list) -> list:
    """The list `_select` split: the next of `when_chosen` where `chosen`, else the next of
    `otherwise`."""
    when_chosen, otherwise = iter(when_chosen), iter(otherwise)
    return [next(when_chosen) if flag else next(otherwise) for flag in chosen]


def _count_nonfinite_floats(tree: Any) -> tf.Tensor:
    """How many floating tensors of `tree` hold an inf or NaN, as a float32 scalar."""
    floats = [t for t in tf.nest.flatten(tree) if tf.as_dtype(t.dtype).is_floating]
    if not floats:
        return tf.constant(0.0)
    return tf.reduce_sum(tf.cast(tf.logical_not(leaves_finite(floats)), tf.float32))


def _sum_over_replicas(value: Any) -> Any:
    """Sums `value` over the replicas of a `tf.distribute` strategy; identity on one replica."""
    replica_context = _replicas()
    return value if replica_context is None else replica_context.all_reduce(
        tf.distribute.ReduceOp.SUM, value)


def _max_over_replicas(value: Any) -> Any:
    """The element-wise maximum of `value` over the replicas (tf.distribute's all-reduce has no
    MAX: each tensor is gathered along a new first axis and reduced); identity on one replica."""
    replica_context = _replicas()
    if replica_context is None or not tf.nest.flatten(value):
        return value
    gathered = replica_context.all_gather(tf.nest.map_structure(lambda t: t[tf.newaxis], value), axis=0)
    return tf.nest.map_structure(lambda t: _nan_kept(tf.reduce_max(t, axis=0), t), gathered)


def _replicas() -> Optional[tf.distribute.ReplicaContext]:
    """The replica context when there are several replicas to reduce over, else None."""
    replica_context = tf.distribute.get_replica_context()
    if replica_context is None or replica_context.num_replicas_in_sync == 1:
        return None
    return replica_context
