"""The Trainer: the base class a research model subclasses, owning tracing, the loops and the workdir.

A subclass writes plain methods (`build_model`, `build_datasets`, `compute_loss`, optionally
`eval_metrics`, `build_optimizer`, `model_inputs`, and for research loops `build_objectives`,
`actions` and `extra_state`). The base class builds them under the precision
policy, compiles `steps_per_loop` train steps into one `tf.function` (the inner loop, here), and
hands the outer loop between those calls (progress, evaluation, checkpoints, faults) to controller.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from typing import Any, Callable, Iterator, Optional

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mixloop.config import ConfigError, split_auto
from mixloop.engine import compact_optimizer, float8_layers, layer_precision, lighter_model, tracing
from mixloop.engine.loss import as_losses
from mixloop.engine.objective import SINGLE, Objective, with_loss_scales
from mixloop.engine.step import Batch, TrainStep, default_input_fn, forward, masked_paths
from mixloop.errors import UserError
from mixloop.runner import (auto_precision, checkpointing, compile_mode, controller, distribution,
                            exporting, guard, optimizers, precision_setup, reporting, train_data)
from mixloop.runner.actions import Action
from mixloop.runner.state import RunState
from mixloop.runner.workdir import check_layout


class Trainer:
    """Trains `build_model()` on `build_datasets()` as `config` says, writing into `workdir`."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        reporting.show_info_by_default()  # Progress from a script or notebook too.
        self.config = config
        self.workdir = workdir
        self.strategy = distribution.make_strategy(config.distribution)
        keras.utils.set_random_seed(config.seed)
        if config.deterministic:
            tf.config.experimental.enable_op_determinism()
        self.is_chief = distribution.is_chief(self.strategy)
        _check_replica_batch(config, self.strategy.num_replicas_in_sync)
        auto_precision.check_replicas(config, self.strategy.num_replicas_in_sync)
        # None until `choose_compile_mode` measures it (jit_compile="auto").
        self.jit_compile, compile_reason = compile_mode.configured(
            config.jit_compile, self.strategy.num_replicas_in_sync)
        self.policy, policy_reason = precision_setup.make_policy(config.precision.policy)
        logging.info("%s (%s); %s; train step %s", policy_reason, self.policy,
                     distribution.describe(self.strategy),
                     compile_reason if self.jit_compile is None
                     else f"{compile_mode.describe(self.jit_compile)} ({compile_reason})")
        with self.strategy.scope():
            with layer_precision.building_under(self.policy):
                self.model = self.build_model()
            placement = layer_precision.keep_float32_layers(
                self.model, self.policy, split_auto(config.precision.float32_layers)[1])
            placement += layer_precision.own_float32_layers(self.model, self.policy, placement)
            logging.info("%s", layer_precision.describe_placement(placement, self.policy))
            # After the placement, which `auto` reads: a layer kept in float32 stays out of FP8.
            self.float8_paths = float8_layers.quantize_selected(
                self.model, self.policy, config.precision.float8_layers)
            float8_line = float8_layers.describe(self.model, config.precision.float8_layers)
            if float8_line:
                logging.info("%s", float8_line)
            self._lighten_model()
            self.objectives = with_loss_scales(
                self.build_objectives(),
                lambda: precision_setup.make_loss_scale(config.precision, self.policy))
            self.state = RunState({name: len(o.variables) for name, o in self.objectives.items()})
            self.train_step = TrainStep(
                model=self.model,
                objectives=self.objectives,
                loss_fn=self.compute_loss,
                policy=self.policy,
                accumulation_steps=config.train.accumulation_steps,
                clip_global_norm=config.train.clip_global_norm or None,
                jit_compile=compile_mode.step_with_xla(self.jit_compile),
                input_fn=self.model_inputs,
                ema_decay=config.train.ema_decay,
                global_step=self.state.global_step,  # The step counts its updates here.
                batch_loss=config.train.batch_loss,
                overflow_retries=config.precision.overflow_retries,
                accumulation_dtype=config.train.accumulation_dtype,
            )
            self.compile_loops()
            _check_objective_variables(self.objectives, self.model)
            _check_compact_optimizers(self.objectives, config)
            _warn_of_idle_objectives(self.objectives, config.train.num_steps)
            # Before the data and the first trace, so compute_loss and build_datasets may read it.
            self.research_state = _checked_extra_state(self.extra_state())
        with reporting.announced(f"Building the datasets ({type(self).__name__}.build_datasets)"):
            self._train_data, self.eval_data = self.build_datasets()
        train_data.check_batches(self._train_data.element_spec, config.train.batch_size)
        self.train_metric_names = self.train_step.metric_names(self._train_data.element_spec)
        reporting.check_metric_names(
            [metric for names in self.train_metric_names.values() for metric in names])
        # The default strategy's plain tf.data iterator goes into the checkpoint when TensorFlow
        # can serialize it; otherwise (another strategy, a Python generator) the iterator is made
        # on first use, fast-forwarded by the restored step (`train_iterator`).
        self._train_iterator = train_data.checkpointed_iterator(self.strategy,
                                                                self.make_train_iterator)
        self.iterator_in_checkpoint = self._train_iterator is not None
        # What a checkpoint holds. Variables go in as lists: Keras 3 does not track every variable
        # (such as dropout seed states) through the model object.
        self.checkpointed = dict(
            model_variables=list(self.model.variables),
            objectives={name: {"optimizer_variables": list(objective.optimizer.variables),
                               "loss_scale": objective.loss_scale}
                        for name, objective in self.objectives.items()},
            state=self.state,
            ema=self.train_step.ema,
            extra_state=self.research_state,
            **({"train_iterator": self._train_iterator} if self.iterator_in_checkpoint else {}),
        )
        check_layout(self.workdir)  # Before the checkpoint manager makes its folder.
        self.checkpoints = checkpointing.make_manager(
            self._checkpoint_workdir(), config.checkpoint.max_to_keep, **self.checkpointed
        )

    def _lighten_model(self) -> None:
        """Applies `train.recompute` and `precision.master_weights` to the placed model, before
        the optimizers see its variables (engine/lighter_model.py)."""
        recomputed = lighter_model.recompute(self.model, self.config.train.recompute)
        if recomputed:
            logging.info("Activations recomputed in the backward pass (train.recompute): %s",
                         layer_precision.shown_paths(recomputed, 6))
        if self.config.precision.master_weights != lighter_model.BFLOAT16:
            return
        if self.policy.compute_dtype != tf.bfloat16:
            raise ConfigError(
                f"config.precision.master_weights='bfloat16' needs a policy computing in bfloat16, "
                f"but precision.policy is {self.policy.keras_name}: set "
                "--config.precision.policy=mixed_bfloat16, or master_weights='float32'")
        moved = lighter_model.store_weights_in_bfloat16(self.model)
        total = sum(math.prod(v.shape) for v in self.model.trainable_variables)
        logging.info("Weights stored in bfloat16 (precision.master_weights): %s of %s parameters, "
                     "each update rounded stochastically; layers computing in float32 read them "
                     "cast up", f"{moved:,}", f"{total:,}")

    # ----- What a research subclass writes. -----

    def build_model(self) -> keras.Model:
        """Returns a built Keras model (called under the run's dtype policy)."""
        raise NotImplementedError("a Trainer subclass must define build_model()")

    def build_datasets(self) -> tuple[tf.data.Dataset, Optional[tf.data.Dataset]]:
        """Returns (train, eval or None): datasets of global batches, the train one not repeated
        (`config.train.repeat_dataset` asks the framework to repeat it)."""
        raise NotImplementedError("a Trainer subclass must define build_datasets()")

    def compute_loss(self, outputs: Any, batch: Batch) -> Any:
        """Returns a float32 scalar mean loss, a (loss_sum, weight) pair, or a `mixloop.Loss` with
        train metrics, from float32 outputs; with several objectives, a dict of those by objective."""
        raise NotImplementedError("a Trainer subclass must define compute_loss()")

    def eval_metrics(self, outputs: Any, batch: Batch) -> dict[str, tf.Tensor]:
        """Returns the eval metrics of one batch; each is averaged over the eval batches. By default
        each objective's loss per weight (`loss`, or `loss/<objective>` for several) and the metrics
        `compute_loss` returns in `mixloop.Loss`es."""
        metrics = {}
        losses = as_losses(tracing.hook(self.compute_loss)(outputs, batch), self.objectives)
        for name, loss in losses.items():
            metrics[reporting.tag("loss", name, self.objectives)] = loss.value / loss.weight
            metrics.update(loss.metrics)
        return metrics

    def build_optimizer(self) -> keras.optimizers.Optimizer:
        """Returns the optimizer; by default the one `config.optimizer` names."""
        return optimizers.build_optimizer(self.config)

    def build_objectives(self) -> dict[str, Objective]:
        """Returns the objectives by name (called after `build_model`, in the strategy's scope).

        By default one, the whole model trained by `build_optimizer()`. Return several (e.g. a
        generator and a discriminator, each a layer of `self.model` with its own optimizer) and
        `compute_loss` returns a dict with one loss per objective name. An objective without a
        `loss_scale` gets its own from `config.precision`.
        """
        return {SINGLE: Objective(self.model, self.build_optimizer())}

    def actions(self) -> list[Action]:
        """Returns host-side actions the loop runs every N updates or after each eval (none by
        default): e.g. a generated sample written with `tf.summary.text`."""
        return []

    def extra_state(self) -> dict[str, Any]:
        """Returns research state to checkpoint beside the model (none by default): trackables such
        as `tf.Variable`s, e.g. a curriculum counter, restored on resume. Called once, at
        construction, after `build_objectives` and before `build_datasets` (so the datasets and
        `compute_loss` may read it); keep the variables as attributes and update them in place."""
        return {}

    def model_inputs(self, batch: Batch) -> Any:
        """Returns what the model is called on; by default the first element of an (x, y) tuple."""
        return default_input_fn(batch)

    # ----- What the framework owns. -----

    def train_loop(self, num_steps: int) -> dict[str, Any]:
        """Runs up to `num_steps` updates in one compiled call; returns the loop's totals as NumPy
        values (see `_inner_loop`). The controller calls this; a TensorFlow op error propagates.
        With jit_compile="auto" the first call decides the compile mode (`choose_compile_mode`)
        unless the controller did."""
        self.choose_compile_mode()
        with compile_mode.calls_in(self.jit_compile):
            totals = self._train_loop(self.train_iterator, tf.constant(num_steps))
        return tf.nest.map_structure(lambda value: value.numpy(), totals)

    def compile_loops(self) -> None:
        """Makes the compiled inner loop, train step and eval step anew: they trace on their next
        call. After a layer moved to float32 (healing), as tracing reads the layers' dtypes."""
        self.train_step.recompile()
        self._train_loops: dict[Optional[bool], Any] = {}  # Per compile mode: traced once, kept.
        self.set_jit_compile(self.jit_compile)
        self._eval_step = tracing.function(self._eval_batch)

    def choose_compile_mode(self, stop_requested: Callable[[], bool] = lambda: False) -> bool:
        """Decides `jit_compile` for config.jit_compile="auto" (`compile_mode.choose`: recorded in
        the workdir, a rule, or timing both modes from the current state, which it leaves as it
        was; a probe gives up at its next loop once `stop_requested()`); the controller calls it
        after `start_precision`. Does nothing once decided. Returns whether the chosen loop is
        compiled already (the probe ran it)."""
        return compile_mode.choose(self, stop_requested)

    def set_jit_compile(self, jit_compile: Optional[compile_mode.Mode]) -> None:
        """Runs the train step in compile mode `jit_compile` (`compile_mode.MODES`) from the next
        loop on (each mode traced once; None, undecided, until `choose_compile_mode`)."""
        self.jit_compile = jit_compile
        self.train_step.jit_compile = compile_mode.step_with_xla(jit_compile)
        if jit_compile not in self._train_loops:
            self._train_loops[jit_compile] = tracing.function(self._inner_loop)
        self._train_loop = self._train_loops[jit_compile]

    def start_precision(self, stop_requested: Callable[[], bool] = lambda: False) -> None:
        """Applies `precision.float32_layers=auto` and `initial_scale=auto` from a probe of the
        current weights (`auto_precision.start`; the probe gives up, changing and recording
        nothing, once `stop_requested()`); the controller calls it after restoring, before the
        first update. Does nothing unless the config asks for it."""
        auto_precision.start(self, stop_requested)

    def heal(self) -> str:
        """Moves to float32 the layers a probe of the current weights finds overflowing, retracing
        the loops (`auto_precision.heal`); returns what moved, '' for nothing."""
        return auto_precision.heal(self)

    def divergence_cure(self) -> str:
        """What would cure a divergence in float16 ('; ...' for the end of its line; '' in other
        dtypes): the layers a probe of the current weights finds (`auto_precision.cure`)."""
        return auto_precision.cure(self)

    def _inner_loop(self, iterator, num_steps: tf.Tensor) -> dict[str, Any]:
        """The inner loop: up to `num_steps` train steps in one graph, returning sums for reporting.

        Per objective it sums the losses, norms and metrics (`reporting.add_update`) and asks the
        guard after every update; it ends early when an objective shows the run diverging, with that
        reason in its `stop_reason`. (The end of the data is the outer loop's business: it never
        asks for more batches than there are.)
        """
        totals = {"objectives": {name: reporting.zero_totals(self.train_metric_names[name])
                                 for name in self.objectives},
                  "last_inputs_finite": tf.constant(True)}

        def going_on(step: tf.Tensor, totals: dict[str, Any]) -> tf.Tensor:
            stopping = guard.any_stopping([t["stop_reason"] for t in totals["objectives"].values()])
            return tf.logical_and(step < num_steps, tf.logical_not(stopping))

        def update(step: tf.Tensor, totals: dict[str, Any]) -> tuple[tf.Tensor, dict[str, Any]]:
            return step + 1, self._count_update(totals, self.train_step(next(iterator)))

        return tf.while_loop(going_on, update, (tf.zeros_like(num_steps), totals))[1]

    def _count_update(self, totals: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
        """`totals` after the update whose step `metrics` these are; the skip counters moved on
        (the step itself counts the update in `global_step`)."""
        objectives = {}
        for name, report in metrics["objectives"].items():
            skips = self.state.skips[name]
            skips.record(report["ran"], report["applied"], self.train_step.nonfinite_gradients[name],
                         metrics["inputs_finite"])
            objectives[name] = {**reporting.add_update(totals["objectives"][name], report),
                                "stop_reason": guard.stop_reason(
                                    report, skips.consecutive_skips,
                                    self.config.train.max_consecutive_skips,
                                    guard.min_scale(self.objectives[name].loss_scale))}
        return {"objectives": objectives, "last_inputs_finite": metrics["inputs_finite"]}

    def _eval_batch(self, batch: Batch) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
        """One eval batch's metrics and its number of examples."""
        outputs = forward(self.model, self.policy, tracing.hook(self.model_inputs)(batch),
                          training=False)
        metrics = {name: tf.cast(value, tf.float32)
                   for name, value in tracing.hook(self.eval_metrics)(outputs, batch).items()}
        return metrics, tf.shape(tf.nest.flatten(batch)[0])[0]

    def evaluate(self) -> dict[str, float]:
        """The mean of `eval_metrics` over the eval set's examples (or `config.eval.num_batches`
        batches of it), with the EMA weights when `config.train.ema_decay` is set.

        Each batch's metrics count by its number of examples, so a short last batch counts as
        little as it holds.
        """
        if self.eval_data is None:
            return {}
        data = self.eval_data
        if self.config.eval.num_batches:
            data = data.take(self.config.eval.num_batches)
        sums, num_examples = {}, 0
        with self.ema_weights():
            for batch in data:
                metrics, size = self._eval_step(batch)
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + float(value) * int(size)
                num_examples += int(size)
        if not num_examples:
            raise UserError(controller.EMPTY_EVAL_DATA)
        return {name: total / num_examples for name, total in sums.items()}

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """The EMA weights in the model for the `with` block (the trained ones without EMA)."""
        with contextlib.ExitStack() as stack, self.strategy.scope():
            for average in self.train_step.ema.values():
                stack.enter_context(average.swapped_in())
            yield

    @contextlib.contextmanager
    def random_states_kept(self) -> Iterator[None]:
        """Puts every random state a checkpoint holds back as it was after the `with` block: the
        state of each Keras `SeedGenerator` in the model (dropout's, `keras.random.normal(...,
        seed=self.seed_generator)` in a `call`) and of each `tf.random.Generator` in
        `extra_state()`.

        The controller runs evaluation and the eval-time actions inside it: a model that draws
        noise in `call(training=False)` (a VAE's sample, a GAN's noise) would otherwise advance the
        run's random sequence at every eval, so a run stopped at step N (which evaluates there) and
        resumed would draw other noise from then on than one that ran straight through.
        """
        states = _random_states(self.model, self.research_state)
        saved = [tf.identity(state) for state in states]
        try:
            yield
        finally:
            with self.strategy.scope():
                for state, value in zip(states, saved):
                    state.assign(value)

    def restore(self) -> Optional[str]:
        """Restores the workdir's latest checkpoint; returns its path, or None for a fresh run.

        A constant learning rate lives in an optimizer variable, which the checkpoint holds; the
        configured one is put back, so a learning rate changed for the resumed run takes effect.
        """
        configured = _learning_rate_variables(self.objectives)
        path = checkpointing.restore_latest(self.checkpoints, self.resume_directory())
        for name, (variable, value) in configured.items():
            if float(variable.numpy()) != value:
                logging.info("Objective %s: learning rate %g from the config (the checkpoint had %g)",
                             name, value, float(variable.numpy()))
                variable.assign(value)
        return path

    def train(self) -> dict[str, float]:
        """Runs (or resumes) training to `config.train.num_steps` updates; returns the last metrics.

        On SIGINT or SIGTERM it finishes the current loop, saves a checkpoint and returns early;
        in `python -m mixloop.train`, one during the compile-mode probe's compilation ends the
        process, as nothing was trained yet (`interrupts.ProbeAbandoned`).

        Raises:
          UserError: for a checkpoint that does not fit or none that reads, a workdir in use or
            unusable, an empty train or eval set, a failing train or eval step, data pipeline or
            action, or a full disk during a save; `guard.TrainingDiverged` when the run diverges.
        """
        return controller.train(self)

    @property
    def global_step(self) -> tf.Variable:
        """Updates made so far in the run, skipped ones included."""
        return self.state.global_step

    @property
    def train_element_spec(self) -> Any:
        """The structure of `tf.TensorSpec`s of a global train batch, as `build_datasets` made it."""
        return self._train_data.element_spec

    def restore_weights(self, path: str) -> None:
        """Restores model, optimizer, loss scale and counters from `path`, but not the data position."""
        self._weights_checkpoint().restore(path).expect_partial()

    def save_state(self, path: str) -> str:
        """Writes all a checkpoint holds, the data position too, to `path` (outside the run's
        checkpoints: the compile-mode probe's way back); returns the path `restore_state` reads."""
        return tf.train.Checkpoint(**self.checkpointed).write(path)

    def restore_state(self, path: str) -> None:
        """Puts back all that `save_state` wrote to `path`."""
        tf.train.Checkpoint(**self.checkpointed).restore(path).expect_partial()

    def _weights_checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(**{name: value for name, value in self.checkpointed.items()
                                      if name != "train_iterator"})

    def nonfinite_variable_paths(self, objective: str = SINGLE, latest: bool = False) -> list[str]:
        """Paths of the variables whose gradients were non-finite first in the latest skip streak
        of `objective` (`latest`: in its latest overflowed attempt, a retried one included)."""
        if latest:
            return self.train_step.nonfinite_variable_paths(objective)
        return masked_paths(self.objectives[objective].variables,
                            self.state.skips[objective].first_nonfinite)

    def export(self) -> Optional[str]:
        """Saves the model in float32 (with the EMA weights when `config.train.ema_decay` is set)
        as `workdir/model.keras` for inference; returns the path, or None (with a warning naming
        the reason) when Keras cannot save one of its layers, e.g. one without a `get_config`.
        The layers `precision.float8_layers` made FP8 are saved as the plain layers `build_model`
        makes, with their trained weights.

        Logs the code that loads it (`exporting.loading_code`: plain `keras.models.load_model` for a
        model of Keras and keras-hub classes, after importing the modules of any others), and warns
        about a class no loader could rebuild.

        Raises:
          UserError: when `model.keras` cannot be replaced (a folder); nothing half-written stays.
        """
        with layer_precision.building_under(precision_setup.Policy.from_string("float32")):
            export_model = self.build_model()
        with self.ema_weights():
            # The layers precision.float8_layers quantized export plain: FP8 is how the run trains,
            # and Keras cannot reload a float8 MultiHeadAttention.
            export_model.set_weights(float8_layers.without_float8_state(self.model, self.float8_paths))
        path = os.path.join(self.workdir, "model.keras")
        partial = os.path.join(self.workdir, "model-partial.keras")  # Keras needs the suffix.
        try:
            export_model.save(partial)  # Then renamed: a failed save leaves no broken model.keras.
        except (NotImplementedError, TypeError, ValueError) as error:  # A layer Keras cannot save.
            if os.path.exists(partial):
                os.remove(partial)
            logging.warning("Could not export the model (the checkpoints hold the trained weights): "
                            "%s", _export_failure(error))
            return None
        try:
            os.replace(partial, path)
        except OSError as error:  # A folder model.keras made during the run (checked at the start).
            os.remove(partial)
            raise UserError(f"could not export the model to {path}: {error.strerror}; move it away "
                            "and run the same command to export the trained weights (the "
                            "checkpoints hold them)") from None
        classes = exporting.custom_classes(path)
        logging.info("Exported the float32 model to %s; load it with: %s", path,
                     exporting.loading_code(path, classes))
        for problem in exporting.loading_problems(classes):
            logging.warning("The exported model will not load: %s", problem)
        return path

    @property
    def train_iterator(self):
        """The run's one iterator over the train data, made on first use `global_step` batches in
        unless it came from the checkpoint.

        A run makes exactly one: every new iterator over a dataset that reshuffles each iteration
        starts another order, which would make the data depend on the strategy.
        """
        if self._train_iterator is None:
            self._train_iterator = self.make_train_iterator(int(self.global_step.numpy()))
        return self._train_iterator

    # ----- Private helpers. -----

    def make_train_iterator(self, start_step: int):
        """An iterator over the train data, distributed, `start_step` global batches in.

        The data repeats when `config.train.repeat_dataset` says so; otherwise it may run out.
        """
        return train_data.make_iterator(self.strategy, self._train_data,
                                        repeat=self.config.train.repeat_dataset,
                                        start_step=start_step,
                                        batch_size=self.config.train.batch_size)

    def num_train_batches(self) -> Optional[int]:
        """Batches in one pass over the train data, or None when it repeats (by config, or as built).

        Counted once by reading the data when tf.data does not know its length and it does not
        repeat (a repeated one of unknown length is found empty at its first update).

        Raises:
          UserError: when the data has no batch, or reading it fails (a generator that raises, a
            missing file).
        """
        cardinality = int(self._train_data.cardinality())
        if cardinality == 0:
            raise UserError(controller.empty_train_data(self.config.train.batch_size))
        if self.config.train.repeat_dataset or cardinality == tf.data.INFINITE_CARDINALITY:
            return None
        if cardinality > 0:
            return cardinality
        with reporting.announced("Counting the train batches (tf.data does not know how many the "
                                 "train dataset holds, so it is read once)"):
            try:
                count = int(self._train_data.reduce(0, lambda count, _: count + 1))
            except tf.errors.OpError as error:
                raise UserError(f"the train data pipeline failed while its batches were counted "
                                f"(one pass, as its length is unknown and config.train.repeat_dataset "
                                f"is False): {controller.op_error_summary(error)}") from None
        if not count:
            raise UserError(controller.empty_train_data(self.config.train.batch_size))
        return count

    def _checkpoint_workdir(self) -> str:
        """Where this process saves: the workdir on the chief, a worker's own folder elsewhere.

        Every worker of a multi-worker run must take part in each save; only the chief's are resumed.
        """
        if self.is_chief:
            return self.workdir
        return os.path.join(self.workdir, f"worker-{distribution.worker_index(self.strategy)}")

    def resume_directory(self) -> str:
        """The checkpoints every process resumes from: the chief's."""
        return os.path.join(self.workdir, "checkpoints")


def _export_failure(error: Exception) -> str:
    """One line for an export Keras refused: the first paragraph of its message (Keras's run over
    many lines and go on with example code), and for a class Keras cannot rebuild without a
    `get_config`, what to add."""
    summary = " ".join(str(error).strip().split("\n\n")[0].split())
    unsaveable = re.search(r"Object (\w+) was created by passing", summary)
    if unsaveable:
        name = unsaveable[1]
        summary += (f" Add to {name} a get_config() that returns its __init__ arguments, e.g. "
                    f"`return {{**super().get_config(), \"width\": self.width}}`, and register it "
                    f"with @keras.saving.register_keras_serializable() (as gan_digits' GAN).")
    return f"{type(error).__name__}: {summary}"


def _check_objective_variables(objectives: dict[str, Objective], model: keras.Model) -> None:
    """Every trained variable must be the model's (checkpointed, exported); a trainable model
    variable no objective trains is named once.

    Raises:
      UserError: for an objective whose layer is not part of `build_model()`'s model.
    """
    model_variables = {id(v) for v in model.variables}
    trained = set()
    for name, objective in objectives.items():
        outside = [v.path for v in objective.variables if id(v) not in model_variables]
        if outside:
            raise UserError(f"objective {name!r} trains variables that are not in build_model()'s "
                            f"model ({', '.join(outside[:3])}), so no checkpoint or export would "
                            f"hold them; make its layer part of the model")
        trained.update(id(v) for v in objective.variables)
    untrained = [v.path for v in model.trainable_variables if id(v) not in trained]
    if untrained:
        logging.warning("No objective trains %d trainable variable(s) of the model: %s",
                        len(untrained), ", ".join(untrained[:6]))


def _warn_of_idle_objectives(objectives: dict[str, Objective], num_steps: int) -> None:
    """Warns, one line each, of an objective whose `every_steps` exceeds the run's steps: it would
    never be updated, and nothing else would say so (its loss is still reported)."""
    for name, objective in objectives.items():
        if objective.every_steps > num_steps:
            logging.warning("Objective %r never updates in this run: every_steps=%d is more than "
                            "train.num_steps=%d; lower its every_steps or raise train.num_steps",
                            name, objective.every_steps, num_steps)


def _check_compact_optimizers(objectives: dict[str, Objective], config: ml_collections.ConfigDict) -> None:
    """Every objective's optimizer stores what `optimizer.state_dtype` asks, and rounds the
    bfloat16 weights it updates stochastically: a research `build_optimizer` returning Keras's
    own would silently keep float32 moments, or round every small update of a bfloat16 weight away.

    Raises:
      UserError: naming the objective, its optimizer and what builds a compact one.
    """
    state_dtype = config.optimizer.state_dtype
    for name, objective in objectives.items():
        optimizer = objective.optimizer
        bfloat16_weights = any(v.dtype == lighter_model.BFLOAT16 for v in objective.variables)
        compact = isinstance(optimizer, compact_optimizer.COMPACT_TYPES)
        if (state_dtype != "float32" and getattr(optimizer, "state_dtype", "float32") != state_dtype) or (
                bfloat16_weights and not compact):
            asked = (f"optimizer.state_dtype={state_dtype!r}" if state_dtype != "float32"
                     else "precision.master_weights='bfloat16'")
            raise UserError(
                f"objective {name!r} trains with {type(optimizer).__name__}, which cannot apply "
                f"{asked}: build it with mixloop.build_optimizer(self.config) (adam or adamw for "
                "int8 or bfloat16 moments; sgd and momentum too for bfloat16 weights), or use "
                "mixloop.engine.compact_optimizer's CompactAdam, CompactAdamW or CompactSGD")


def _checked_extra_state(state: Any) -> dict[str, Any]:
    """`extra_state()`'s dict, each value one a checkpoint can hold.

    Raises:
      UserError: naming a key whose value a checkpoint would silently drop (a plain number).
    """
    if not isinstance(state, dict):
        raise UserError(f"extra_state() must return a dict of name -> tf.Variable, got "
                        f"{type(state).__name__}")
    for key, value in state.items():
        try:
            tf.train.Checkpoint(value=value)
        except ValueError:
            raise UserError(f"extra_state()[{key!r}] is a {type(value).__name__}, which a checkpoint "
                            f"cannot hold; use a tf.Variable and assign to it") from None
    return state


def _random_states(model: keras.Model, research_state: dict[str, Any]) -> list:
    """The variables that hold random states: each Keras `SeedGenerator`'s in `model` (Keras lists
    them in `variables` but not in `weights`) and each `tf.random.Generator`'s in `research_state`."""
    weights = {id(weight) for weight in model.weights}
    return ([v for v in model.variables if id(v) not in weights]
            + [value.state for value in research_state.values()
               if isinstance(value, tf.random.Generator)])


def _learning_rate_variables(objectives: dict[str, Objective]) -> dict[str, tuple[Any, float]]:
    """Per objective with a constant learning rate, its optimizer variable and current value
    (a schedule has no such variable: it is rebuilt from the config and reads the iterations)."""
    found = {}
    for name, objective in objectives.items():
        for variable in objective.optimizer.variables:
            if variable.name == "learning_rate":
                found[name] = (variable, float(variable.numpy()))
    return found


def _check_replica_batch(config: ml_collections.ConfigDict, num_replicas: int) -> None:
    """Each replica's slice of the batch must split into `accumulation_steps` micro-batches."""
    train = config.train
    if train.batch_size % (num_replicas * train.accumulation_steps):
        raise ConfigError(
            f"config.train.batch_size={train.batch_size} does not split into {num_replicas} "
            f"replica(s) x {train.accumulation_steps} micro-batches (train.accumulation_steps)")

