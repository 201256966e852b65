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

from mixloop import cli
from mixloop.doctor import activations, memory
from mixloop.engine.micro_step import forward
from mixloop.runner import compile_mode


def measure(request: str) -> None:
    """Runs the request's config, then writes its peak (read before anything else runs), its
    persistent state, compile mode, seconds per update and layers' activations."""
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
    micro_batch = config.train.batch_size // (run.strategy.num_replicas_in_sync
                                              * config.train.accumulation_steps)
    spec = tf.nest.map_structure(lambda s: tf.TensorSpec([micro_batch, *s.shape[1:]], s.dtype),
                                 run.train_element_spec)
    layers = activations.by_layer(
        run.model, lambda batch: forward(run.model, run.policy, run.input_fn(batch), training=True),
        spec, micro_batch)
    with open(os.path.join(os.path.dirname(request), "result.json"), "w") as file:
        json.dump({"peak": peak, "state_bytes": memory.persistent_state(run).total_bytes,
                   "jit_compile": run.jit_compile, "seconds_per_update": seconds,
                   "layers": [dataclasses.asdict(layer) for layer in layers]}, file)


if __name__ == "__main__":
    cli.guarded(lambda: measure(sys.argv[1]))
