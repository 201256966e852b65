"""The doctor's passes (doctor/passes.py): the step's own micro-step under the doctor's tape, every
layer call recorded, given up on a stop."""

import numpy as np
import pytest
import tensorflow as tf
import tiny_experiment

from mixloop import interrupts
from mixloop.doctor import passes
from mixloop.engine.layer_precision import named_layers


def tiny_run(workdir):
    config = tiny_experiment.get_config()
    config.model.dropout = 0.0  # The passes run noise layers in inference mode; the step does not.
    config.jit_compile = False
    return tiny_experiment.TinyTrainer(config, str(workdir)).run


def test_a_pass_records_every_layer_and_takes_the_steps_own_gradients(tmp_path):
    run = tiny_run(tmp_path)
    layers = list(named_layers(run.model).values())
    net = passes.Net(run.model, run.policy, layers, run.objectives["model"].variables)
    dtypes = {index: layer.compute_dtype for index, layer in enumerate(layers)}
    one_pass = passes.traced_pass(run, "model", net, dtypes, lambda: False)
    batch = next(run.make_train_iterator(0))
    state = [v.numpy() for v in run.model.non_trainable_variables]
    measured = one_pass(batch, 1024.0, state)
    dense = [index for index, layer in enumerate(layers) if layer.name in ("dense", "logits")]
    assert all(measured.calls[index][0].num_inputs == 1 for index in dense)
    assert all(measured.calls[index][0].max_abs_output > 0 for index in dense)
    grads, _ = run.train_step.micro_step(batch, tf.constant(1, tf.int64))
    # The same gradient the step's micro-step takes, to float16 rounding at a different scale.
    for ours, steps in zip(measured.grads, grads["model"].derivatives):
        np.testing.assert_allclose(ours, steps.numpy(), rtol=2e-2, atol=1e-4)


def test_a_pass_gives_up_on_a_stop_before_it_runs(tmp_path):
    run = tiny_run(tmp_path)
    layers = list(named_layers(run.model).values())
    net = passes.Net(run.model, run.policy, layers, run.objectives["model"].variables)
    one_pass = passes.traced_pass(run, "model", net, {}, lambda: True)
    with pytest.raises(interrupts.ProbeStopped):
        one_pass(next(run.make_train_iterator(0)), 1.0, [])
