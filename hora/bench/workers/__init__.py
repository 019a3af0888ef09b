"""The programs ``hora bench`` launches with ``hora run``: one module per benchmark.

Each is run as ``python -m hora.bench.workers.NAME ...`` on every rank and
reports through :func:`hora.bench.jobs.emit` event lines (``progress`` from
rank 0, one ``result`` per rank).  They import torch or the KVStore only
inside the job, never in the driver.
"""

from __future__ import annotations

import os

#: Clock ticks per second of /proc/stat.
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def host_cpu() -> tuple[float, float] | None:
    """This host's (busy, total) CPU-seconds since boot, summed over its cores; None without /proc/stat.

    Busy is user + nice + system + irq + softirq + steal; total adds idle and
    iowait.  Emulated hosts share the machine's ``/proc/stat``, so on an
    emulated cluster this is the whole machine, every host's processes and
    the kernel's packet work included (and any other load on it).
    """
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0.0] * 8)[:8]
    busy = user + nice + system + irq + softirq + steal
    return busy / _TICKS, (busy + idle + iowait) / _TICKS


def cpu_use(before: tuple[float, float] | None, after: tuple[float, float] | None,
            iterations: int) -> dict[str, float] | None:
    """``{"busy": share of all cores busy, "cpu_s": busy CPU-seconds per iteration}`` between two samples."""
    if before is None or after is None or after[1] <= before[1] or iterations < 1:
        return None
    busy = after[0] - before[0]
    return {"busy": busy / (after[1] - before[1]), "cpu_s": busy / iterations, "cores": float(os.cpu_count() or 1)}
