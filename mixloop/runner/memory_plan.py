"""The memory budget's plan: how many micro-batches, which layers recomputed (and which compile mode)
keep a run's peak under `train.memory_budget`, measured by probes of the run itself before its first
update.

A probe is the run in a process of its own (`python -m mixloop.tools.memory_probe`), as the
command line would start it, with its settings but a few: two updates, one micro-batch size, one
eval batch, a checkpoint and the export at the end, in a scratch workdir. Its peak (`peak_bytes`:
peak RSS on a CPU, the allocator's peak on a GPU) is therefore the peak of every phase a real run
goes through (the first trace and compile, the update, eval, the save, the export). Every probe but
the first is stopped once its resident set passes the budget, so none holds more than the run may.
The plan::

    the micro-batch counts: the per-replica batch's divisors from train.accumulation_steps up to
        MAX_MICRO_BATCHES
    probe the smallest micro-batch (unstopped) and the one nearest a quarter of the batch; fit
        peak = floor + slope x micro-batch (the smallest is not always the lightest: a float16
        run's precision probe at the start weighs more with more micro-batches)
    plain: from the fewest micro-batches up, the first whose fitted peak is under the budget is
        probed; under the budget, it is the plain plan; over, the line is fitted again with it
        and the next is tried
    recomputed: one micro-batch count fewer (the most, when none fits plain), with layers
        recomputed that save what the fitted peak is over: chosen from the first probe's
        per-layer activations, cheapest recomputation per byte first (doctor/activations.py),
        probed; a second choice scaled by what the first really saved
    the faster of the two by their probes' seconds per update; neither: one error line with the
        lightest probe's peak (the least budget known to fit) and what takes the memory

The plan is recorded in config.json's `resolved` record: a resume with the same budget and
settings takes it unprobed; a changed budget plans again, in one line. With jit_compile="auto" the
plan fixes the compile mode its probes ran (a run this short does not time the modes): the peak
depends on it (XLA's compiled programs and buffers are larger than graph mode's on a CPU).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple, Optional

import ml_collections
from absl import logging

from mixloop import interrupts, machine
from mixloop.config import AUTO, compiles, parse_memory_budget
from mixloop.doctor import activations
from mixloop.errors import ConfigError, UserError
from mixloop.runner import compile_mode, distribution
from mixloop.runner import workdir as workdir_lib

KEY = "memory_plan"  # Its key in config.json's `resolved` record.
PROBE_MODULE = "mixloop.tools.memory_probe"  # A probe's process: `python -m PROBE_MODULE REQUEST`.
SCRATCH_PREFIX = ".memory-probe-"
PROBE_UPDATES = 2  # The first traces and compiles; the second runs as every later one does.
TIMED_UPDATES = 2  # Then timed, after the peak is read.
MIB = 2**20
# The peak of a probe stopped when it passed the budget, or killed: more than any budget.
OVER_BUDGET = 2**62
# A plan's probe must peak this fraction under the budget: a run of many updates, evaluations and
# saves peaked up to 4.8% above its two-update probe (docs/memory.md).
HEADROOM = 0.08
WATCH_SECONDS = 0.02  # How often a probe's resident set is read against the budget.
# The most micro-batches a plan chooses: charlm at width 512 ran 2x slower per update at 256 than at
# 4 (graph mode), and XLA's step crashed at 256 micro-batches of one example (docs/memory.md).
MAX_MICRO_BATCHES = 64


@dataclasses.dataclass(frozen=True)
class Probe:
    """What one probe measured: its peak, its persistent state, the compile mode it ran, the
    seconds of an update, and each layer's activations (`activations.LayerActivations` as dicts)."""

    peak: int
    state_bytes: int
    jit_compile: Any
    seconds_per_update: float = 0.0
    layers: tuple = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    """The settings the budget chose, the peak its probe measured, and what it was planned for."""

    accumulation_steps: int
    recompute: str
    jit_compile: Any
    predicted_peak: int
    budget: int
    planned_for: dict

    def as_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def budget_bytes(value: str, accelerator: bool) -> int:
    """`train.memory_budget` in bytes: as given, or its fraction of the RAM available now.

    Raises:
      ConfigError: for a fraction on a GPU or TPU, whose memory the budget cannot read.
    """
    parsed = parse_memory_budget(value)
    if parsed is None:  # A config that did not go through validate() (a Trainer built in Python).
        raise ConfigError(f"config.train.memory_budget={value!r} is not allowed: bytes with a unit "
                          "such as '6GiB', or a fraction in (0, 1] of the available RAM such as '0.6'")
    kind, amount = parsed
    if kind == "bytes":
        return amount
    if accelerator:
        raise ConfigError(f"config.train.memory_budget={value!r} is a fraction of the RAM, but this "
                          "run's peak is its accelerator's: give bytes, such as '12GiB'")
    return int(amount * machine.available_memory())


def micro_batch_counts(batch_size: int, num_replicas: int, configured: int) -> list[int]:
    """The accumulation steps a plan may choose, fewest first: every divisor of the per-replica
    batch from `configured` up (more micro-batches never makes a run faster) to MAX_MICRO_BATCHES
    (or the configured count, when it is more)."""
    per_replica = batch_size // num_replicas
    most = max(configured, MAX_MICRO_BATCHES)
    return [k for k in range(configured, min(per_replica, most) + 1) if per_replica % k == 0]


def planned_for(config: ml_collections.ConfigDict, num_replicas: int) -> dict[str, Any]:
    """The settings a plan holds for: what changes the memory a run takes."""
    return json.loads(json.dumps({
        "replicas": num_replicas,
        "optimizer.name": config.optimizer.name,
        "train.ema_decay": config.train.ema_decay,
        "train.batch_loss": config.train.batch_loss,
        "train.memory_budget": config.train.memory_budget,
        "train.batch_size": config.train.batch_size,
        "train.accumulation_steps": config.train.accumulation_steps,
        "train.recompute": config.train.recompute,
        "eval.micro_batches": config.eval.micro_batches,
        "jit_compile": config.jit_compile,
        "precision": config.precision.to_dict(),
        "optimizer.state_dtype": config.optimizer.state_dtype,
        "train.accumulation_dtype": config.train.accumulation_dtype,
        "model": config.model.to_dict(),
        "distribution": config.distribution,
    }, default=str))


class Choice(NamedTuple):
    """A plan's settings and the probe that measured them."""

    accumulation_steps: int
    recompute: str
    probe: Probe


def choose(counts: list[int], batch_size: int, budget: int,
           measure: Callable[[int, str], Probe], configured_recompute: str = "",
           configured_mode: Any = AUTO, headroom: float = 0.0) -> Choice:
    """The fastest settings whose probe peaks under `budget` less `headroom` (a fraction of it:
    what a long run may add to its probe's peak) as the module docstring says: the fewest
    micro-batches of `counts` that fit as configured, or one micro-batch fewer with layers
    recomputed when its probe updates faster; `measure(k, recompute)` probes k micro-batches with
    `train.recompute=recompute`.

    Raises:
      UserError: when even the most micro-batches with every candidate layer recomputed peak over
        the budget, with the smallest budget that would do and what takes the memory.
    """
    probes: dict[tuple[int, str], Probe] = {}
    limit = int(budget * (1 - headroom))

    def probed(k: int, recompute: str = configured_recompute) -> Probe:
        if (k, recompute) not in probes:
            probes[k, recompute] = measure(k, recompute)
        return probes[k, recompute]

    smallest = probed(counts[-1])
    if smallest.peak == OVER_BUDGET:  # Killed or crashed: nothing to fit a line to.
        raise UserError(cannot_fit(budget, smallest, batch_size // counts[-1], configured_mode,
                                   headroom))
    if len(counts) > 1:  # A second point, far enough to show the slope.
        probed(min(counts[:-1], key=lambda k: abs(batch_size // k - batch_size // 4)))
    plain = _fewest_that_fit(counts, batch_size, limit, probes, probed, configured_recompute)
    fewer = counts.index(plain.accumulation_steps) - 1 if plain else len(counts) - 1
    recomputed = None
    if fewer >= 0:
        measured = probes.get((counts[fewer], configured_recompute))
        peak = (measured.peak if measured and measured.peak != OVER_BUDGET else
                _fitted_peak(probes, configured_recompute, batch_size, batch_size // counts[fewer]))
        recomputed = _with_recompute(counts[fewer], batch_size, limit, peak, smallest.layers,
                                     configured_recompute, probed)
    if recomputed and (plain is None or _faster(recomputed.probe, plain.probe)):
        return recomputed
    if plain:
        return plain
    # The lightest probe names the least budget: the smallest micro-batch is not always it (a
    # float16 run's precision probe weighs more with more micro-batches).
    k, lightest = min(((k, probe) for (k, r), probe in probes.items() if r == configured_recompute),
                      key=lambda item: item[1].peak)
    raise UserError(cannot_fit(budget, lightest, batch_size // k, configured_mode, headroom))


def _faster(a: Probe, b: Probe) -> bool:
    """Whether `a` updated faster than `b` (a probe whose data ended before its timing has no
    speed: never faster)."""
    return 0 < a.seconds_per_update and (b.seconds_per_update <= 0
                                         or a.seconds_per_update < b.seconds_per_update)


def _fewest_that_fit(counts: list[int], batch_size: int, budget: int, probes: dict,
                     probed: Callable[..., Probe], recompute: str) -> Optional[Choice]:
    """The fewest micro-batches whose probe fits, trying only those the line fitted so far
    predicts to fit, and none as large as a micro-batch already over but the smallest (each new
    probe refits the line); None when none does."""
    for k in counts:
        over = [batch_size // j for (j, r), probe in probes.items()
                if r == recompute and probe.peak > budget and j != counts[-1]]
        if (k, recompute) not in probes and (
                any(batch_size // k >= size for size in over)
                or _fitted_peak(probes, recompute, batch_size, batch_size // k) > budget):
            continue
        if probed(k).peak <= budget:
            return Choice(k, recompute, probes[k, recompute])
    return None


def _with_recompute(k: int, batch_size: int, budget: int, fitted_peak: float, layers: tuple,
                    configured: str, probed: Callable[..., Probe]) -> Optional[Choice]:
    """`k` micro-batches with the layers recomputed that bring `fitted_peak` under the budget
    (activations.chosen), probed; a second choice when the first saved less than its count said
    (the count is an upper bound), scaled by what the first saved. None when the candidates cannot
    save enough, or neither fits."""
    micro_batch = batch_size // k
    needed = (fitted_peak - budget) / micro_batch
    candidates = [activations.LayerActivations(**layer) for layer in layers]
    efficiency = 1.0
    for _ in range(2):
        picked = activations.chosen(candidates, needed / efficiency)
        counted = sum(layer.bytes_per_example for layer in picked)
        if not picked or counted * efficiency < needed:
            return None
        recompute = "|".join(filter(None, [configured, activations.pattern(picked)]))
        probe = probed(k, recompute)
        if probe.peak <= budget:
            return Choice(k, recompute, probe)
        if probe.peak == OVER_BUDGET:  # Failed or killed: no second try.
            return None
        efficiency = max((fitted_peak - probe.peak) / (micro_batch * counted), 0.05)
    return None


def _fitted_peak(probes: dict, recompute: str, batch_size: int, micro_batch: int) -> float:
    """The peak a line through the probes (with `recompute`) of the smallest micro-batch and of
    the largest one probed so far, stopped ones left out, predicts for `micro_batch` examples."""
    sizes = sorted((batch_size // k, probe.peak) for (k, r), probe in probes.items()
                   if r == recompute and probe.peak != OVER_BUDGET)
    (m0, p0), (m1, p1) = sizes[0], sizes[-1]
    slope = (p1 - p0) / (m1 - m0) if m1 > m0 else 0.0
    return p0 + max(slope, 0.0) * (micro_batch - m0)


def cannot_fit(budget: int, smallest: Probe, micro_batch: int, configured_mode: Any,
               headroom: float = 0.0) -> str:
    """The error line of a budget no plan fits."""
    if smallest.peak == OVER_BUDGET:
        return (f"config.train.memory_budget={_mib(budget)} cannot hold this run: the probe of "
                f"{micro_batch} example(s) per micro-batch was killed before it finished (out of "
                "memory?); free memory on this machine, or make the state lighter "
                "(precision.master_weights, optimizer.state_dtype) or recompute layers "
                "(train.recompute)")
    rest = smallest.peak - smallest.state_bytes
    mode_hint = ("" if configured_mode != AUTO else
                 "; or a lighter compile mode (--config.jit_compile=False where it ran XLA)")
    return (f"config.train.memory_budget={_mib(budget)} cannot hold this run: even {micro_batch} "
            f"example(s) per micro-batch peak at {_mib(smallest.peak)} (persistent state "
            f"{_mib(smallest.state_bytes)}, the runtime, compiled code and activations {_mib(rest)}); "
            f"give a budget of at least {_mib(smallest.peak / (1 - headroom))}, or make the state lighter "
            f"(precision.master_weights, optimizer.state_dtype) or recompute layers "
            f"(train.recompute){mode_hint}")


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / MIB:,.0f} MiB"


def describe(plan: Plan, batch_size: int, source: str) -> str:
    """The plan's one line."""
    k = plan.accumulation_steps
    mode = {True: "XLA", False: "graph mode", "elementwise": "elementwise"}.get(plan.jit_compile,
                                                                                  str(plan.jit_compile))
    return (f"Memory plan for train.memory_budget={_mib(plan.budget)} ({source}): {k} micro-batch(es) "
            f"of {batch_size // k} (train.accumulation_steps={k}), "
            f"{_describe_recompute(plan.recompute)}, train step in {mode}; "
            f"predicted peak {plan.predicted_peak / MIB:,.0f} MiB")


def _describe_recompute(recompute: str) -> str:
    layers = recompute.split("|") if recompute else []
    if not layers:
        return "no layer recomputed"
    shown = ", ".join(layer.replace("\\", "") for layer in layers[:4])
    return f"{len(layers)} layer pattern(s) recomputed ({shown}{', ...' if len(layers) > 4 else ''})"


def describe_peak(peak: int, plan: Optional[Plan]) -> str:
    """The line a finished run states its peak in, against the plan's prediction and budget."""
    line = f"Peak memory of this process: {_mib(peak)}"
    if plan is None:
        return line
    return (f"{line}; the memory plan predicted {_mib(plan.predicted_peak)} "
            f"({(peak - plan.predicted_peak) / plan.predicted_peak:+.1%}) for a budget of "
            f"{_mib(plan.budget)}")


def planned(config: ml_collections.ConfigDict, directory: str, trainer_class: type,
            num_replicas: int, own_data: bool = True
            ) -> tuple[ml_collections.ConfigDict, Optional[Plan]]:
    """`config` as `train.memory_budget` plans it (a copy), and the plan; unchanged and None
    without a budget. Takes config.json's recorded plan when it was made for these settings.
    `own_data`: the run reads the Trainer's own datasets and metrics (a tool's seams would not
    reach the probes).

    Raises:
      UserError: for a run the planner cannot probe (several workers, a Trainer that does not
        import by name, a tool's data), one a budget cannot hold, or a probe that fails (its
        error line).
    """
    if not config.train.memory_budget:
        return config, None
    if config.distribution == "multi_worker":
        raise ConfigError("config.train.memory_budget is not supported with "
                          "distribution='multi_worker' yet: plan on one worker, or set it to ''")
    if not own_data:
        raise ConfigError("config.train.memory_budget plans a run of the Trainer's own "
                          "build_datasets(): set it to '' for a tool's run (the benchmark)")
    wanted = planned_for(config, num_replicas)
    recorded = workdir_lib.read_resolved(directory).get(KEY)
    plan = _recorded_plan(recorded) if isinstance(recorded, dict) and \
        recorded.get("planned_for") == wanted else None
    if plan is not None:
        source = "as config.json records for this workdir"
    else:
        if isinstance(recorded, dict):
            logging.info("config.train.memory_budget or the settings it planned for changed since "
                         "config.json's plan (%s micro-batch(es)): planning again",
                         recorded.get("accumulation_steps"))
        plan = _measure_plan(config, directory, _importable(trainer_class), num_replicas,
                             distribution.has_accelerator())
        source = "measured"
    logging.info("%s", describe(plan, config.train.batch_size // num_replicas, source))
    return applied(config, plan), plan


def _recorded_plan(recorded: dict) -> Optional[Plan]:
    """The plan config.json records, or None for a record no run of this version wrote (or one
    edited into something no plan is: it is planned again)."""
    try:
        plan = Plan(**recorded)
    except TypeError:
        return None
    valid = (isinstance(plan.accumulation_steps, int) and plan.accumulation_steps >= 1
             and isinstance(plan.recompute, str) and compiles(plan.recompute)
             and isinstance(plan.predicted_peak, int) and plan.predicted_peak > 0
             and isinstance(plan.budget, int) and plan.budget > 0
             and compile_mode.is_mode(plan.jit_compile))
    return plan if valid else None


def applied(config: ml_collections.ConfigDict, plan: Plan) -> ml_collections.ConfigDict:
    """A copy of `config` with the plan's settings."""
    result = copy.deepcopy(config)
    result.train.accumulation_steps = plan.accumulation_steps
    result.train.recompute = plan.recompute
    result.jit_compile = plan.jit_compile
    return result


def record(directory: str, plan: Optional[Plan]) -> None:
    """Records `plan` in config.json's `resolved` record (which `write_config` wrote)."""
    if plan is not None:
        workdir_lib.record_resolved(directory, {KEY: plan.as_record()})


def _measure_plan(config: ml_collections.ConfigDict, directory: str, trainer_path: str,
                  num_replicas: int, accelerator: bool) -> Plan:
    """Probes and chooses (`choose`), logging each probe."""
    budget = budget_bytes(config.train.memory_budget, accelerator)
    counts = micro_batch_counts(config.train.batch_size, num_replicas,
                                config.train.accumulation_steps)
    per_replica = config.train.batch_size // num_replicas
    # A stop kills the probe and removes its folder, then exits.
    with interrupts.unwinding(), workdir_lib.scratch_folder(directory, SCRATCH_PREFIX) as scratch:
        def measure(k: int, recompute: str) -> Probe:
            folder = os.path.join(scratch, f"probe-{len(os.listdir(scratch))}")
            try:
                # The smallest micro-batch unstopped: its peak is the least budget that fits.
                smallest = (k, recompute) == (counts[-1], config.train.recompute)
                probe = run_probe(config, k, recompute, trainer_path, folder,
                                  None if smallest or accelerator else budget, layers=smallest)
            except UserError as error:
                if recompute == config.train.recompute:
                    raise
                logging.warning("%s: planning without it", error)
                return Probe(peak=OVER_BUDGET, state_bytes=0, jit_compile=config.jit_compile)
            settings = (f"{k} micro-batch(es) of {per_replica // k}" + (
                "" if recompute == config.train.recompute else f", {_describe_recompute(recompute)}"))
            if probe.peak == OVER_BUDGET:
                logging.info("Memory probe: %s stopped over the budget", settings)
            else:
                logging.info("Memory probe: %s peak at %s, %.2f s per update", settings,
                             _mib(probe.peak), probe.seconds_per_update)
            return probe

        choice = choose(counts, per_replica, budget, measure, config.train.recompute,
                        config.jit_compile, HEADROOM)
    return Plan(accumulation_steps=choice.accumulation_steps, recompute=choice.recompute,
                jit_compile=choice.probe.jit_compile, predicted_peak=choice.probe.peak,
                budget=budget, planned_for=planned_for(config, num_replicas))


def _watched(process: subprocess.Popen, budget: Optional[int]) -> bool:
    """Waits for `process`, killing it once its resident set passes `budget` (read from /proc
    every WATCH_SECONDS; without /proc or a budget, only waits); whether it was stopped."""
    status = f"/proc/{process.pid}/status"
    while process.poll() is None:
        if budget is not None and _resident_bytes(status) > budget:
            process.kill()
            process.wait()
            return True
        time.sleep(WATCH_SECONDS)
    return False


def _resident_bytes(status: str) -> int:
    """VmRSS of a /proc/PID/status file, in bytes (0 once the process is gone, or off Linux)."""
    try:
        with open(status) as file:
            for line in file:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _importable(trainer_class: type) -> str:
    """The dotted path a probe's process imports `trainer_class` by.

    Raises:
      UserError: for a class defined in a script or a function, which no other process imports.
    """
    module, name = trainer_class.__module__, trainer_class.__qualname__
    if module == "__main__" or "." in name:  # A script's, a function's or a nested class.
        raise UserError(f"config.train.memory_budget probes the run in processes of their own, which "
                        f"cannot import {name} (defined in {module}); define the Trainer in a module "
                        f"and name it in config.trainer, or set the budget to ''")
    return f"{module}.{name}"


def probe_config(config: ml_collections.ConfigDict, accumulation_steps: int, recompute: str,
                 trainer_path: str) -> ml_collections.ConfigDict:
    """The probe's run: the run's settings but a few updates of one micro-batch size and
    `recompute`, one eval batch and no budget of its own."""
    probe = copy.deepcopy(config)
    probe.trainer = trainer_path
    probe.train.memory_budget = ""
    probe.train.accumulation_steps = accumulation_steps
    probe.train.recompute = recompute
    probe.train.num_steps = PROBE_UPDATES
    probe.train.steps_per_loop = 1
    probe.train.log_every_steps = PROBE_UPDATES
    probe.train.max_recoveries = 0
    probe.precision.heal = False
    probe.optimizer.warmup_steps = 0
    probe.eval.num_batches = 1
    probe.eval.every_steps = 0
    probe.checkpoint.every_steps = 0
    return probe


def run_probe(config: ml_collections.ConfigDict, accumulation_steps: int, recompute: str,
              trainer_path: str, directory: str, budget: Optional[int] = None,
              layers: bool = False) -> Probe:
    """Runs the probe of `accumulation_steps` micro-batches and `train.recompute=recompute` in a
    process of its own, in `directory`; what it measured. A probe whose resident set passes
    `budget` is stopped there (so no probe holds more than the run may), as is one the kernel
    kills: its peak is OVER_BUDGET. With `layers`, it also traces each layer's activations (after
    its peak is read).

    Raises:
      UserError: with the probe's own error line, or its last words when it died.
    """
    os.makedirs(directory, exist_ok=True)
    request = os.path.join(directory, "probe.pickle")
    try:
        with open(request, "wb") as file:
            pickle.dump({"config": probe_config(config, accumulation_steps, recompute,
                                                trainer_path).to_dict(),
                         "sys_path": sys.path, "timed_updates": TIMED_UPDATES, "layers": layers},
                        file)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise UserError(f"config.train.memory_budget sends the config to its probes, but a value "
                        f"of the config does not pickle ({error}); keep the config to plain "
                        "values, or set the budget to ''") from None
    with open(os.path.join(directory, "probe.log"), "w+", errors="replace") as log:
        process = subprocess.Popen([sys.executable, "-m", PROBE_MODULE, request],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            stopped = _watched(process, budget)
        finally:
            if process.poll() is None:  # Interrupted: the probe must not outlive the run.
                process.kill()
                process.wait()
        log.seek(0)
        lines = log.read().splitlines()
    result = os.path.join(directory, "result.json")
    if stopped or process.returncode == -signal.SIGKILL:  # Over the budget, or the OOM killer.
        return Probe(peak=OVER_BUDGET, state_bytes=0, jit_compile=config.jit_compile)
    if process.returncode < 0:  # A crash of TensorFlow's (a segmentation fault): not a plan.
        logging.warning("The memory probe of %d micro-batch(es) crashed (%s): left out of the plan",
                        accumulation_steps, signal.Signals(-process.returncode).name)
        return Probe(peak=OVER_BUDGET, state_bytes=0, jit_compile=config.jit_compile)
    if process.returncode or not os.path.exists(result):
        said = [line for line in lines if line.startswith("error:")]
        cause = said[-1][len("error:"):].strip() if said else (
            f"it ended with exit status {process.returncode}: "
            + (lines[-1].strip() if lines else "no output"))
        raise UserError(f"the memory probe of {accumulation_steps} micro-batch(es) "
                        f"(train.memory_budget) failed: {cause}")
    with open(result) as file:
        measured = json.load(file)
    return Probe(**{**measured, "layers": tuple(measured["layers"])})
