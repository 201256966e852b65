"""Memory: what a run weighs. The persistent state it keeps, in bytes per parameter by part, and the
peak its process (or device) reaches.

Persistent state lives for the whole run, whatever the batch: the weights, the optimizers' state,
the gradient accumulators of `train.accumulation_steps` > 1 and the EMA's averages. Each part is
counted from its variables as they are stored (a float32 value 4 bytes, a bfloat16 one 2, an int8
code 1), over the model's trainable parameters: float32 Adam with two micro-batches keeps
4 + 8 + 4 = 16 bytes per parameter before a single activation. The peak (`peak_bytes`) adds the
rest: activations, workspaces, compiled code, the runtime itself.
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
from typing import Any, Callable, Iterable

import tensorflow as tf

PARTS = ("weights", "optimizer state", "accumulators", "EMA")  # In the order the line shows them.
_ACCELERATORS = ("GPU", "TPU")
_UNITS = ("B", "kB", "MB", "GB", "TB")


def peak_bytes() -> int:
    """The most memory this process has held so far, in bytes: the device allocator's peak where
    there is a GPU or TPU (the largest over the devices: the one that runs out first), else the
    host's peak resident set size."""
    devices = [f"{kind}:{index}" for kind in _ACCELERATORS
               for index in range(len(tf.config.list_logical_devices(kind)))]
    if devices:
        return max(tf.config.experimental.get_memory_info(device)["peak"] for device in devices)
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, kilobytes on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit


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


def persistent_state(trainer: Any) -> PersistentState:
    """The persistent state of a built Trainer, from its `model` (the trainable parameters and the
    weights), `objectives` (their optimizers' state; the variables accumulated), `train_step.ema`
    and `config.train` (accumulation_steps, accumulation_dtype)."""
    train = trainer.config.train
    weights = trainer.model.trainable_variables
    accumulated = ([v for objective in trainer.objectives.values() for v in objective.variables]
                   if train.accumulation_steps > 1 else [])
    averages = [v for ema in trainer.train_step.ema.values() for v in ema.averages]
    return PersistentState(num_elements(weights), {
        "weights": stored_bytes(weights),
        "optimizer state": stored_bytes(optimizer_state(trainer.objectives)),
        "accumulators": num_elements(accumulated) * tf.as_dtype(train.accumulation_dtype).size,
        "EMA": stored_bytes(averages),
    })


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
