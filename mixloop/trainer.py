"""The Trainer: the base class a research model subclasses, owning tracing, the loops and the workdir.

A subclass writes plain methods (`build_model`, `build_datasets`, `compute_loss`, optionally
`eval_metrics`, `build_optimizer`, `model_inputs`). The base class builds them under the precision
policy, compiles `steps_per_loop` train steps into one `tf.function` (the inner loop), and runs the
outer loop in Python between those calls: progress lines, TensorBoard, evaluation, checkpoints,
interruption and export.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any, Optional

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mixloop import checkpointing, distribution, layer_precision, optimizers, precision_setup, reporting
from mixloop.step import Batch, TrainStep, default_input_fn

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Trainer:
    """Trains `build_model()` on `build_datasets()` as `config` says, writing into `workdir`."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        self.config = config
        self.workdir = workdir
        self.strategy = distribution.make_strategy(config.distribution)
        keras.utils.set_random_seed(config.seed)
        if config.deterministic:
            tf.config.experimental.enable_op_determinism()
        self.is_chief = distribution.is_chief(self.strategy)
        self.policy, policy_reason = precision_setup.make_policy(config.precision.policy)
        logging.info("%s (%s); %s", policy_reason, self.policy, distribution.describe(self.strategy))
        with self.strategy.scope():
            self.model = layer_precision.build_model(
                self.build_model, self.policy, config.precision.float32_layers
            )
            self.optimizer = self.build_optimizer()
            self.loss_scale = precision_setup.make_loss_scale(config.precision, self.policy)
            self.train_step = TrainStep(
                model=self.model,
                optimizer=self.optimizer,
                loss_fn=self.compute_loss,
                policy=self.policy,
                loss_scale=self.loss_scale,
                accumulation_steps=config.train.accumulation_steps,
                clip_global_norm=config.train.clip_global_norm or None,
                jit_compile=config.jit_compile,
                input_fn=self.model_inputs,
            )
            self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
            self.skipped_total = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_total")
        self._train_data, self.eval_data = self.build_datasets()
        # One replica: the iterator itself is checkpointed. TensorFlow cannot checkpoint a
        # distributed iterator, so several replicas fast-forward the data by the restored step.
        self._checkpoints_iterator = self.strategy.num_replicas_in_sync == 1
        self.train_iterator = self._make_train_iterator(0) if self._checkpoints_iterator else None
        self.checkpoints = checkpointing.make_manager(
            self._checkpoint_workdir(),
            config.checkpoint.max_to_keep,
            model_variables=list(self.model.variables),
            optimizer_variables=list(self.optimizer.variables),
            loss_scale=self.loss_scale,
            global_step=self.global_step,
            skipped_total=self.skipped_total,
            **({"train_iterator": self.train_iterator} if self._checkpoints_iterator else {}),
        )
        self._stop_signal: Optional[int] = None

    # ----- What a research subclass writes. -----

    def build_model(self) -> keras.Model:
        """Returns a built Keras model (called under the run's dtype policy)."""
        raise NotImplementedError("a Trainer subclass must define build_model()")

    def build_datasets(self) -> tuple[tf.data.Dataset, Optional[tf.data.Dataset]]:
        """Returns (train, eval or None): datasets of global batches; train is repeated by the framework."""
        raise NotImplementedError("a Trainer subclass must define build_datasets()")

    def compute_loss(self, outputs: Any, batch: Batch) -> Any:
        """Returns a float32 scalar mean loss, or a (loss_sum, weight) pair, from float32 outputs."""
        raise NotImplementedError("a Trainer subclass must define compute_loss()")

    def eval_metrics(self, outputs: Any, batch: Batch) -> dict[str, tf.Tensor]:
        """Returns the eval metrics of one batch; each is averaged over the eval batches."""
        loss = self.compute_loss(outputs, batch)
        if isinstance(loss, (tuple, list)):
            loss = loss[0] / loss[1]
        return {"loss": loss}

    def build_optimizer(self) -> keras.optimizers.Optimizer:
        """Returns the optimizer; by default the one `config.optimizer` names."""
        return optimizers.build_optimizer(self.config.optimizer, self.config.train.num_steps)

    def model_inputs(self, batch: Batch) -> Any:
        """Returns what the model is called on; by default the first element of an (x, y) tuple."""
        return default_input_fn(batch)

    # ----- What the framework owns. -----

    @tf.function
    def _train_loop(self, iterator, num_steps: tf.Tensor) -> dict[str, tf.Tensor]:
        """The inner loop: `num_steps` train steps in one graph, returning sums for reporting."""
        totals = {
            "loss_sum": tf.constant(0.0), "num_finite_loss": tf.constant(0.0),
            "grad_norm_sum": tf.constant(0.0), "num_applied": tf.constant(0.0),
        }
        for _ in tf.range(num_steps):
            metrics = self.train_step(next(iterator))
            finite_loss = tf.math.is_finite(metrics["loss"])
            applied = tf.cast(metrics["applied"], tf.float32)
            totals = {
                "loss_sum": totals["loss_sum"] + tf.where(finite_loss, metrics["loss"], 0.0),
                "num_finite_loss": totals["num_finite_loss"] + tf.cast(finite_loss, tf.float32),
                "grad_norm_sum": totals["grad_norm_sum"]
                + tf.where(metrics["applied"], metrics["grad_norm"], 0.0),
                "num_applied": totals["num_applied"] + applied,
            }
            self.global_step.assign_add(1)
            self.skipped_total.assign_add(1 - tf.cast(metrics["applied"], tf.int64))
        return totals

    @tf.function
    def _eval_step(self, batch: Batch) -> dict[str, tf.Tensor]:
        inputs = self.policy.cast_to_compute(self.model_inputs(batch))
        outputs = self.policy.cast_to_output(self.model(inputs, training=False))
        return {name: tf.cast(value, tf.float32) for name, value in self.eval_metrics(outputs, batch).items()}

    def evaluate(self) -> dict[str, float]:
        """Mean of `eval_metrics` over the eval set (or `config.eval.num_batches` of it)."""
        if self.eval_data is None:
            return {}
        data = self.eval_data
        if self.config.eval.num_batches:
            data = data.take(self.config.eval.num_batches)
        sums, count = {}, 0
        for batch in data:
            for name, value in self._eval_step(batch).items():
                sums[name] = sums.get(name, 0.0) + float(value)
            count += 1
        return {name: total / count for name, total in sums.items()} if count else {}

    def restore(self) -> Optional[str]:
        """Restores the workdir's latest checkpoint; returns its path, or None for a fresh run."""
        return checkpointing.restore_latest(self.checkpoints, self._resume_directory())

    def train(self) -> dict[str, float]:
        """Runs (or resumes) training to `config.train.num_steps` updates; returns the last metrics.

        On SIGINT or SIGTERM it finishes the current loop, saves a checkpoint and returns early.
        """
        self.restore()
        if self.is_chief:
            self._write_config()
        num_steps = self.config.train.num_steps
        writer = reporting.MetricWriter(self.workdir, enabled=self.is_chief)
        step = int(self.global_step.numpy())
        if not self._checkpoints_iterator:
            self.train_iterator = self._make_train_iterator(step)
        if step >= num_steps:
            logging.info("Already trained to step %d of %d; nothing to do.", step, num_steps)
        metrics: dict[str, float] = {}
        interval = _Interval(step, self.skipped_total.numpy())
        previous_handlers = self._catch_stop_signals()
        try:
            while step < num_steps and self._stop_signal is None:
                started = time.perf_counter()
                totals = self._train_loop(self.train_iterator, tf.constant(self._loop_length(step)))
                interval.add({name: float(value) for name, value in totals.items()},
                             time.perf_counter() - started)
                step = int(self.global_step.numpy())
                if self._is_due(step, self.config.train.log_every_steps):
                    metrics = self._report_train(writer, step, interval)
                    interval = _Interval(step, self.skipped_total.numpy())
                if self._is_due(step, self.config.eval.every_steps) and self.eval_data is not None:
                    metrics.update(self._report_eval(writer, step))
                if self._is_due(step, self.config.checkpoint.every_steps):
                    self.checkpoints.save(checkpoint_number=step)
        finally:
            _restore_signal_handlers(previous_handlers)
        if self.checkpoints.latest_checkpoint != self._checkpoint_path(step):
            self.checkpoints.save(checkpoint_number=step)
        if self._stop_signal is not None:
            logging.info(
                "Stopped by %s at step %d; checkpoint saved in %s. Run the same command to resume.",
                signal.Signals(self._stop_signal).name, step, self.checkpoints.directory,
            )
            return metrics
        if self.is_chief:
            self.export()
        return metrics

    def export(self) -> str:
        """Saves the model in float32 as `workdir/model.keras` for inference; returns the path."""
        with layer_precision.global_dtype_policy(precision_setup.Policy.from_string("float32")):
            export_model = self.build_model()
        export_model.set_weights(self.model.get_weights())
        path = os.path.join(self.workdir, "model.keras")
        export_model.save(path)
        logging.info("Exported the float32 model to %s", path)
        return path

    # ----- Private helpers of the outer loop. -----

    def _loop_length(self, step: int) -> int:
        """Steps until the next loop boundary: steps_per_loop, or sooner at a log/eval/checkpoint step."""
        c = self.config
        cadences = (c.train.steps_per_loop, c.train.log_every_steps, c.eval.every_steps,
                    c.checkpoint.every_steps)
        until = [every - step % every for every in cadences if every]
        return min(until + [c.train.num_steps - step])

    def _is_due(self, step: int, every: int) -> bool:
        return step == self.config.train.num_steps or (every > 0 and step % every == 0)

    def _make_train_iterator(self, start_step: int):
        """An iterator over the repeated train data, distributed, `start_step` global batches in."""
        data = self._train_data.repeat().skip(start_step).prefetch(tf.data.AUTOTUNE)
        return iter(distribution.distribute(self.strategy, lambda: data, self.config.train.batch_size))

    def _checkpoint_workdir(self) -> str:
        """Where this process saves: the workdir on the chief, a worker's own folder elsewhere.

        Every worker of a multi-worker run must take part in each save; only the chief's are resumed.
        """
        if self.is_chief:
            return self.workdir
        return os.path.join(self.workdir, f"worker-{distribution.worker_index(self.strategy)}")

    def _resume_directory(self) -> str:
        return os.path.join(self.workdir, "checkpoints")

    def _checkpoint_path(self, step: int) -> str:
        return os.path.join(self.checkpoints.directory, f"ckpt-{step}")

    def _report_train(self, writer: reporting.MetricWriter, step: int, interval: "_Interval") -> dict:
        scalars = interval.summary(step, self.skipped_total.numpy(), self.config.train.batch_size)
        scalars["loss_scale"] = float(self.loss_scale.scale.numpy())
        scalars["learning_rate"] = float(keras.ops.convert_to_numpy(self.optimizer.learning_rate))
        writer.write("train", step, scalars)
        reporting.log_progress(step, self.config.train.num_steps, scalars)
        return scalars

    def _report_eval(self, writer: reporting.MetricWriter, step: int) -> dict:
        metrics = self.evaluate()
        writer.write("eval", step, metrics)
        reporting.log_eval(step, metrics)
        return {f"eval_{name}": value for name, value in metrics.items()}

    def _write_config(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        with open(os.path.join(self.workdir, "config.json"), "w") as f:
            f.write(self.config.to_json_best_effort(indent=2, sort_keys=True) + "\n")

    def _catch_stop_signals(self) -> dict:
        """Turns SIGINT/SIGTERM into a request to stop at the next loop boundary."""

        def request_stop(signum, frame):
            self._stop_signal = signum

        try:
            return {sig: signal.signal(sig, request_stop) for sig in _STOP_SIGNALS}
        except ValueError:  # Not the main thread: signals stay with their owner.
            return {}


def _restore_signal_handlers(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


class _Interval:
    """Train statistics summed since the last progress line."""

    def __init__(self, step: int, skipped_total: int):
        self.start_step, self.start_skipped = step, int(skipped_total)
        self.seconds = 0.0
        self.totals: dict[str, float] = {}

    def add(self, totals: dict[str, float], seconds: float) -> None:
        """Adds one inner loop's sums and the seconds it took (evaluation and checkpoints excluded)."""
        self.seconds += seconds
        for name, value in totals.items():
            self.totals[name] = self.totals.get(name, 0.0) + value

    def summary(self, step: int, skipped_total: int, batch_size: int) -> dict[str, float]:
        steps_per_sec = (step - self.start_step) / max(self.seconds, 1e-9)
        t = self.totals
        return {
            "loss": t["loss_sum"] / t["num_finite_loss"] if t["num_finite_loss"] else math.nan,
            "grad_norm": t["grad_norm_sum"] / t["num_applied"] if t["num_applied"] else math.nan,
            "skipped_steps": float(int(skipped_total) - self.start_skipped),
            "skipped_total": float(skipped_total),
            "steps_per_sec": steps_per_sec,
            "examples_per_sec": steps_per_sec * batch_size,
        }
