"""Where a grid-engine (SGE) parallel job's processes run: its granted hosts and slots (``$PE_HOSTFILE``).

The sge launcher (:mod:`hora.runner.launchers.sge`) starts the processes;
this module only reads what the grid engine granted and places the job on
it, so that :mod:`hora.runner.plan` can use it without the launcher.
"""

from __future__ import annotations

import collections
import os
import shutil
from collections.abc import Mapping, Sequence

from hora import envvars
from hora.errors import LaunchError
from hora.runner.config import HostSlots, LaunchConfig
from hora.runner.keys import SCHEDULER, SERVER
from hora.runner.launchers.base import Slot, assign_ranks

#: The parallel environment ``hora run --launcher sge`` submits to when ``--sge-pe`` is not given.
DEFAULT_PE = "hora"


def inside_job(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a grid-engine parallel job (``PE_HOSTFILE`` and ``JOB_ID`` set)."""
    environ = os.environ if environ is None else environ
    return bool(environ.get(envvars.PE_HOSTFILE) and environ.get(envvars.JOB_ID))


def find_tool(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The grid engine's ``name`` (qsub, qrsh, qconf) on PATH.

    Raises:
        LaunchError: it is not there; the message says how to get it.
    """
    environ = os.environ if environ is None else environ
    found = shutil.which(name, path=environ.get("PATH"))
    if found is None:
        raise LaunchError(
            f"--launcher sge needs the grid engine's {name} on PATH, and it is not there: load the grid "
            "engine's settings (. $SGE_ROOT/$SGE_CELL/common/settings.sh) or install its client "
            "(Debian: apt-get install gridengine-client)"
        )
    return found


def parse_pe_hostfile(text: str, where: str = "$PE_HOSTFILE") -> list[HostSlots]:
    """The hosts of a ``$PE_HOSTFILE`` with their granted slots, in the file's order.

    Each line is ``host slots queue processors``; a host listed more than
    once (slots from several queues) gets the sum of its slots.

    Raises:
        LaunchError: a line is malformed, or the file lists no slots.
    """
    slots: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 2 or not fields[1].isdigit():
            raise LaunchError(f"{where}:{number}: cannot read {line!r} (expected 'host slots queue processors')")
        slots[fields[0]] = slots.get(fields[0], 0) + int(fields[1])
    hosts = [HostSlots(host, count) for host, count in slots.items() if count > 0]
    if not hosts:
        raise LaunchError(f"{where} grants no slots")
    return hosts


def job_hosts(environ: Mapping[str, str] | None = None) -> list[HostSlots]:
    """The hosts and slots the grid engine granted this job (``$PE_HOSTFILE``).

    Raises:
        LaunchError: not inside a parallel job, or the file cannot be read.
    """
    environ = os.environ if environ is None else environ
    path = environ.get(envvars.PE_HOSTFILE)
    if not path or not environ.get(envvars.JOB_ID):
        raise LaunchError(
            "--launcher sge found no parallel job here (PE_HOSTFILE and JOB_ID are not set): run hora run inside "
            f"'qsub -pe PE N', or let it submit one (hora run --launcher sge --sge-pe {DEFAULT_PE} -np N ...)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            return parse_pe_hostfile(f.read(), path)
    except OSError as e:
        raise LaunchError(f"cannot read the job's PE_HOSTFILE {path!r}: {e.strerror}") from e


def plan_job_slots(config: LaunchConfig, hosts: Sequence[HostSlots]) -> list[Slot]:
    """Every process of the job on the granted slots: workers first, then each server in a slot of its own.

    Workers fill the hosts in ``$PE_HOSTFILE`` order; servers take the
    slots left after them (the grid engine counts a server as a task like a
    rank), and the scheduler, which does little, runs beside rank 0.

    Raises:
        LaunchError: the job has fewer slots than workers plus servers; the
            message names the ``qsub -pe`` request that fits.
    """
    granted = sum(h.slots for h in hosts)
    needed = config.num_proc + config.num_servers
    if granted < needed:
        servers = f" and {config.num_servers} servers" if config.num_servers else ""
        pe = os.environ.get(envvars.PE) or DEFAULT_PE
        raise LaunchError(
            f"the grid engine granted this job {granted} slots, but -np {config.num_proc}{servers} need "
            f"{needed}: submit with 'qsub -pe {pe} {needed}' (or lower -np)"
        )
    workers = assign_ranks(hosts, config.num_proc)
    if config.num_servers == 0:
        return workers
    used = collections.Counter(s.host for s in workers)
    free = [h.host for h in hosts for _ in range(h.slots - used[h.host])]
    plan = [Slot(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1, host=workers[0].host,
                 role=SCHEDULER)]
    for index in range(config.num_servers):
        plan.append(Slot(rank=index, size=config.num_servers, local_rank=0, local_size=1, cross_rank=0,
                         cross_size=1, host=free[index], role=SERVER))
    return plan + workers
