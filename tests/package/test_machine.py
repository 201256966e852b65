"""The machine's facts (mixloop/machine.py): the one reader of /proc/cpuinfo."""

import os

from mixloop import machine


def test_the_cpu_has_a_model_name_and_sorted_flags():
    cpu = machine.cpu()
    flags = cpu["flags"].split()
    assert flags == sorted(flags)
    if os.path.exists("/proc/cpuinfo"):
        assert cpu["model"] and "sse2" in flags  # Every x86-64 CPU has it.


def test_usable_cores_are_this_processs_affinity():
    assert 1 <= machine.usable_cores() <= (os.cpu_count() or 1)
