"""What a run builds from the Trainer's hooks, each checked: the model under the policy (placed,
quantized, lightened), its objectives, and the extra state."""

from __future__ import annotations

import math
from typing import Any, Callable

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mixloop.config import split_auto
from mixloop.engine import compact_optimizer, float8_layers, layer_precision, lighter_model
from mixloop.engine.objective import Objective, trained_variables
from mixloop.engine.policy import Policy
from mixloop.errors import ConfigError, UserError


def placed_model(build_model: Callable[[], keras.Model], policy: Policy,
                 config: ml_collections.ConfigDict) -> tuple[keras.Model, list[str]]:
    """`build_model()` under `policy`, its float32 layers placed, the `precision.float8_layers`
    quantized (after the placement: a layer kept in float32 stays out of FP8) and the lighter
    settings applied, each logged in a line; returns the model and the paths of its FP8 layers."""
    with layer_precision.building_under(policy):
        model = build_model()
    placement = layer_precision.keep_float32_layers(
        model, policy, split_auto(config.precision.float32_layers)[1])
    placement += layer_precision.own_float32_layers(model, policy, placement)
    logging.info("%s", layer_precision.describe_placement(placement, policy))
    float8_paths = float8_layers.quantize_selected(model, policy, config.precision.float8_layers)
    float8_line = float8_layers.describe(model, config.precision.float8_layers)
    if float8_line:
        logging.info("%s", float8_line)
    recomputed = lighter_model.recompute(model, config.train.recompute)
    if recomputed:
        logging.info("Activations recomputed in the backward pass (train.recompute): %s",
                     layer_precision.shown_paths(recomputed, 6))
    return model, float8_paths


def store_trained_weights(model: keras.Model, objectives: dict[str, Objective], policy: Policy,
                          config: ml_collections.ConfigDict) -> None:
    """Applies `precision.master_weights` to the variables the `objectives` train, before their
    optimizers see them (engine/lighter_model.py); a variable no optimizer trains (a target
    network) keeps float32.

    Raises:
      ConfigError: for bfloat16 master weights under a policy that does not compute in bfloat16.
    """
    if config.precision.master_weights != lighter_model.BFLOAT16:
        return
    if policy.compute_dtype != tf.bfloat16:
        raise ConfigError(
            f"config.precision.master_weights='bfloat16' needs a policy computing in bfloat16, "
            f"but precision.policy is {policy.keras_name}: set "
            "--config.precision.policy=mixed_bfloat16, or master_weights='float32'")
    trained = trained_variables(objectives)
    moved = lighter_model.store_weights_in_bfloat16(model, trained)
    total = sum(math.prod(v.shape) for v in trained)
    logging.info("Weights stored in bfloat16 (precision.master_weights): %s of %s parameters, "
                 "each update rounded stochastically; layers computing in float32 read them "
                 "cast up", f"{moved:,}", f"{total:,}")


def check_objectives(objectives: dict[str, Objective], model: keras.Model,
                     config: ml_collections.ConfigDict) -> None:
    """What `build_objectives()` returned, against the model and the config: every trained
    variable is the model's, every optimizer can store what `optimizer.state_dtype` and
    `precision.master_weights` ask, and an objective that would never update is named.

    Raises:
      UserError: naming the objective and the way out.
    """
    _check_objective_variables(objectives, model)
    _check_compact_optimizers(objectives, config)
    _warn_of_idle_objectives(objectives, config.train.num_steps)


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


def checked_extra_state(state: Any) -> dict[str, Any]:
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


def check_replica_batch(config: ml_collections.ConfigDict, num_replicas: int) -> None:
    """Each replica's slice of the batch must split into `accumulation_steps` micro-batches.

    Raises:
      ConfigError: naming the batch size, the replicas and the micro-batches.
    """
    train = config.train
    if train.batch_size % (num_replicas * train.accumulation_steps):
        raise ConfigError(
            f"config.train.batch_size={train.batch_size} does not split into {num_replicas} "
            f"replica(s) x {train.accumulation_steps} micro-batches (train.accumulation_steps)")
