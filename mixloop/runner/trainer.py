"""The Trainer: the class a research model subclasses, holding its hooks and the few names the
framework lends it.

A subclass writes plain methods: `build_model`, `build_datasets`, `compute_loss`, and optionally
`eval_metrics`, `build_optimizer`, `model_inputs`, `evaluate`, and for research loops
`build_objectives`, `actions` and `extra_state`. What builds, compiles, probes, checkpoints,
iterates and exports is its run's (runner/run.py, `trainer.run`), so the subclass's own attributes
cannot collide with the framework's: the names the framework lends it (`LENT`) are read-only, and a
subclass that defines one is refused at construction, in one line.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import keras
import ml_collections
import tensorflow as tf

from mixloop.engine import tracing
from mixloop.engine.loss import as_losses
from mixloop.engine.micro_step import Batch, default_input_fn
from mixloop.engine.objective import SINGLE, Objective
from mixloop.errors import UserError
from mixloop.runner import controller, optimizers, reporting
from mixloop.runner.actions import Action
from mixloop.runner.run import Run, TrainMetrics

# The names the framework lends a Trainer (read from its run), and what each is.
LENT = {
    "config": "the run's config",
    "workdir": "the run's folder",
    "model": "the model build_model() returned, as the run placed it",
    "policy": "the run's precision policy (a mixloop.Policy)",
    "objectives": "the objectives build_objectives() returned, each with its loss scale",
    "eval_data": "the eval dataset build_datasets() returned",
    "global_step": "the run's count of updates made, skipped ones included (an int64 variable)",
}
# The framework's own methods and attributes, which a subclass may not replace either.
FRAMEWORK = ("run", "train", "ema_weights", "random_states_kept")


class _Lent:
    """A name the framework lends a Trainer: read from its run; assigning it is refused in one line."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = LENT[name]

    def __get__(self, trainer: Optional["Trainer"], owner: type) -> Any:
        return self if trainer is None else getattr(trainer.run, self.name)

    def __set__(self, trainer: "Trainer", value: Any) -> None:
        raise _clash(type(trainer), self.name, "assigns")


class Trainer:
    """Trains `build_model()` on `build_datasets()` as `config` says, writing into `workdir`.

    `datasets` and `train_metrics` are for tools that run an experiment on data or metrics of their
    own (the benchmark): (train, eval) datasets to use instead of `build_datasets()`, and a
    function of (outputs, batch) returning train metrics added to the first objective's.

    Raises:
      UserError: when the subclass defines a name the framework lends (`LENT`) or owns, or when
        a hook returns what the run cannot use, each in one line.
    """

    config = _Lent()
    workdir = _Lent()
    model = _Lent()
    policy = _Lent()
    objectives = _Lent()
    eval_data = _Lent()
    global_step = _Lent()

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
                 datasets: Optional[tuple[tf.data.Dataset, Optional[tf.data.Dataset]]] = None,
                 train_metrics: Optional[TrainMetrics] = None):
        _check_names(type(self))
        self.__run = Run(self, config, workdir, datasets=datasets, train_metrics=train_metrics)
        self.__run.build()

    @property
    def run(self) -> Run:
        """The run: what the framework builds from this Trainer's hooks and drives."""
        return self.__run

    @run.setter
    def run(self, value: Any) -> None:
        raise _clash(type(self), "run", "assigns")

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
        return controller.train(self.run)

    def ema_weights(self) -> contextlib.AbstractContextManager:
        """The weights eval uses in the model for a `with` block: the EMA weights with
        `config.train.ema_decay` set, the trained ones otherwise."""
        return self.run.ema_weights()

    def random_states_kept(self) -> contextlib.AbstractContextManager:
        """Puts every random state a checkpoint holds back as it was after the `with` block: the
        state of each Keras `SeedGenerator` in the model (dropout's, `keras.random.normal(...,
        seed=self.seed_generator)` in a `call`) and of each `tf.random.Generator` in
        `extra_state()`.

        The controller runs evaluation and the eval-time actions inside it: a model that draws
        noise in `call(training=False)` (a VAE's sample, a GAN's noise) would otherwise advance the
        run's random sequence at every eval, so a run stopped at step N (which evaluates there) and
        resumed would draw other noise from then on than one that ran straight through.
        """
        return self.run.random_states_kept()

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

    def evaluate(self) -> dict[str, float]:
        """Returns the whole eval summary, {name: float}: by default the mean of `eval_metrics` over
        the eval set's examples (or `config.eval.num_batches` batches of it), with the EMA weights
        when `config.train.ema_decay` is set, each batch counting by its number of examples."""
        return self.run.mean_eval_metrics()

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


def _check_names(trainer_class: type) -> None:
    """Refuses a subclass that defines a name the framework lends or owns.

    Raises:
      UserError: naming the class, the name and what the framework keeps there.
    """
    for cls in trainer_class.__mro__:
        if cls is Trainer:
            return
        for name in (*LENT, *FRAMEWORK):
            if name in vars(cls):
                raise _clash(cls, name, "defines")


def _clash(trainer_class: type, name: str, how: str) -> UserError:
    """The one line for a subclass that `how` ("defines", "assigns") the framework's `name`."""
    what = LENT.get(name, f"mixloop's own Trainer.{name}")
    return UserError(f"{trainer_class.__name__} {how} {name!r}, a name mixloop's Trainer keeps for "
                     f"{what}; give yours another name (e.g. self.my_{name})")
