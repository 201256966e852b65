"""Config validation: unknown keys and bad values are one-line ConfigErrors naming key and value."""

import pytest

from mixloop.config import ConfigError, base_config, parse_loss_scale, validate


def valid_config():
    config = base_config()
    config.trainer = "tiny_experiment.TinyTrainer"
    return config


def test_base_config_with_a_trainer_is_valid():
    validate(valid_config())


def test_free_form_sections_accept_any_key():
    config = valid_config()
    config.model.anything = 3
    config.data.path = "x"
    validate(config)


@pytest.mark.parametrize("section, key", [("train", "num_stpes"), ("", "sede"), ("optimizer", "lr")])
def test_unknown_key_is_named(section, key):
    config = valid_config()
    (config[section] if section else config)[key] = 1
    path = f"{section}.{key}" if section else key
    with pytest.raises(ConfigError, match=f"unknown config key '{path}'"):
        validate(config)


@pytest.mark.parametrize("key, value, allowed", [
    ("precision.policy", "mixed_float17", "one of auto, float32"),
    ("precision.loss_scale", "sometimes", "'dynamic', 'none' or a positive finite number"),
    ("precision.loss_scale", "-4", "'dynamic', 'none' or a positive finite number"),
    ("train.num_steps", 0, "a positive integer"),
    ("train.batch_size", -8, "a positive integer"),
    ("train.accumulation_steps", 3, "a divisor of train.batch_size=32"),
    ("train.clip_global_norm", -1.0, "non-negative"),
    ("optimizer.name", "adagrad", "one of sgd, momentum, adam, adamw"),
    ("optimizer.schedule", "step", "one of constant, cosine, linear"),
    ("optimizer.learning_rate", 0.0, "a positive number"),
    ("optimizer.warmup_steps", 1000, "an integer in [0, train.num_steps=1000)"),
    ("eval.every_steps", -1, "a non-negative integer"),
    ("checkpoint.max_to_keep", 0, "a positive integer"),
    ("precision.float32_layers", "(norm", "a Python regular expression over layer paths"),
    ("precision.float8_layers", "(", "'' (none), 'auto', or a Python regular expression over "
                                     "Dense/EinsumDense layer paths"),
    ("precision.float8_layers", None, "'' (none), 'auto', or a Python regular expression"),
    ("precision.loss_scale", "inf", "'dynamic', 'none' or a positive finite number"),
    ("precision.loss_scale", "1e400", "'dynamic', 'none' or a positive finite number"),
    ("optimizer.beta_1", 2.0, "a number in [0, 1)"),
    ("optimizer.beta_2", -0.1, "a number in [0, 1)"),
    ("optimizer.momentum", 1.0, "a number in [0, 1)"),
    ("optimizer.epsilon", 0.0, "a positive number"),
    ("train.ema_decay", 1.0, "a number in [0, 1)"),
])
def test_bad_value_names_key_value_and_what_is_allowed(key, value, allowed):
    config = valid_config()
    section, field = key.split(".")
    config[section][field] = value
    with pytest.raises(ConfigError) as raised:
        validate(config)
    message = str(raised.value)
    assert f"config.{key}={value!r}" in message and allowed in message
    assert "\n" not in message


def test_missing_trainer_is_named():
    with pytest.raises(ConfigError, match="config.trainer=''"):
        validate(base_config())


@pytest.mark.parametrize("value, parsed", [
    ("dynamic", "dynamic"), ("None", "none"), ("1024", 1024.0), (128, 128.0), ("0", None), ("x", None),
])
def test_parse_loss_scale(value, parsed):
    assert parse_loss_scale(value) == parsed


def test_explicit_policy_strings_are_accepted():
    config = valid_config()
    config.precision.policy = "c=bfloat16,p=float32,o=float32"
    validate(config)


def test_jit_compile_is_true_false_elementwise_or_auto_by_default():
    config = valid_config()
    assert config.jit_compile == "auto"
    for value in (True, False, "elementwise", "auto"):
        config.jit_compile = value
        validate(config)
    for value in ("yes", None):
        config.jit_compile = value
        with pytest.raises(ConfigError, match=r"config.jit_compile=.* is not allowed: True, False, 'elementwise' or 'auto'"):
            validate(config)


@pytest.mark.parametrize("seed", [-1, -100])
def test_a_bad_seed_is_one_line(seed):
    config = valid_config()
    config.seed = seed
    with pytest.raises(ConfigError, match=f"config.seed={seed!r} is not allowed: a non-negative integer"):
        validate(config)


@pytest.mark.parametrize("value", ["", "auto", r"encoder/.*(query|key|value)"])
def test_float8_layers_is_off_auto_or_a_regex(value):
    config = valid_config()
    config.precision.float8_layers = value
    validate(config)
    assert base_config().precision.float8_layers == ""  # Off unless asked for.
