"""What a run builds from the hooks (runner/building.py), each checked in one line."""

import keras
import ml_collections
import pytest
import tensorflow as tf

import mixloop
from mixloop.errors import ConfigError, UserError
from mixloop.runner import building


def test_extra_state_must_be_a_dict_a_checkpoint_can_hold():
    assert building.checked_extra_state({"count": tf.Variable(0)})["count"].numpy() == 0
    with pytest.raises(UserError, match=r"extra_state\(\)\['count'\] is a int, which a checkpoint"):
        building.checked_extra_state({"count": 0})
    with pytest.raises(UserError, match="must return a dict of name -> tf.Variable, got list"):
        building.checked_extra_state([tf.Variable(0)])


def test_an_objective_training_variables_outside_the_model_is_refused():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(inputs))
    stranger = keras.layers.Dense(1, name="stranger")
    stranger.build((None, 2))
    config = ml_collections.ConfigDict(dict(optimizer=dict(state_dtype="float32"),
                                            train=dict(num_steps=10)))
    objectives = {"model": mixloop.Objective(model, keras.optimizers.SGD(0.1)),
                  "other": mixloop.Objective(stranger, keras.optimizers.SGD(0.1))}
    with pytest.raises(UserError, match="objective 'other' trains variables that are not in build_model"):
        building.check_objectives(objectives, model, config)


def test_bfloat16_weights_need_a_bfloat16_policy():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    config = ml_collections.ConfigDict(dict(precision=dict(master_weights="bfloat16")))
    objectives = {"model": mixloop.Objective(model, keras.optimizers.SGD(0.1))}
    with pytest.raises(ConfigError, match="master_weights='bfloat16' needs a policy computing in bfloat16"):
        building.store_trained_weights(model, objectives, mixloop.Policy.from_string("mixed_float16"),
                                       config)
