"""Memory: what a run weighs. The persistent state it keeps, in bytes per parameter by part, and the
peak its process (or device) reaches.

Persistent state lives for the whole run, whatever the batch: the weights, the optimizers' state,
the gradient accumulators of `train.accumulation_steps` > 1 and the EMA's averages. Each part is
counted from its variables as they are stored (a float32 value 4 bytes, a bfloat16 one 2, an int8
code 1), over the model's trainable parameters: float32 Adam with two micro-batches keeps
4 + 8 + 4 = 16 bytes per parameter before a single activation. `lighter_options` counts, from the
same variables' shapes, what each lighter storage setting would keep instead (docs/memory.md). The
peak (`peak_bytes`) adds the rest: activations, workspaces, compiled code, the runtime itself.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import pickle
import resource
import sys
import traceback
from typing import Any, Callable, Iterable, Optional

import keras
import tensorflow as tf

from mixloop.engine import lighter_model, low_bit
from mixloop.engine.compact_optimizer import quantizes_moments
from mixloop.engine.objective import trained_variables

PARTS = ("weights", "optimizer state", "accumulators", "EMA")  # In the order the line shows them.
_ACCELERATORS = ("GPU", "TPU")
_UNITS = ("B", "kB", "MB", "GB", "TB")
# The lighter storage settings, each with the part of PARTS it lightens.
LIGHTER_PARTS = {"precision.master_weights": "weights", "optimizer.state_dtype": "optimizer state",
                 "train.accumulation_dtype": "accumulators"}
_LOW_BIT_STATE_DTYPES = ("bfloat16", "int8")  # optimizer.state_dtype's lighter values.
_ADAM_NAMES = ("adam", "adamw")  # The optimizer.name values state_dtype allows (config.validate).
_BFLOAT16 = "bfloat16"


def peak_bytes() -> int:
    """The most memory this process has held so far, in bytes: the device allocator's peak where
    there is a GPU or TPU (the largest over the devices: the one that runs out first), else the
    host's peak resident set size."""
    devices = [f"{kind}:{index}" for kind in _ACCELERATORS
               for index in range(len(tf.config.list_logical_devices(kind)))]
    if devices:
        return max(tf.config.experimental.get_memory_info(device)["peak"] for device in devices)
    high_water = _high_water_mark()
    if high_water is not None:
        return high_water
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, kilobytes on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit


def _high_water_mark() -> Optional[int]:
    """This process's peak resident set since it started its program (Linux's VmHWM), or None
    off Linux. Not `ru_maxrss`, which Linux carries across exec: a process started by a large one
    (a run's memory probes, a test worker's commands) would report its parent's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def format_bytes(num_bytes: float) -> str:
    """'950 B', '19.8 MB', '1.92 GB': decimal units, about three significant digits."""
    exponent = 0
    while num_bytes >= 999.5 * 1000 ** exponent and exponent < len(_UNITS) - 1:
        exponent += 1
    value = num_bytes / 1000 ** exponent
    decimals = 0 if exponent == 0 or value >= 99.95 else 1 if value >= 9.995 else 2
    return f"{value:.{decimals}f} {_UNITS[exponent]}"


@dataclasses.dataclass(frozen=True)
class PersistentState:
    """A run's trainable parameter count and the bytes each part of `PARTS` holds for them."""

    num_parameters: int
    part_bytes: dict[str, int]  # By part, in PARTS' order.

    @property
    def total_bytes(self) -> int:
        """All parts together."""
        return sum(self.part_bytes.values())

    def per_parameter(self) -> dict[str, float]:
        """Bytes per trainable parameter by part."""
        return {part: size / max(self.num_parameters, 1) for part, size in self.part_bytes.items()}

    def describe(self) -> str:
        """The run's start line: 'memory: 1,234,567 parameters; persistent state 16.00 B/param
        (weights 4.00, optimizer state 8.00, accumulators 4.00, EMA 0.00) = 19.8 MB'."""
        per_parameter = self.per_parameter()
        parts = ", ".join(f"{part} {size:.2f}" for part, size in per_parameter.items())
        return (f"memory: {self.num_parameters:,} parameters; persistent state "
                f"{sum(per_parameter.values()):.2f} B/param ({parts}) = "
                f"{format_bytes(self.total_bytes)}")


def persistent_state(run: Any) -> PersistentState:
    """The persistent state of a built run, from its `model` (the trainable parameters and the
    weights), `objectives` (their optimizers' state; the variables accumulated), `train_step.ema`
    and `config.train` (accumulation_steps, accumulation_dtype). The variables Keras overwrites
    with their "gradient" (FP8's scales and amax histories) are no parameters: their bytes count
    among the weights, not their values among the parameters."""
    train = run.config.train
    weights = run.model.trainable_variables
    parameters = [v for v in weights if not getattr(v, "overwrite_with_gradient", False)]
    accumulated = trained_variables(run.objectives) if train.accumulation_steps > 1 else []
    averages = [v for ema in run.train_step.ema.values() for v in ema.averages]
    return PersistentState(num_elements(parameters), {
        "weights": stored_bytes(weights),
        "optimizer state": stored_bytes(optimizer_state(run.objectives)),
        "accumulators": num_elements(accumulated) * tf.as_dtype(train.accumulation_dtype).size,
        "EMA": stored_bytes(averages),
    })


@dataclasses.dataclass(frozen=True)
class LighterOption:
    """Lighter storage settings and the persistent state a run would keep with them.

    `needs` holds the settings the run must change first for these to be accepted (bfloat16 master
    weights need a policy computing in bfloat16); `state` assumes they are changed."""

    settings: dict[str, str]  # Config key -> value, e.g. {"optimizer.state_dtype": "int8"}.
    state: PersistentState
    needs: dict[str, str] = dataclasses.field(default_factory=dict)  # Config key -> value.


def lighter_options(run: Any) -> list[LighterOption]:
    """What each lighter storage setting a built Trainer does not use yet would make its persistent
    state (`persistent_state`'s parts), counted from its variables' shapes; then, when two or more
    settings apply without `needs`, all of them together (int8 or bfloat16 moments, the lighter).

    The settings, each listed only where it makes the state lighter:
      precision.master_weights=bfloat16: the float32 trainable weights that
        `engine.lighter_model.store_weights_in_bfloat16` moves (not FP8 layers', not the variables
        Keras overwrites) take 2 bytes; it needs a policy computing in bfloat16.
      optimizer.state_dtype=bfloat16, =int8: with optimizer.name adam or adamw, each Adam(W)
        optimizer's two moments per variable as `engine.compact_optimizer.CompactAdam` stores them:
        2 bytes a value in bfloat16; in int8 one uint8 code a value padded to whole blocks of
        `low_bit.BLOCK_SIZE` plus a float32 scale a block, but 4 bytes a value for what
        `CompactAdam` keeps in float32 (small tensors, embedding tables: `quantizes_moments`).
      train.accumulation_dtype=bfloat16: with accumulation_steps > 1, 2 bytes an accumulated value.
    Bytes only: what the settings do to the loss is not measured here.
    """
    current = persistent_state(run)
    config = run.config
    options = []
    if config.precision.master_weights != _BFLOAT16:
        needs = {} if run.policy.compute_dtype == tf.bfloat16 else {
            "precision.policy": "mixed_bfloat16"}
        weights = current.part_bytes["weights"] - 2 * num_elements(
            [v for stored in lighter_model.bfloat16_storable(
                run.model, trained_variables(run.objectives)).values() for v in stored])
        options.append(_lightened(current, "precision.master_weights", _BFLOAT16, weights, needs))
    adam = {name: isinstance(o.optimizer, keras.optimizers.Adam) for name, o in run.objectives.items()}
    if any(adam.values()) and config.optimizer.name in _ADAM_NAMES:
        others = {name: o for name, o in run.objectives.items() if not adam[name]}
        for dtype in [d for d in _LOW_BIT_STATE_DTYPES if d != config.optimizer.state_dtype]:
            moments = sum(_moment_bytes(v, dtype) for name, o in run.objectives.items()
                          if adam[name] for v in o.variables)
            options.append(_lightened(current, "optimizer.state_dtype", dtype,
                                      stored_bytes(optimizer_state(others)) + 2 * moments))
    if config.train.accumulation_steps > 1 and config.train.accumulation_dtype != _BFLOAT16:
        accumulated = trained_variables(run.objectives)
        options.append(_lightened(current, "train.accumulation_dtype", _BFLOAT16,
                                  num_elements(accumulated) * 2))
    # int8 moments save nothing where no tensor is quantized (`quantizes_moments`), and weigh
    # more than bfloat16 ones where most values are in such tensors.
    options = [option for option in options if option.state.total_bytes < current.total_bytes]
    return options + _together(options)


def _lightened(current: PersistentState, key: str, value: str, part_bytes: int,
               needs: dict[str, str] | None = None) -> LighterOption:
    """The option `key`=`value`, which makes the part it lightens `part_bytes` bytes."""
    state = dataclasses.replace(current, part_bytes={**current.part_bytes, LIGHTER_PARTS[key]: part_bytes})
    return LighterOption({key: value}, state, needs or {})


def _together(options: list[LighterOption]) -> list[LighterOption]:
    """The lightest option of each setting that needs nothing more, together, when there are two or
    more: each lightens a part of its own, so each part is its lightest option's."""
    lightest: dict[str, LighterOption] = {}
    for option in options:
        [key] = option.settings
        if not option.needs and (key not in lightest
                                 or option.state.total_bytes < lightest[key].state.total_bytes):
            lightest[key] = option
    if len(lightest) < 2:
        return []
    chosen = list(lightest.values())
    first = chosen[0].state
    return [LighterOption(
        {key: value for option in chosen for key, value in option.settings.items()},
        dataclasses.replace(first, part_bytes={part: min(o.state.part_bytes[part] for o in chosen)
                                               for part in first.part_bytes}))]


def _moment_bytes(variable: Any, state_dtype: str) -> int:
    """The bytes of one Adam moment of `variable` as `CompactAdam` stores it in `state_dtype`;
    none for a variable Keras overwrites, which has no moments."""
    if getattr(variable, "overwrite_with_gradient", False):
        return 0
    size = math.prod(variable.shape)
    if state_dtype != "int8":
        return size * tf.as_dtype(state_dtype).size
    if not quantizes_moments(variable):
        return size * 4  # A small tensor or an embedding table keeps float32 moments.
    blocks = low_bit.num_blocks(size)
    return blocks * low_bit.BLOCK_SIZE + blocks * 4  # A uint8 code a value; a float32 scale a block.


def optimizer_state(objectives: dict[str, Any]) -> list:
    """Every objective's optimizer variables but the scalars (its step counter and learning rate,
    which a run holds once, not per parameter): moments, quantized codes and their scales."""
    return [variable for objective in objectives.values()
            for variable in objective.optimizer.variables if len(variable.shape)]


def num_elements(variables: Iterable) -> int:
    """The values `variables` hold, summed over them."""
    return sum(math.prod(variable.shape) for variable in variables)


def stored_bytes(variables: Iterable) -> int:
    """The bytes `variables` take as stored: each one's values times its dtype's size."""
    return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables)


def peak_of(fn: Callable[..., Any], *args: Any) -> int:
    """The peak (`peak_bytes`) of a process of its own that runs `fn(*args)` and nothing else.

    The process is forked from multiprocessing's fork server, which imports TensorFlow and `fn`'s
    module once and starts nothing, so it holds none of this process's memory and skips the
    seconds of the import. It counts the import's objects as a fresh process does, but of the
    libraries' code only the pages it runs (a fresh process maps more at import): its peak is a few
    hundred MB below a fresh `python -m`'s doing the same (charlm's quick variant: 470 against 805
    MB), alike for every `fn`. `fn` and `args` must pickle. An interrupt here (Ctrl-C) ends the
    process.

    Raises:
      What `fn` raised (a RuntimeError with its traceback when that does not pickle back), and a
      RuntimeError when the process ends without reporting (killed).
    """
    context = multiprocessing.get_context("forkserver")
    # Taken when the server starts (the first call), ignored afterwards.
    context.set_forkserver_preload(["tensorflow", fn.__module__])
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_run_and_report, args=(sender, fn, args), daemon=True)
    process.start()
    sender.close()
    try:
        result = receiver.recv()
    except EOFError:  # Killed (out of memory?) or ended without a word.
        process.join()
        result = RuntimeError(f"the process measuring {fn.__qualname__} ended with exit code "
                              f"{process.exitcode} before reporting its peak")
    except BaseException:  # Interrupted here: the measuring process must not outlive the caller.
        process.kill()
        raise
    finally:
        process.join()
        receiver.close()
    if isinstance(result, BaseException):
        raise result
    return result


def _run_and_report(sender: Any, fn: Callable[..., Any], args: tuple) -> None:
    """In the measuring process: runs `fn(*args)` with its output discarded (TensorFlow's startup
    lines, logs: the caller has its own) and sends its peak, or the exception it raised."""
    with open(os.devnull, "w") as devnull:
        for descriptor in (1, 2):
            os.dup2(devnull.fileno(), descriptor)
    try:
        fn(*args)
        sender.send(peak_bytes())
    except BaseException as error:  # Everything goes back to the caller, which raises it.
        sender.send(error if _pickles_back(error)
                    else RuntimeError("".join(traceback.format_exception(error))))


def _pickles_back(error: BaseException) -> bool:
    """Whether `error` survives the pipe: some exceptions pickle but do not unpickle (their
    constructor takes other arguments than their `args`)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return False
    return True
