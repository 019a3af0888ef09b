"""Which process is which: the roles of a job's processes and the keys that name them.

A job's processes are the workers (ranks) and, with parameter servers, one
scheduler and the servers.  Each has a *key* that names it in output
prefixes and exit records: the rank (an int) for a worker, ``"server N"``
or ``"scheduler"`` otherwise.
"""

from __future__ import annotations

#: Process roles; workers are the ranks, the others exist only with parameter servers.
WORKER, SERVER, SCHEDULER = "worker", "server", "scheduler"
#: Key of a process: the rank for a worker, "server N" / "scheduler" otherwise.
Key = int | str


def process_key(role: str, index: int) -> Key:
    """The key of the ``index``-th process of ``role``: the rank for a worker, ``"server N"`` or ``"scheduler"``."""
    if role == WORKER:
        return index
    return SCHEDULER if role == SCHEDULER else f"{role} {index}"


def process_name(role: str, index: int) -> str:
    """``"rank 3"``, ``"server 0"`` or ``"scheduler"``."""
    return f"rank {index}" if role == WORKER else str(process_key(role, index))


def parse_key(text: str) -> Key:
    """The key written in an output prefix: ``"3"`` -> 3, ``"server 0"`` stays a string."""
    return int(text) if text.isdigit() else text
