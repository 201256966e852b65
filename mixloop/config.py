"""The base experiment config: every framework field with its default, and its validation.

An experiment file's `get_config(arg=None)` starts from `base_config()`, fills the free-form `model`
and `data` sections, and overrides what it needs. `validate(config)` rejects keys the framework does
not know (a typo is an error, not a silent default) and values outside what is allowed, with one
line naming the key, the value and what is allowed. Keep a comment on every field: the config
reference (mixloop/config_reference.py) is read from them.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

import ml_collections
from ml_collections.config_dict import FieldReference

from mixloop.engine.compact_optimizer import STATE_DTYPES
from mixloop.engine.policy import Policy
from mixloop.errors import ConfigError

# Sections the experiment owns: any keys are allowed there.
FREE_FORM_SECTIONS = ("model", "data")
POLICIES = ("auto", "float32", "mixed_float16", "mixed_bfloat16")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")
STORAGE_DTYPES = {  # What each low-precision storage key allows.
    "optimizer.state_dtype": STATE_DTYPES,
    "precision.master_weights": ("float32", "bfloat16"),
    "train.accumulation_dtype": ("float32", "bfloat16"),
}
DISTRIBUTIONS = ("auto", "one_device", "mirrored", "multi_worker", "tpu")
# jit_compile, precision.float32_layers and precision.initial_scale: found by a probe;
# precision.float8_layers: every Dense and EinsumDense the float32 placement leaves in 16 bits.
AUTO = "auto"
ELEMENTWISE = "elementwise"  # jit_compile: graph kernels, with XLA fusing the elementwise ops.
DEFAULT_INITIAL_SCALE = 2.0**15


def base_config() -> ml_collections.ConfigDict:
    """Every framework field, with its default and what it means."""
    config = ml_collections.ConfigDict()
    config.trainer = ""  # Import path of the Trainer subclass, "package.module.ClassName".
    config.seed = 0  # Seeds Python, NumPy, TensorFlow and Keras.
    config.deterministic = False  # Deterministic kernels: a resumed run ends bit-identical.
    # True (XLA), False (TensorFlow's graph kernels), "elementwise" (graph kernels, XLA fusing the
    # elementwise ops), or "auto": the fastest of the three, timed at the start of a run and recorded
    # in config.json.
    config.jit_compile = FieldReference(AUTO, field_type=object)
    config.distribution = "auto"  # auto, one_device, mirrored, multi_worker (TF_CONFIG) or tpu.

    config.precision = ml_collections.ConfigDict()
    config.precision.policy = "float32"  # float32, mixed_float16, mixed_bfloat16, or auto.
    config.precision.loss_scale = "dynamic"  # "dynamic", "none", or a number for a static scale.
    # Dynamic scale: the starting value, or "auto": in float16 on one device, the doctor's advice from
    # a probe of a few train batches; elsewhere DEFAULT_INITIAL_SCALE (2**15).
    config.precision.initial_scale = FieldReference(AUTO, field_type=object)
    config.precision.growth_interval = 2000  # Dynamic scale: finite updates in a row before growing.
    config.precision.growth_factor = 2.0  # Dynamic scale: factor applied on growth (> 1).
    config.precision.backoff_factor = 0.5  # Dynamic scale: factor applied on overflow, in (0, 1).
    config.precision.hysteresis = 1  # Dynamic scale: overflows tolerated before backing off.
    config.precision.min_scale = 1.0  # Dynamic scale: lower bound.
    config.precision.max_scale = 2.0**24  # Dynamic scale: upper bound.
    # Dynamic scale: a step whose updates all overflowed is taken again on the same batch at the
    # backed-off scale, up to this many times, before it counts as skipped; 0 skips at once.
    config.precision.overflow_retries = 2
    # Regex of layer paths that also compute in float32; "auto" (or "auto|REGEX") adds, in float16,
    # the finest layers a probe of a few train batches finds overflowing; "" adds none.
    config.precision.float32_layers = AUTO
    # Regex of Dense/EinsumDense layer paths that train in FP8 (Keras's float8 quantize-dequantize
    # layers, quantized after the float32 placement); "auto": every Dense and EinsumDense but the
    # output layers and those kept in float32; "" (the default): none.
    config.precision.float8_layers = ""
    config.precision.probe_batches = 2  # Train batches the automatic placement and healing probe.
    # On a divergence in 16 bits with finite inputs, probe, move the layers found to float32, restore
    # the last checkpoint and go on; each heal counts against train.max_recoveries.
    config.precision.heal = False
    # What the trainable weights are stored in: float32, or bfloat16 with every update rounded
    # stochastically (keyed by the step: a resumed run is bit-identical); gradients stay float32.
    config.precision.master_weights = "float32"

    config.train = ml_collections.ConfigDict()
    config.train.num_steps = 1000  # Optimizer updates to run, skipped ones included.
    config.train.batch_size = 32  # Global examples per optimizer update.
    config.train.accumulation_steps = 1  # Micro-batches per update; must divide batch_size.
    # compute_loss sees the whole global batch's outputs (every micro-batch and replica), for losses
    # that couple examples (contrastive): GradCache's two passes. False: one micro-batch at a time.
    config.train.batch_loss = False
    config.train.steps_per_loop = 10  # Updates per compiled loop call (Python leaves the hot path).
    config.train.log_every_steps = 100  # Console progress line and TensorBoard train summaries.
    config.train.clip_global_norm = 0.0  # Clip the true gradient to this global norm; 0 disables.
    config.train.repeat_dataset = False  # Repeat the train data; if False, its end stops the run.
    config.train.max_consecutive_skips = 50  # Skipped updates in a row that stop the run; 0: never.
    config.train.max_recoveries = 0  # On divergence, restore the last checkpoint this many times.
    # EMA of the weights over applied updates, for eval and the export; 0 disables (e.g. 0.999).
    config.train.ema_decay = 0.0
    # What the micro-batch gradient accumulators hold: float32, or bfloat16 rounded stochastically.
    config.train.accumulation_dtype = "float32"
    # Regex of layer paths whose activations are recomputed in the backward pass instead of kept
    # (less memory, one more forward of those layers); "" recomputes none.
    config.train.recompute = ""
    # Plan the run to peak under this much memory: bytes with a unit ("6GiB", "1500MiB", "8GB") or
    # a fraction of the machine's available RAM ("0.6"); "" plans nothing. The plan (micro-batches,
    # compile mode) is measured by probes of the run itself before its first update.
    config.train.memory_budget = ""

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.name = "adamw"  # sgd, momentum, adam or adamw.
    config.optimizer.learning_rate = 1e-3  # Peak learning rate.
    config.optimizer.schedule = "constant"  # constant, cosine or linear decay over num_steps.
    config.optimizer.warmup_steps = 0  # Linear warm-up from 0 to learning_rate.
    config.optimizer.weight_decay = 0.0  # Decoupled weight decay (adamw; sgd/momentum/adam via Keras).
    config.optimizer.momentum = 0.9  # For "momentum".
    config.optimizer.beta_1 = 0.9  # Adam(W).
    config.optimizer.beta_2 = 0.999  # Adam(W).
    config.optimizer.epsilon = 1e-7  # Adam(W).
    # What Adam(W)'s moments are stored in: float32, bfloat16 (rounded stochastically) or int8
    # (block-wise dynamic quantization, 256 values per float32 scale; small tensors and embedding
    # tables stay float32).
    config.optimizer.state_dtype = "float32"

    config.eval = ml_collections.ConfigDict()
    config.eval.every_steps = 500  # Evaluate every this many updates and at the end; 0: only at the end.
    config.eval.num_batches = 0  # Eval batches per evaluation; 0 reads the whole eval set.
    # The model's forward on an eval batch in this many micro-batches (its metrics see the whole
    # batch); 0: train.accumulation_steps; 1: the whole batch at once (a model whose forward couples
    # the examples of a batch).
    config.eval.micro_batches = 0

    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.every_steps = 500  # Save every this many updates, and at the end.
    config.checkpoint.max_to_keep = 3  # Checkpoints kept in the workdir.

    config.model = ml_collections.ConfigDict()  # Free-form: the experiment's model hyperparameters.
    config.data = ml_collections.ConfigDict()  # Free-form: the experiment's data settings.
    return config


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks keys and values of a resolved config.

    Raises:
      ConfigError: one line naming the first bad key, its value and what is allowed.
    """
    check_complete(config)
    _check_known_keys(config, base_config(), prefix="")
    _check_values(config)


def check_complete(config: Any) -> None:
    """Refuses a config that lacks a framework key (a `get_config` returning a plain dict of its
    own rather than `base_config()` with changes), before anything reads the key.

    Raises:
      ConfigError: naming the first missing key and the way out.
    """
    missing = _first_missing_key(config, base_config(), prefix="")
    if missing:
        raise ConfigError(f"config.{missing} is missing: the config must hold every framework key; "
                          "start get_config() from mixloop.config.base_config() and change what "
                          "the experiment needs")


def _first_missing_key(config: Any, reference: ml_collections.ConfigDict, prefix: str) -> str:
    """The path of the first key of `reference` that `config` lacks (free-form sections are
    checked only for being there), or ''."""
    for key in reference.keys():
        if not hasattr(config, "keys") or key not in config:
            return prefix + key
        if isinstance(reference[key], ml_collections.ConfigDict) and key not in FREE_FORM_SECTIONS:
            missing = _first_missing_key(config[key], reference[key], prefix + key + ".")
            if missing:
                return missing
    return ""


def _check_known_keys(config: Any, reference: Any, prefix: str) -> None:
    for key in config.keys():
        path = prefix + key
        if key not in reference:
            allowed = ", ".join(sorted(reference.keys()))
            raise ConfigError(f"unknown config key {path!r}; known keys here: {allowed}")
        if key in FREE_FORM_SECTIONS and not prefix:
            continue
        if isinstance(reference[key], ml_collections.ConfigDict):
            _check_known_keys(config[key], reference[key], prefix=path + ".")


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"config.{key}={value!r} is not allowed: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def parse_loss_scale(value: Any) -> Any:
    """Returns "dynamic", "none" or a positive float for `precision.loss_scale`, else None."""
    if isinstance(value, str) and value.strip().lower() in ("dynamic", "none"):
        return value.strip().lower()
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if 0 < number < float("inf") else None


_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_memory_budget(value: str) -> Any:
    """`train.memory_budget` read: ("bytes", N) for bytes with a unit ("6GiB", "1500 MiB", "8GB"),
    ("fraction", F) for a fraction F in (0, 1], or None when it is neither."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not match:
        return None
    number, unit = float(match.group(1)), match.group(2).upper()
    if not unit:
        return ("fraction", number) if 0 < number <= 1 else None
    if unit not in _BYTE_UNITS or number * _BYTE_UNITS[unit] < 1:
        return None
    return ("bytes", int(number * _BYTE_UNITS[unit]))


def split_auto(float32_layers: str) -> tuple[bool, str]:
    """`precision.float32_layers` as (whether it asks for the automatic placement, the explicit regex):
    "auto" -> (True, ""), "auto|logits" -> (True, "logits"), "dense.*" -> (False, "dense.*")."""
    if float32_layers == AUTO:
        return True, ""
    if float32_layers.startswith(AUTO + "|"):
        return True, float32_layers[len(AUTO) + 1:]
    return False, float32_layers


def _parses_as_policy(value: Any) -> bool:
    try:
        Policy.from_string(str(value))
    except ValueError:
        return False
    return True


def compiles(pattern: Any) -> bool:
    """Whether `pattern` is a valid Python regular expression."""
    try:
        re.compile(pattern)
    except (re.error, TypeError):
        return False
    return True


def _check_values(config: ml_collections.ConfigDict) -> None:
    p, t, o = config.precision, config.train, config.optimizer
    _require(isinstance(config.trainer, str) and bool(config.trainer), "trainer", config.trainer,
             "the import path of a Trainer subclass, e.g. 'experiments.charlm.CharLMTrainer'")
    _require(isinstance(config.jit_compile, bool) or config.jit_compile in (AUTO, ELEMENTWISE),
             "jit_compile", config.jit_compile,
             "True, False, 'elementwise' or 'auto' (the fastest, measured at the start)")
    _require(config.distribution in DISTRIBUTIONS, "distribution", config.distribution,
             f"one of {', '.join(DISTRIBUTIONS)}")
    _require(p.policy == "auto" or _parses_as_policy(p.policy), "precision.policy", p.policy,
             f"one of {', '.join(POLICIES)} or 'params=..,compute=..,output=..'")
    _require(parse_loss_scale(p.loss_scale) is not None, "precision.loss_scale", p.loss_scale,
             "'dynamic', 'none' or a positive finite number")
    _require(isinstance(p.float32_layers, str) and compiles(split_auto(p.float32_layers)[1]),
             "precision.float32_layers", p.float32_layers,
             "a Python regular expression over layer paths, 'auto', or 'auto|REGEX'")
    _require(isinstance(p.float8_layers, str) and (p.float8_layers == AUTO or compiles(p.float8_layers)),
             "precision.float8_layers", p.float8_layers,
             "'' (none), 'auto', or a Python regular expression over Dense/EinsumDense layer paths")
    _require(p.initial_scale == AUTO or (_is_number(p.initial_scale) and 0 < p.initial_scale < math.inf),
             "precision.initial_scale", p.initial_scale, "a positive finite number or 'auto'")
    _require(_is_int(p.probe_batches) and p.probe_batches >= 1, "precision.probe_batches",
             p.probe_batches, "a positive integer")
    _require(isinstance(p.heal, bool), "precision.heal", p.heal, "True or False")
    _require(_is_int(p.overflow_retries) and p.overflow_retries >= 0, "precision.overflow_retries",
             p.overflow_retries, "a non-negative integer")
    _require(not p.heal or t.max_recoveries >= 1, "precision.heal", p.heal,
             "True needs train.max_recoveries of at least 1 (each heal counts as a recovery), "
             f"but it is {t.max_recoveries}")
    for key in ("num_steps", "batch_size", "accumulation_steps", "steps_per_loop", "log_every_steps"):
        _require(_is_int(t[key]) and t[key] >= 1, f"train.{key}", t[key], "a positive integer")
    for key in ("max_consecutive_skips", "max_recoveries"):
        _require(_is_int(t[key]) and t[key] >= 0, f"train.{key}", t[key], "a non-negative integer")
    for key in ("repeat_dataset", "batch_loss"):
        _require(isinstance(t[key], bool), f"train.{key}", t[key], "True or False")
    _require(t.batch_size % t.accumulation_steps == 0, "train.accumulation_steps",
             t.accumulation_steps, f"a divisor of train.batch_size={t.batch_size}")
    _require(_is_number(t.clip_global_norm) and t.clip_global_norm >= 0, "train.clip_global_norm",
             t.clip_global_norm, "a non-negative number (0 disables clipping)")
    _require(_is_number(t.ema_decay) and 0 <= t.ema_decay < 1, "train.ema_decay", t.ema_decay,
             "a number in [0, 1) (0 disables the EMA; e.g. 0.999)")
    _require(_is_int(config.seed) and config.seed >= 0, "seed", config.seed,
             "a non-negative integer")
    _require(o.name in OPTIMIZERS, "optimizer.name", o.name, f"one of {', '.join(OPTIMIZERS)}")
    for key in ("beta_1", "beta_2", "momentum"):
        _require(_is_number(o[key]) and 0 <= o[key] < 1, f"optimizer.{key}", o[key],
                 "a number in [0, 1)")
    _require(_is_number(o.epsilon) and o.epsilon > 0, "optimizer.epsilon", o.epsilon,
             "a positive number")
    _require(o.schedule in SCHEDULES, "optimizer.schedule", o.schedule, f"one of {', '.join(SCHEDULES)}")
    _require(_is_number(o.learning_rate) and o.learning_rate > 0, "optimizer.learning_rate",
             o.learning_rate, "a positive number")
    _require(_is_int(o.warmup_steps) and 0 <= o.warmup_steps < t.num_steps, "optimizer.warmup_steps",
             o.warmup_steps, f"an integer in [0, train.num_steps={t.num_steps})")
    for key, allowed in STORAGE_DTYPES.items():
        section, name = key.split(".")
        _require(config[section][name] in allowed, key, config[section][name],
                 f"one of {', '.join(allowed)}")
    _require(o.state_dtype == "float32" or o.name in ("adam", "adamw"), "optimizer.state_dtype",
             o.state_dtype, f"'float32' with optimizer.name={o.name!r}; bfloat16 and int8 moments "
             "are for adam and adamw")
    _require(isinstance(t.recompute, str) and compiles(t.recompute), "train.recompute", t.recompute,
             "'' (none) or a Python regular expression over layer paths")
    _require(isinstance(t.memory_budget, str) and (not t.memory_budget or parse_memory_budget(t.memory_budget)),
             "train.memory_budget", t.memory_budget,
             "'' (none), bytes with a unit such as '6GiB', '1500MiB' or '8GB', or a fraction in "
             "(0, 1] of the available RAM such as '0.6'")
    _require(_is_number(o.weight_decay) and o.weight_decay >= 0, "optimizer.weight_decay",
             o.weight_decay, "a non-negative number")
    for key in ("eval.every_steps", "eval.num_batches", "eval.micro_batches", "checkpoint.every_steps"):
        value = config[key.split(".")[0]][key.split(".")[1]]
        _require(_is_int(value) and value >= 0, key, value, "a non-negative integer")
    _require(_is_int(config.checkpoint.max_to_keep) and config.checkpoint.max_to_keep >= 1,
             "checkpoint.max_to_keep", config.checkpoint.max_to_keep, "a positive integer")
