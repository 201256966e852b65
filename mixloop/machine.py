"""The machine a run is measured on: its CPU's model name and instruction-set flags, the cores this
process may use (the one reader of /proc/cpuinfo), its available RAM, and handing freed memory back
to it."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
from typing import Any


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


def available_memory() -> int:
    """The bytes of RAM the kernel says new work can take without swapping (/proc/meminfo's
    MemAvailable); off Linux, the physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                name, _, value = line.partition(":")
                if name == "MemAvailable":
                    return int(value.split()[0]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def release_free_memory() -> None:
    """Hands the C heap's free pages back to the operating system (glibc's `malloc_trim`; nothing
    elsewhere). TensorFlow on a CPU allocates through malloc, which keeps what a traced graph or a
    larger earlier step freed: without this, a checkpoint save after the train loop grows the
    resident set past the loop's peak instead of reusing those pages (docs/memory.md)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None (another C library: musl, macOS); looked up once."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
