"""Where each process of a job runs, and what it runs.

The launcher says where the hosts come from; workers fill them in order,
each host up to its slots, so the ranks of one host are consecutive
(Horovod's placement, :func:`hora.placement.place_ranks`).  With parameter servers
(``-s S``) the scheduler runs on rank 0's host and server ``i`` on host
``i mod H`` of the host list (MXNet's ssh launcher places them round-robin
the same way), or, with ``--server-hosts``, on host ``i mod K`` of those K
hosts, which may be hosts that run no worker: then no worker shares a
server's link, as in the parameter-server papers' set-ups.  Servers and the scheduler run ``python -m
hora.kvstore.ps.node``; their role comes from ``DMLC_ROLE``.
"""

from __future__ import annotations

import os
import re
import socket
import sys

from hora.placement import place_ranks
from hora.runner.hostlist import is_local_host
from hora.runner.keys import SCHEDULER, SERVER, WORKER
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import Slot
from hora.runner.launchers.registry import launcher_class

#: The module servers and the scheduler run.
PS_NODE_MODULE = "hora.kvstore.ps.node"
_PYTHON = re.compile(r"^python[0-9.]*$")


def plan_slots(config: LaunchConfig) -> list[Slot]:
    """Every process of the job: scheduler and servers first (when ``-s`` > 0), then the ranks.

    The launcher says where the hosts come from (:meth:`Launcher.hosts`);
    the ranks fill them with :func:`hora.placement.place_ranks`.

    Raises:
        LaunchError: the launcher cannot obtain its hosts (e.g. slurm outside an allocation).
    """
    launcher = launcher_class(str(config.launcher))
    hosts = launcher.hosts(config)
    workers = [Slot.worker(p) for p in place_ranks(hosts, config.num_proc)]
    if config.num_servers == 0:
        return workers
    server_hosts = [socket.gethostname() if is_local_host(h) else h for h in config.server_host_list]
    if not server_hosts:
        server_hosts = launcher.server_hosts(hosts, workers, config.num_servers)
    plan = [
        Slot(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1, host=workers[0].host,
             role=SCHEDULER)
    ]
    for index in range(config.num_servers):
        plan.append(
            Slot(rank=index, size=config.num_servers, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                 host=server_hosts[index % len(server_hosts)], role=SERVER)
        )
    return plan + workers


def server_python(config: LaunchConfig) -> str:
    """The interpreter for servers: the workers' one when the command starts with python, else ours."""
    program = config.command[0]
    return program if _PYTHON.match(os.path.basename(program)) else sys.executable


def slot_command(config: LaunchConfig, slot: Slot) -> list[str]:
    """The command line of one process: the user's command for a worker, the PS node otherwise."""
    if slot.role == WORKER:
        return list(config.command)
    return [server_python(config), "-m", PS_NODE_MODULE]


def workers_per_host(slots: list[Slot]) -> int:
    """The most workers any host runs (splits the CPUs between them, see OMP_NUM_THREADS)."""
    counts: dict[str, int] = {}
    for slot in slots:
        if slot.role == WORKER:
            counts[slot.host] = counts.get(slot.host, 0) + 1
    return max(counts.values(), default=1)
