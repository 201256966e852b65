"""An objective: one loss, the variables it trains, the optimizer that trains them, its own loss
scale and how often it is updated.

A model with one loss has one objective, the whole model (named `model`). A GAN has two, the
generator and the discriminator, whose losses come from one forward pass. Each objective's update
is applied or skipped on its own (PyTorch's per-optimizer skip) and, in float16, its loss scale
backs off on its own overflows only (apex's `num_losses`): a generator overflow does not throw away
the discriminator's update. An objective with `every_steps=N` (a WGAN's generator, updated once per
N critic updates) is updated on steps N, 2N, ... only.

An update that is not a gradient (a momentum target network following the online one, weight
clipping, a norm projection) is the objective's `after_update`: traced into the compiled step, it
runs once per applied update, right after the optimizer, on the float32 master weights.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Optional

import keras
import tensorflow as tf

from mixloop.engine import tracing
from mixloop.engine.loss_scale import LossScale
from mixloop.errors import UserError, described

SINGLE = "model"  # The name of the one objective of a model with one loss.


@dataclasses.dataclass
class Objective:
    """One loss to minimise.

    Attributes:
      layer: the Keras layer or model whose trainable variables this objective trains; its
        non-trainable variables (e.g. BatchNorm statistics) are rolled back when its update is skipped.
      optimizer: the Keras optimizer that applies this objective's updates.
      loss_scale: its loss scale; None takes the one `config.precision` describes (the Trainer) or
        no scaling (a bare `TrainStep`).
      every_steps: updated on the steps that are multiples of it only (counting the step number
        after the update: 3 updates it at steps 3, 6, 9, ...). On the other steps its loss is still
        computed from the shared forward pass (and reported), but its gradient is not: its
        variables, optimizer (iterations, slots, schedule), loss scale, EMA and skip counters stay
        as they are, and its layer's non-trainable state keeps what the forward pass did to it.
      after_update: None, or a function of no arguments that the compiled step calls once per
        applied update of this objective, right after the optimizer applied it and before the EMA
        (`train.ema_decay`) advances: never per micro-batch, never on a skipped update, never for
        a retried attempt (`precision.overflow_retries`). It writes with `variable.assign(...)`
        and runs outside every layer call, so its reads are the master weights as stored (float32,
        or bfloat16 with `precision.master_weights="bfloat16"`: cast them to the dtype of what it
        assigns, e.g. a target network's, which no optimizer trains and which stays float32;
        inside a 16-bit layer's `call` Keras would autocast them), and in cross-replica context:
        each assign writes one value to every replica. What it writes must be variables
        made beforehand that a checkpoint holds (the model's, or `Trainer.extra_state`'s), for a
        resume to be bit-identical. For a schedule, read `optimizer.iterations` (the applied
        updates, this one included).
    """

    layer: keras.layers.Layer
    optimizer: keras.optimizers.Optimizer
    loss_scale: Optional[LossScale] = None
    every_steps: int = 1
    after_update: Optional[Callable[[], object]] = None

    @property
    def variables(self) -> list:
        """The variables the optimizer updates (the float32 master weights)."""
        return list(self.layer.trainable_variables)

    @property
    def state(self) -> list:
        """Non-trainable variables the forward pass may update, restored on a skipped update."""
        return list(self.layer.non_trainable_variables)


def check_objectives(objectives: Mapping[str, Objective]) -> None:
    """Refuses what would fail later, deep in Keras or TensorFlow, in one line.

    Raises:
      UserError: for no objective, a name that is not an identifier (names become TensorBoard tags
        and variable names), something that is not an `Objective`, an optimizer that is not a
        Keras optimizer, one optimizer in two, an
        objective with no trainable variable, a variable two objectives train, an
        `every_steps` that is not a whole number of at least 1, or an `after_update` that is not
        callable.
    """
    if not objectives:
        raise UserError("build_objectives() returned no objective; return at least one")
    optimizers, trainers = {}, {}
    for name, objective in objectives.items():
        if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z_]\w*", name)):
            raise UserError(f"objective name {name!r} is not allowed: use letters, digits and '_' "
                            f"(it becomes TensorBoard tags such as loss/{name})")
        if not isinstance(objective, Objective):
            raise UserError(f"objective {name!r} is a {type(objective).__name__}, not a "
                            f"mixloop.Objective(layer, optimizer)")
        every = objective.every_steps
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UserError(f"objective {name!r} has every_steps={every!r}; it must be a whole "
                            f"number of at least 1 (1: updated on every step)")
        if objective.after_update is not None and not callable(objective.after_update):
            raise UserError(f"objective {name!r} has after_update={objective.after_update!r}; it "
                            f"must be a function of no arguments (or None)")
        if not isinstance(objective.optimizer, keras.optimizers.Optimizer):
            raise UserError(f"objective {name!r} has optimizer={objective.optimizer!r}, not a Keras "
                            f"optimizer; build_optimizer() (or the Objective) must return one, e.g. "
                            f"mixloop.build_optimizer(self.config)")
        shared = optimizers.setdefault(id(objective.optimizer), name)
        if shared != name:
            raise UserError(f"objectives {shared!r} and {name!r} share one optimizer instance; give "
                            f"each its own (an optimizer keeps per-variable state)")
        if not objective.variables:
            raise UserError(f"objective {name!r} has no trainable variables: its layer "
                            f"{objective.layer.name!r} holds none that train (it has no weights, is "
                            f"frozen with trainable=False, or is not built yet); give it a built "
                            f"layer whose weights train")
        for variable in objective.variables:
            other = trainers.setdefault(id(variable), name)
            if other != name:
                raise UserError(
                    f"objectives {other!r} and {name!r} both train {variable.path}: a variable "
                    f"belongs to one objective (two would each apply their own optimizer's update "
                    f"to it every step); give them layers that share no weights, or make one "
                    f"objective whose loss adds both")


def with_loss_scales(objectives: dict[str, Objective],
                     make_loss_scale: Callable[[], LossScale]) -> dict[str, Objective]:
    """The `objectives`, each with a loss scale: its own, or a fresh one from `make_loss_scale()`."""
    return {name: objective if objective.loss_scale is not None
            else dataclasses.replace(objective, loss_scale=make_loss_scale())
            for name, objective in objectives.items()}



def post_update_hook(name: str, objective: Objective) -> Optional[Callable[[], object]]:
    """Objective `name`'s `after_update` as the step calls it, converted by AutoGraph while traced;
    None without one.

    Raises (when called):
      UserError: when `after_update` raises, naming the objective, the error and the line of the
        experiment's code it came from.
    """
    if objective.after_update is None:
        return None
    after_update = tracing.hook(objective.after_update)

    def called():
        try:
            return after_update()
        except UserError:
            raise
        except Exception as error:  # The experiment's code: whatever it raises is its own.
            cast = ("; cast the bfloat16 master weights it reads to the dtype it assigns "
                    "(tf.cast(w, t.dtype))" if "bfloat16" in str(error) else "")
            raise UserError(f"the after_update of objective {name!r} failed: {described(error)}; "
                            "it is a function of no arguments that assigns variables (see "
                            f"mixloop.Objective){cast}") from None

    return called


def trained_variables(objectives: Mapping[str, Objective]) -> list:
    """Every variable the objectives' optimizers train, objective by objective."""
    return [v for objective in objectives.values() for v in objective.variables]


def due_at(objectives: Mapping[str, Objective], step_number: tf.Tensor) -> dict[str, Optional[tf.Tensor]]:
    """Per objective, whether update `step_number` is one of its (a bool tensor), or None for an
    objective updated on every step (no conditional in the graph)."""
    return {name: None if objective.every_steps == 1
            else tf.equal(step_number % objective.every_steps, 0)
            for name, objective in objectives.items()}
