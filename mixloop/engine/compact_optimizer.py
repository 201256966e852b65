"""Keras optimizers whose state and weights are stored in fewer bits: Adam and AdamW with moments in
bfloat16 or int8 (`optimizer.state_dtype`), and Adam, AdamW and SGD updating bfloat16 weights by
stochastic rounding (`precision.master_weights`).

They are Keras's own optimizers (learning-rate schedules, `iterations`, weight decay, clipping, float8
scales overwritten with their gradient and `tf.train.Checkpoint` work as there); each update is
computed in float32 exactly as Keras computes it for a float32 variable, and only stored in fewer bits:

    g     = the gradient, in float32
    m, v  = the stored moments, read as float32           (bfloat16 cast up; int8 dequantized)
    m    <- m + (g - m) (1 - beta_1);  v <- v + (g^2 - v) (1 - beta_2)
    store m, v                                            (bfloat16: stochastic rounding; int8: requantized)
    w     = the weight, read as float32
    w    <- w - w * weight_decay * lr                      (decoupled decay, inside the same float32
                                                           update: a bfloat16 weight would round it away)
    w    <- w - m alpha / (sqrt(v) + epsilon)              alpha = lr sqrt(1 - beta_2^t) / (1 - beta_1^t)
    store w                                               (float32: as is; bfloat16: stochastic rounding)

The update uses the moments before they are stored, so their rounding only reaches the next step.
In graph mode the variables are updated one after another (on each device): each one's float32
temporaries (its moments read as float32, its weight cast up, the rounding's noise) are freed before
the next one's are made. Left to the graph, every variable's would be alive at once, more memory than
the compact state saves. (XLA schedules a compiled step's buffers itself.)
Stochastic rounding is seeded by (optimizer.iterations, -1 - (3 x the variable's index + which tensor)):
iterations advance only on applied updates and are checkpointed, so a step rounds the same way when
it runs again after a resume, and every replica rounds alike (their copies stay equal).

int8 moments are stored block-wise (`low_bit.quantize_blockwise`: uint8 codes and a float32 scale
per 256 values), the first moment on the signed code book, the second on the unsigned one. Tensors
of fewer than 4096 values (biases, normalization scales) keep float32 moments, as in bitsandbytes
and torchao: they are a small share of the state, and the most sensitive to its rounding. So do
embedding tables, told by their variable's name (`EMBEDDING_TABLE_NAME`), as Hugging Face's Trainer
keeps every embedding's state in 32 bits under bitsandbytes' 8-bit optimizers (whose Stable
Embedding, Dettmers et al. 2021, answers the uneven frequency of tokens). Quantized, with bfloat16
weights, its tables cost keras-hub's GPT-2 a measurable share of its final loss (docs/memory.md).
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from mixloop.engine import low_bit

MIN_QUANTIZED_SIZE = 4096  # Tensors with fewer values keep float32 moments under state_dtype=int8.
# The name Keras gives an embedding table's variable (`keras.layers.Embedding` and its subclasses,
# keras-hub's `ReversibleEmbedding` and `PositionEmbedding`): such tables keep float32 moments too.
EMBEDDING_TABLE_NAME = "embeddings"
STATE_DTYPES = ("float32", "bfloat16", "int8")  # What optimizer.state_dtype allows.
# Which of a variable's tensors a stochastic rounding seed is for.
_WEIGHT, _FIRST_MOMENT, _SECOND_MOMENT = 0, 1, 2


def quantizes_moments(variable: keras.Variable) -> bool:
    """Whether `state_dtype="int8"` stores `variable`'s moments quantized: not for a tensor of fewer
    than `MIN_QUANTIZED_SIZE` values, nor for an embedding table (the module docstring)."""
    return math.prod(variable.shape) >= MIN_QUANTIZED_SIZE and variable.name != EMBEDDING_TABLE_NAME


def store(variable: tf.Variable, value: tf.Tensor, seed: tf.Tensor) -> list[tf.Tensor]:
    """Assigns the float32 `value` to `variable`: stochastically rounded (`seed`, int32 [2]) if the
    variable is bfloat16, cast otherwise (exact for float32); returns what it assigned."""
    if tf.as_dtype(variable.dtype) == tf.bfloat16:
        value = low_bit.stochastic_round_to_bfloat16(value, seed)
    stored = tf.cast(value, variable.dtype)
    variable.assign(stored)
    return [stored]


class _Plain:
    """A moment stored in one variable, float32 or bfloat16."""

    def __init__(self, variable: keras.Variable):
        self.variable = variable

    def read(self) -> tf.Tensor:
        return tf.cast(self.variable.value, tf.float32)

    def write(self, value: tf.Tensor, seed: tf.Tensor) -> list[tf.Tensor]:
        return store(self.variable, value, seed)


class _Blockwise:
    """A moment stored as uint8 codes and float32 block scales (`low_bit.quantize_blockwise`)."""

    def __init__(self, codes: keras.Variable, scales: keras.Variable, shape: tuple, signed: bool):
        self.codes, self.scales, self.shape, self.signed = codes, scales, shape, signed

    def read(self) -> tf.Tensor:
        return low_bit.dequantize_blockwise(self.codes.value, self.scales.value, self.shape, self.signed)

    def write(self, value: tf.Tensor, seed: tf.Tensor) -> list[tf.Tensor]:
        del seed  # Quantization rounds to the nearest code.
        codes, scales = low_bit.quantize_blockwise(value, self.signed)
        self.codes.assign(codes)
        self.scales.assign(scales)
        return [codes, scales]


class _Chain:
    """What the variable updated last on each device stored (tensors), which the next one's update
    on that device waits for: replicas update their copies side by side, each in order."""

    def __init__(self):
        self.stored: dict[str, list[tf.Tensor]] = {}


class _LowBitUpdates:
    """What the compact optimizers share: weight decay inside the float32 update, the seeds, state
    variables of a dtype of their own (Keras gives a slot its variable's dtype), and the variables
    updated one after another (the module docstring)."""

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        self._chain = _Chain()  # A plain object: Keras tracks lists set on an optimizer.
        try:
            super()._backend_update_step(grads, trainable_variables, learning_rate)
        finally:
            self._chain = _Chain()  # Its tensors belong to this trace's graph; replicas' threads
            # each start and end it around the one merged update.

    def _after_previous_update(self, variable):
        """A context in which the ops made wait until the previous variable's update on
        `variable`'s device computed what it stores (its values, not its assignment: enough for
        its temporaries to be freed, and no two variables share state)."""
        chain = getattr(self, "_chain", None)
        return tf.control_dependencies(chain.stored.get(variable.device, []) if chain else [])

    def _updated(self, variable, stored: list[tf.Tensor]) -> None:
        """Records what `variable`'s update stored, for the next variable's on its device."""
        chain = getattr(self, "_chain", None)
        if chain is not None:
            chain.stored[variable.device] = stored

    def _apply_weight_decay(self, variables):
        """Nothing here: `update_step` decays each weight inside its float32 update (`_decayed`)."""

    def _decayed(self, variable, weight: tf.Tensor, learning_rate: tf.Tensor) -> tf.Tensor:
        """The float32 `weight` after Keras's decoupled decay, `w - w * weight_decay * lr`."""
        if self.weight_decay is None or not self._use_weight_decay(variable):
            return weight
        return weight - weight * tf.cast(self.weight_decay, tf.float32) * learning_rate

    def _seed(self, variable, tensor: int) -> tf.Tensor:
        """The stochastic rounding seed of `variable`'s `tensor` (_WEIGHT, _FIRST_MOMENT, ...) now.
        Its second element is negative: the train step's accumulator roundings use non-negative
        ones, so no two roundings of a step share their draws."""
        stream = -1 - (3 * self._get_variable_index(variable) + tensor)
        return tf.stack([tf.cast(self.iterations, tf.int32), tf.constant(stream, tf.int32)])

    def _store_weight(self, variable, weight: tf.Tensor) -> list[tf.Tensor]:
        return store(variable, weight, self._seed(variable, _WEIGHT))

    def _state_variable(self, variable: keras.Variable, name: str, shape, dtype: str) -> keras.Variable:
        """An optimizer variable for `variable`, named and placed as Keras places its slots."""
        path = getattr(variable, "path", variable.name).replace("/", "_").replace(":", "_")
        with tf.distribute.get_strategy().extended.colocate_vars_with(getattr(variable, "value", variable)):
            return self.add_variable(shape, dtype=dtype, name=f"{path}_{name}")


@keras.saving.register_keras_serializable(package="mixloop")
class CompactAdam(_LowBitUpdates, keras.optimizers.Adam):
    """Keras's Adam with its moments stored in `state_dtype` ("float32", "bfloat16" or "int8") and
    bfloat16 weights updated by stochastic rounding; every other argument as `keras.optimizers.Adam`
    (without amsgrad)."""

    def __init__(self, learning_rate: float | keras.optimizers.schedules.LearningRateSchedule = 0.001, *,
                 state_dtype: str = "float32", **kwargs):
        super().__init__(learning_rate, **kwargs)
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}")
        if self.amsgrad:
            raise ValueError(f"{type(self).__name__} has no amsgrad")
        self.state_dtype = state_dtype

    def build(self, var_list: list[keras.Variable]) -> None:
        if self.built:
            return
        # Adam's own build is skipped: it would store each moment in its variable's dtype.
        super(keras.optimizers.Adam, self).build(var_list)
        self._moments = [None if getattr(v, "overwrite_with_gradient", False) else
                         (self._moment(v, "momentum", signed=True), self._moment(v, "velocity", signed=False))
                         for v in var_list]

    def _moment(self, variable: keras.Variable, name: str, signed: bool):
        """One moment of `variable`, stored as `state_dtype` says."""
        if self.state_dtype != "int8" or not quantizes_moments(variable):
            dtype = "bfloat16" if self.state_dtype == "bfloat16" else "float32"
            return _Plain(self._state_variable(variable, name, variable.shape, dtype))
        blocks = low_bit.num_blocks(math.prod(variable.shape))
        codes = self._state_variable(variable, f"{name}_codes", (blocks, low_bit.BLOCK_SIZE), "uint8")
        scales = self._state_variable(variable, f"{name}_scales", (blocks,), "float32")
        return _Blockwise(codes, scales, tuple(variable.shape), signed)

    def update_step(self, gradient: tf.Tensor, variable: tf.Variable, learning_rate: tf.Tensor) -> None:
        """Keras's Adam update in float32, stored as the module docstring says."""
        first, second = self._moments[self._get_variable_index(variable)]
        with self._after_previous_update(variable):
            lr = tf.cast(learning_rate, tf.float32)
            gradient = tf.cast(tf.convert_to_tensor(gradient), tf.float32)
            local_step = tf.cast(self.iterations + 1, tf.float32)
            beta_1_power = tf.pow(tf.cast(self.beta_1, tf.float32), local_step)
            beta_2_power = tf.pow(tf.cast(self.beta_2, tf.float32), local_step)
            alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
            m = first.read()
            m = m + (gradient - m) * (1 - self.beta_1)
            v = second.read()
            v = v + (tf.square(gradient) - v) * (1 - self.beta_2)
            weight = self._decayed(variable, tf.cast(variable, tf.float32), lr)
        self._updated(variable, first.write(m, self._seed(variable, _FIRST_MOMENT))
                      + second.write(v, self._seed(variable, _SECOND_MOMENT))
                      + self._store_weight(variable, weight - m * alpha / (tf.sqrt(v) + self.epsilon)))

    def get_config(self) -> dict:
        return {**super().get_config(), "state_dtype": self.state_dtype}


@keras.saving.register_keras_serializable(package="mixloop")
class CompactAdamW(CompactAdam, keras.optimizers.AdamW):
    """Keras's AdamW (weight decay required, 0.004 by default) stored as `CompactAdam` stores Adam."""


@keras.saving.register_keras_serializable(package="mixloop")
class CompactSGD(_LowBitUpdates, keras.optimizers.SGD):
    """Keras's SGD (with momentum and Nesterov if asked) updating bfloat16 weights by stochastic
    rounding; its momentum is float32 whatever the weight's dtype. Arguments as `keras.optimizers.SGD`."""

    def build(self, variables: list[keras.Variable]) -> None:
        if self.built:
            return
        # SGD's own build is skipped: it would store the momentum in its variable's dtype.
        super(keras.optimizers.SGD, self).build(variables)
        self.momentums = [None if getattr(v, "overwrite_with_gradient", False) or not self.momentum else
                          self._state_variable(v, "momentum", v.shape, "float32") for v in variables]

    def update_step(self, gradient: tf.Tensor, variable: tf.Variable, learning_rate: tf.Tensor) -> None:
        """Keras's SGD update in float32 (`m <- momentum m - lr g`; `w <- w + m`, or with Nesterov
        `w <- w + momentum m - lr g`), the weight stored by `store`."""
        slot = self.momentums[self._get_variable_index(variable)]
        with self._after_previous_update(variable):
            lr = tf.cast(learning_rate, tf.float32)
            step = -tf.cast(tf.convert_to_tensor(gradient), tf.float32) * lr
            if slot is not None:
                momentum = tf.cast(self.momentum, tf.float32)
                m = slot.value * momentum + step
                slot.assign(m)
                step = m * momentum + step if self.nesterov else m
            weight = self._decayed(variable, tf.cast(variable, tf.float32), lr)
        self._updated(variable, self._store_weight(variable, weight + step))


# The optimizers that store state in fewer bits and round bfloat16 weights stochastically.
COMPACT_TYPES = (CompactAdam, CompactSGD)
