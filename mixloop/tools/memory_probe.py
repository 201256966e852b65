"""One memory probe of the memory budget's plan (runner/memory_plan.py), as a process of its own:
`python -m mixloop.tools.memory_probe REQUEST` runs the pickled config of REQUEST in a workdir beside
it and writes what it measured to result.json there. Bad input in the probe's run (its own) is one
`error:` line and exit status 2, which the planner repeats."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys

import ml_collections
import tensorflow as tf

from absl import logging

from mixloop import cli, errors
from mixloop.doctor import activations, memory
from mixloop.engine import tracing
from mixloop.engine.micro_step import forward
from mixloop.runner import compile_mode

TRACED_EXAMPLES = 2  # The least micro-batch the layers' activations are traced at.


def measure(request: str) -> None:
    """Runs the request's config, then writes its peak (read before anything else runs), its
    persistent state, compile mode, seconds per update and, when asked, the layers'
    activations."""
    with open(request, "rb") as file:
        asked = pickle.load(file)
    sys.path[:] = asked["sys_path"]
    config = ml_collections.ConfigDict(asked["config"])
    trainer = cli.build_trainer(config, os.path.join(os.path.dirname(request), "workdir"))
    trainer.train()
    run = trainer.run
    peak = memory.peak_bytes()
    timed = asked["timed_updates"]
    try:  # Compiled by train(): only the updates are timed.
        seconds = compile_mode.seconds_of_loop(run, timed) / timed
    except tf.errors.OutOfRangeError:  # The train data ended.
        seconds = 0.0
    layers = traced_layers(run, config) if asked["layers"] else []
    with open(os.path.join(os.path.dirname(request), "result.json"), "w") as file:
        json.dump({"peak": peak, "state_bytes": memory.persistent_state(run).total_bytes,
                   "jit_compile": run.jit_compile, "seconds_per_update": seconds,
                   "layers": [dataclasses.asdict(layer) for layer in layers]}, file)


def traced_layers(run, config: ml_collections.ConfigDict) -> list[activations.LayerActivations]:
    """The layers' activations per example from a trace of the forward on a micro-batch of at
    least two examples (with one, a weight or a mask shaped [1, ...] would look like an
    activation); none, logged, for a batch it cannot trace that way (a ragged or sparse input, a
    model with a fixed batch size): the plan then recomputes nothing."""
    slices = run.strategy.num_replicas_in_sync * config.train.accumulation_steps
    micro_batch = max(config.train.batch_size // slices, TRACED_EXAMPLES)
    try:
        spec = tf.nest.map_structure(
            lambda s: tf.TensorSpec([micro_batch, *s.shape[1:]], s.dtype) if s.shape.rank else s,
            run.train_element_spec)
        return activations.by_layer(
            run.model,
            lambda batch: forward(run.model, run.policy, tracing.hook(run.input_fn)(batch),
                                  training=True),
            spec, micro_batch)
    except Exception as error:  # Only the recompute candidates are lost.
        logging.warning("The memory probe could not trace the layers' activations (%s): the plan "
                        "recomputes no layer", errors.message_of(error) if isinstance(
                            error, errors.UserError) else f"{type(error).__name__}: {error}")
        return []


if __name__ == "__main__":
    cli.guarded(lambda: measure(sys.argv[1]))
