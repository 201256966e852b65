"""Checkpoints of a run: what is saved (weights, optimizer, loss scale, counters, data position) and
restoring it with a clear refusal when the workdir's checkpoint does not fit the model."""

from __future__ import annotations

import os
from typing import Optional

import tensorflow as tf
from absl import logging

from mixloop.errors import UserError


def make_manager(
    workdir: str, max_to_keep: int, **trackables: object
) -> tf.train.CheckpointManager:
    """A `CheckpointManager` over `workdir/checkpoints` saving every trackable passed by keyword."""
    checkpoint = tf.train.Checkpoint(**trackables)
    return tf.train.CheckpointManager(
        checkpoint, os.path.join(workdir, "checkpoints"), max_to_keep=max_to_keep
    )


def restore_latest(manager: tf.train.CheckpointManager, directory: str) -> Optional[str]:
    """Restores the newest checkpoint in `directory` (the chief's, for every worker); returns its path.

    Raises:
      UserError: when the checkpoint holds variables of other shapes or counts than this run's.
    """
    path = tf.train.latest_checkpoint(directory)
    if path is None:
        return None
    try:
        manager.checkpoint.restore(path).assert_consumed()
    except (AssertionError, ValueError, tf.errors.OpError) as error:
        detail = str(error).strip().splitlines()[0][:200]
        raise UserError(
            f"the checkpoint {path} does not match this run's model, objectives (optimizers, loss "
            f"scales), EMA (train.ema_decay on or off), extra_state() or data "
            f"pipeline ({detail}); use a new --workdir or the config that wrote it"
        ) from None
    logging.info("Restored %s", path)
    return path
