"""One training run of a Trainer: what the framework builds from its hooks and drives, apart from the
researcher's class.

`Run(trainer, config, workdir).build()` makes, in order: the strategy, the policy, the model (placed,
quantized, lightened), the objectives and their loss scales, the counters, the `TrainStep`, the
extra state, the data and its iterator, and the checkpoints. The outer loop (controller.py) drives
it through a narrow door: `train_loop(n)`, `evaluate()`, `global_step`, `checkpoints`, `export()`;
the start's probes (auto_precision.py, compile_mode.py) and the recoveries (recovery.py) take it
whole.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Mapping, Optional

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mixloop import errors
from mixloop.config import STORAGE_DTYPES
from mixloop.engine.loss import Loss, as_losses
from mixloop.engine.objective import check_objectives, with_loss_scales
from mixloop.engine.step import TrainStep
from mixloop.engine import tracing
from mixloop.errors import UserError
from mixloop.runner import (auto_precision, building, checkpointing, compile_mode, distribution,
                            evaluation, exporting, memory_plan, precision_setup, reporting, train_data, workdir)
from mixloop.runner.inner_loop import InnerLoop, Totals, numpy_totals
from mixloop.runner.state import RunState
from mixloop.runner.workdir import check_layout

# What a tool may give a run instead of the Trainer's own: (train, eval) datasets instead of
# build_datasets(), and train metrics added to the first objective's (the benchmark's).
TrainMetrics = Callable[[Any, Any], Mapping[str, tf.Tensor]]


class Run:
    """The run of `trainer` (a `mixloop.Trainer`, whose hooks it calls) as `config` says, writing
    into `workdir`; `datasets` and `train_metrics` are the tools' seams (above)."""

    def __init__(self, trainer: Any, config: ml_collections.ConfigDict, workdir: str, *,
                 datasets: Optional[tuple[tf.data.Dataset, Optional[tf.data.Dataset]]] = None,
                 train_metrics: Optional[TrainMetrics] = None):
        self.trainer, self.config, self.workdir = trainer, config, workdir
        self._datasets, self._train_metrics = datasets, train_metrics
        self.build_model = trainer.build_model
        self.input_fn = trainer.model_inputs
        self.loss_fn = trainer.compute_loss if train_metrics is None else self._loss_with_train_metrics
        # Lent to the Trainer as they are made (its hooks read them during the build).
        self.model: Optional[keras.Model] = None
        self.policy = self.objectives = self.eval_data = None

    def build(self) -> None:
        """Builds everything a run needs from the Trainer's hooks, in the module docstring's order.

        Raises:
          UserError: for what the hooks return that the run cannot use, each in one line.
        """
        config = self.config
        reporting.show_info_by_default()  # Progress from a script or notebook too.
        self.strategy = distribution.make_strategy(config.distribution)
        building.check_replica_batch(config, self.strategy.num_replicas_in_sync)
        # The budget's plan (micro-batches, compile mode) before anything reads them.
        self.config, self.memory_plan = memory_plan.planned(
            config, self.workdir, type(self.trainer), self.strategy.num_replicas_in_sync,
            own_data=self._datasets is None and self._train_metrics is None)
        config = self.config
        keras.utils.set_random_seed(config.seed)
        if config.deterministic:
            tf.config.experimental.enable_op_determinism()
        self.is_chief = distribution.is_chief(self.strategy)
        auto_precision.check_replicas(config, self.strategy.num_replicas_in_sync)
        # None until `compile_mode.choose` measures it (jit_compile="auto").
        self.jit_compile, compile_reason = compile_mode.configured(
            config.jit_compile, self.strategy.num_replicas_in_sync)
        self.policy, policy_reason = precision_setup.make_policy(config.precision.policy)
        logging.info("%s (%s); %s; train step %s", policy_reason, self.policy,
                     distribution.describe(self.strategy),
                     compile_reason if self.jit_compile is None
                     else f"{compile_mode.describe(self.jit_compile)} ({compile_reason})")
        with self.strategy.scope():
            self.model, self.float8_paths = building.placed_model(self.build_model, self.policy, config)
            objectives = self.trainer.build_objectives()
            check_objectives(objectives)  # One line for what the next lines could not read.
            self.objectives = with_loss_scales(
                objectives, lambda: precision_setup.make_loss_scale(config.precision, self.policy))
            building.store_trained_weights(self.model, self.objectives, self.policy, config)
            self.state = RunState({name: len(o.variables) for name, o in self.objectives.items()})
            self.train_step = TrainStep(
                model=self.model,
                objectives=self.objectives,
                loss_fn=self.loss_fn,
                policy=self.policy,
                accumulation_steps=config.train.accumulation_steps,
                clip_global_norm=config.train.clip_global_norm or None,
                jit_compile=compile_mode.step_with_xla(self.jit_compile),
                input_fn=self.input_fn,
                ema_decay=config.train.ema_decay,
                global_step=self.state.global_step,  # The step counts its updates here.
                batch_loss=config.train.batch_loss,
                overflow_retries=config.precision.overflow_retries,
                accumulation_dtype=config.train.accumulation_dtype,
            )
            self.evaluation = evaluation.Evaluation(self.model, self.policy, self.input_fn,
                                                    self.trainer.eval_metrics, config.eval.num_batches,
                                                    evaluation.micro_batches(config))
            building.check_objectives(self.objectives, self.model, config)
            # Before the data and the first trace, so compute_loss and build_datasets may read it.
            self.research_state = building.checked_extra_state(self.trainer.extra_state())
        with reporting.announced(f"Building the datasets ({type(self.trainer).__name__}.build_datasets)"):
            self._train_data, self.eval_data = self._datasets or self.trainer.build_datasets()
        train_data.check_batches(self._train_data.element_spec, config.train.batch_size)
        self.train_metric_names = self.train_step.metric_names(self._train_data.element_spec)
        reporting.check_metric_names(
            [metric for names in self.train_metric_names.values() for metric in names])
        self.inner_loop = InnerLoop(self.train_step, self.objectives, self.state,
                                    self.train_metric_names, config.train.max_consecutive_skips)
        self.set_jit_compile(self.jit_compile)
        # The default strategy's plain tf.data iterator goes into the checkpoint when TensorFlow
        # can serialize it; otherwise (another strategy, a Python generator) the iterator is made
        # on first use, fast-forwarded by the restored step (`train_iterator`).
        self._train_iterator = train_data.checkpointed_iterator(self.strategy, self.make_train_iterator)
        self.iterator_in_checkpoint = self._train_iterator is not None
        self.checkpointed = checkpointing.contents(
            self.model.variables, self.objectives, self.state, self.train_step.ema,
            self.research_state, self._train_iterator)
        check_layout(self.workdir)  # Before the checkpoint manager makes its folder.
        self.checkpoints = checkpointing.make_manager(
            self._checkpoint_workdir(), config.checkpoint.max_to_keep, **self.checkpointed)

    # ----- The door the outer loop drives. -----

    @property
    def global_step(self) -> tf.Variable:
        """Updates made so far in the run, skipped ones included."""
        return self.state.global_step

    def train_loop(self, num_steps: int) -> Totals:
        """Runs up to `num_steps` updates in one compiled call; returns the inner loop's totals as
        NumPy values. With jit_compile="auto" the first call decides the compile mode
        (`compile_mode.choose`) unless the controller did. A TensorFlow op error propagates."""
        compile_mode.choose(self)
        with compile_mode.calls_in(self.jit_compile):
            totals = self._train_loop(self.train_iterator, tf.constant(num_steps))
        return numpy_totals(totals)

    def evaluate(self) -> dict[str, float]:
        """The Trainer's `evaluate()`: by default `mean_eval_metrics()`."""
        return dict(self.trainer.evaluate())

    def mean_eval_metrics(self) -> dict[str, float]:
        """The mean of the Trainer's `eval_metrics` over the eval set's examples (or
        `config.eval.num_batches` batches of it), with the EMA weights when `config.train.ema_decay`
        is set; {} without eval data.

        Raises:
          UserError: when the eval data has no batch.
        """
        if self.eval_data is None:
            return {}
        with self.ema_weights():
            return self.evaluation.mean_metrics(self.eval_data)

    def ema_weights(self) -> contextlib.AbstractContextManager:
        """The EMA weights in the model for a `with` block (the trained ones without EMA)."""
        return evaluation.ema_swapped_in(self.train_step.ema, self.strategy)

    def random_states_kept(self) -> contextlib.AbstractContextManager:
        """Every random state a checkpoint holds put back as it was after a `with` block (see
        `Trainer.random_states_kept`)."""
        return evaluation.states_kept(evaluation.random_states(self.model, self.research_state),
                                      self.strategy)

    def export(self) -> Optional[str]:
        """Writes `workdir/model.keras` in float32 (`exporting.export`); its path, or None."""
        return exporting.export(self.build_model, self.model, self.float8_paths, self.ema_weights,
                                self.workdir)

    def restore(self) -> Optional[str]:
        """Restores the workdir's latest checkpoint (the chief's); returns its path, or None for a
        fresh run. A constant learning rate changed for the resumed run takes effect."""
        configured = checkpointing.configured_learning_rates(self.objectives)
        try:
            path = checkpointing.restore_latest(self.checkpoints, self.resume_directory())
        except UserError:
            changed = workdir.recorded_changes(self.workdir, self.config, STORAGE_DTYPES)
            if not changed:
                raise
            raise UserError(
                f"the checkpoint in {self.resume_directory()} was written with other storage "
                f"dtypes ({'; '.join(changed)}), which a checkpoint keeps: resume with the settings "
                "that wrote it, or use a new --workdir") from None
        checkpointing.put_back_learning_rates(configured)
        return path

    def restore_weights(self, path: str) -> None:
        """Restores model, optimizer, loss scale and counters from `path`, but not the data position."""
        tf.train.Checkpoint(**{name: value for name, value in self.checkpointed.items()
                               if name != "train_iterator"}).restore(path).expect_partial()

    def resume_directory(self) -> str:
        """The checkpoints every process resumes from: the chief's."""
        return os.path.join(self.workdir, "checkpoints")

    def num_train_batches(self) -> Optional[int]:
        """Batches in one pass over the train data, or None when it repeats (by config, or as built).

        Counted once by reading the data when tf.data does not know its length and it does not
        repeat (a repeated one of unknown length is found empty at its first update).

        Raises:
          UserError: when the data has no batch, or reading it fails (a generator that raises, a
            missing file).
        """
        cardinality = int(self._train_data.cardinality())
        batch_size = self.config.train.batch_size
        if cardinality == 0:
            raise UserError(errors.empty_train_data(batch_size))
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
                                f"is False): {errors.op_error_summary(error)}") from None
        if not count:
            raise UserError(errors.empty_train_data(batch_size))
        return count

    # ----- What the start's probes and the recoveries use. -----

    def compile_loops(self) -> None:
        """Makes the compiled inner loop, train step and eval step anew: they trace on their next
        call. After a layer moved to float32 (healing), as tracing reads the layers' dtypes."""
        self.train_step.recompile()
        self.inner_loop.forget()
        self.set_jit_compile(self.jit_compile)
        self.evaluation.forget()

    def set_jit_compile(self, jit_compile: Optional[compile_mode.Mode]) -> None:
        """Runs the train step in compile mode `jit_compile` (`compile_mode.MODES`) from the next
        loop on (each mode traced once; None, undecided, until `compile_mode.choose`)."""
        self.jit_compile = jit_compile
        self.train_step.jit_compile = compile_mode.step_with_xla(jit_compile)
        self._train_loop = self.inner_loop.compiled(jit_compile)

    def save_state(self, path: str) -> str:
        """Writes all a checkpoint holds, the data position too, to `path` (outside the run's
        checkpoints: the compile-mode probe's way back); returns the path `restore_state` reads."""
        return tf.train.Checkpoint(**self.checkpointed).write(path)

    def restore_state(self, path: str) -> None:
        """Puts back all that `save_state` wrote to `path`."""
        tf.train.Checkpoint(**self.checkpointed).restore(path).expect_partial()

    @property
    def train_element_spec(self) -> Any:
        """The structure of `tf.TensorSpec`s of a global train batch."""
        return self._train_data.element_spec

    @property
    def train_iterator(self) -> Iterator[Any]:
        """The run's one iterator over the train data, made on first use `global_step` batches in
        unless it came from the checkpoint.

        A run makes exactly one: every new iterator over a dataset that reshuffles each iteration
        starts another order, which would make the data depend on the strategy.
        """
        if self._train_iterator is None:
            self._train_iterator = self.make_train_iterator(int(self.global_step.numpy()))
        return self._train_iterator

    def restart_train_iterator(self) -> None:
        """Forgets the run's iterator (one a checkpoint cannot hold): the next use makes it again,
        `global_step` batches in, as a resume does."""
        self._train_iterator = None

    def make_train_iterator(self, start_step: int) -> Iterator[Any]:
        """An iterator over the train data, distributed, `start_step` global batches in; it repeats
        when `config.train.repeat_dataset` says so, otherwise it may run out."""
        return train_data.make_iterator(self.strategy, self._train_data,
                                        repeat=self.config.train.repeat_dataset,
                                        start_step=start_step,
                                        batch_size=self.config.train.batch_size)

    def _loss_with_train_metrics(self, outputs: Any, batch: Any) -> Any:
        """The Trainer's `compute_loss` with the `train_metrics` seam's metrics added to the first
        objective's."""
        losses = as_losses(tracing.hook(self.trainer.compute_loss)(outputs, batch), self.objectives)
        first = next(iter(losses))
        losses[first] = Loss(losses[first].value, losses[first].weight,
                             {**losses[first].metrics, **self._train_metrics(outputs, batch)})
        return losses if len(losses) > 1 else losses[first]

    def _checkpoint_workdir(self) -> str:
        """Where this process saves: the workdir on the chief, a worker's own folder elsewhere.
        Every worker of a multi-worker run must take part in each save; only the chief's are resumed."""
        if self.is_chief:
            return self.workdir
        return os.path.join(self.workdir, f"worker-{distribution.worker_index(self.strategy)}")
