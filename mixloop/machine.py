"""The machine a run is measured on: its CPU's model name and instruction-set flags, and the cores this
process may use (the one reader of /proc/cpuinfo)."""

from __future__ import annotations

import os
import platform


def cpu() -> dict[str, str]:
    """{"model": the CPU's model name, "flags": its instruction-set flags, sorted, space-separated};
    off Linux, the platform's description and no flags."""
    found = {"model": "", "flags": ""}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "model name" and not found["model"]:
                    found["model"] = value.strip()
                elif name.strip() == "flags" and not found["flags"]:
                    found["flags"] = " ".join(sorted(value.split()))
    except OSError:
        found["model"] = platform.processor()
    return found


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
