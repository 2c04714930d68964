"""CPU time used by other processes, read from /proc (Linux).

Wall-clock throughput on a shared 2-core machine moves by several percent from run to run,
more than some costs being measured (tracing's is meant to be under 2%). CPU seconds a
process spent per request do not depend on what else ran meanwhile, so a benchmark can
report them beside its throughput as the steadier measure of the same cost.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of `pid` (all its threads); None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces; the fields after its ')' are fixed.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / _TICKS_PER_S


def total_cpu_s(pids: Iterable[int]) -> float | None:
    """Summed CPU seconds of `pids`; None if any of them cannot be read."""
    total = 0.0
    for pid in pids:
        used = process_cpu_s(pid)
        if used is None:
            return None
        total += used
    return total
