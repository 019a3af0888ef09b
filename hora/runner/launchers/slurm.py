"""The slurm launcher: inside an allocation, srun starts the ranks.

``hora run -np N cmd`` inside ``salloc``/``sbatch`` runs ``srun --ntasks N
--kill-on-bad-exit=1 python -m hora.runner.mpi_child -- cmd``: the same
per-rank wrapper as under mpirun, so output is prefixed by rank and each
rank's exit is reported.  Ranks read their place in the job from srun's
``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID`` and
``SLURM_TASKS_PER_NODE`` (see :mod:`hora.core.topology`).  Rank 0 runs on
the first node of the allocation, so that node is the rendezvous address.
With ``--kill-on-bad-exit``, Slurm itself stops every rank when one fails;
hora names the root cause from the wrappers' reports.  On several nodes, a
beat-only agent per other node (a :class:`~hora.runner.launchers.ssh.HostWatch`
reached with ``srun --overlap``, see :func:`watch_command`) beats with hora
run: a node that stops answering ends the job within ``HORA_HEARTBEAT_TIMEOUT``
and the report names it.
"""

from __future__ import annotations

import logging
import os
import random
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from hora import envvars
from hora.config import HeartbeatConfig
from hora.errors import LaunchError, TopologyError
from hora.placement import HostSlots, expand_slurm_counts
from hora.runner.env import Endpoints, free_port, interface_address
from hora.runner.hostlist import is_local_host, spread
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import Interrupt, JobResult, Slot, new_group_kwargs
from hora.runner.launchers.mpi import ToolSupervisor
from hora.runner.launchers.registry import (
    MPI_ARGS_NEED_MPIRUN,
    MPI_NEEDS_MPIRUN,
    SERVERS_NEED_HORA,
    SYNC_NEEDS_SSH,
    Capabilities,
    Launcher,
    Request,
)
from hora.runner.output import OutputSink
from hora.runner.ssh import SshOptions, agent_command

logger = logging.getLogger(__name__)


def find_srun(env: Mapping[str, str]) -> str:
    """srun on PATH.

    Raises:
        LaunchError: there is no srun, or this is not inside an allocation.
    """
    if not env.get(envvars.SLURM_JOB_ID):
        raise LaunchError(
            "--launcher slurm runs inside a Slurm allocation (SLURM_JOB_ID is not set): "
            "start hora run from salloc or an sbatch script"
        )
    found = shutil.which("srun", path=env.get("PATH"))
    if found is None:
        raise LaunchError("--launcher slurm needs srun on PATH")
    return found


def allocation_nodes(env: Mapping[str, str]) -> list[str]:
    """The allocation's node names, in Slurm's order (``scontrol show hostnames``).

    Raises:
        LaunchError: the node list cannot be read or expanded.
    """
    nodelist = env.get(envvars.SLURM_JOB_NODELIST) or env.get(envvars.SLURM_NODELIST)
    if not nodelist:
        raise LaunchError("SLURM_JOB_NODELIST is not set; is this a Slurm allocation?")
    if "[" not in nodelist:
        return [n for n in nodelist.split(",") if n]
    try:
        result = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with scontrol: {e}") from e
    nodes = result.stdout.split()
    if result.returncode != 0 or not nodes:
        raise LaunchError(f"scontrol cannot expand SLURM_JOB_NODELIST={nodelist!r}: {result.stderr.strip()}")
    return nodes


def expand_counts(compressed: str) -> list[int]:
    """Expand Slurm's ``2(x3),1`` notation into ``[2, 2, 2, 1]`` (:func:`hora.core.topology.expand_slurm_counts`).

    Raises:
        LaunchError: the text is not in that notation.
    """
    try:
        return expand_slurm_counts(compressed)
    except TopologyError as e:
        raise LaunchError(str(e)) from None


def allocation_hosts(num_proc: int, environ: Mapping[str, str] | None = None) -> list[HostSlots]:
    """The allocation's nodes with the ranks srun will put on each.

    srun fills the nodes as the allocation lays its tasks out
    (``SLURM_TASKS_PER_NODE``) when ``num_proc`` matches it; otherwise the
    ranks are spread evenly (an estimate, used for ``OMP_NUM_THREADS`` and
    messages only: the ranks read their real place from srun).

    Raises:
        LaunchError: not inside an allocation.
    """
    environ = os.environ if environ is None else environ
    find_srun(environ)
    nodes = allocation_nodes(environ)
    tasks_per_node = environ.get(envvars.SLURM_TASKS_PER_NODE)
    counts = expand_counts(tasks_per_node) if tasks_per_node else []
    if len(counts) == len(nodes) and sum(counts) == num_proc:
        return [HostSlots(n, c) for n, c in zip(nodes, counts, strict=True)]
    return [h for h in spread([HostSlots(n, 1, fixed=False) for n in nodes], num_proc) if h.slots > 0]


def srun_command(config: LaunchConfig, srun: str) -> list[str]:
    """The srun command line of the job."""
    command = [srun, "--ntasks", str(config.num_proc), "--kill-on-bad-exit=1", "--export=ALL"]
    command += [sys.executable, "-m", "hora.runner.mpi_child", "--", *config.command]
    return command


def watch_command(srun: str, host: str, path: str | None) -> list[str]:
    """A beat-only agent on ``host`` as a job step of its own beside the ranks' (``srun --overlap``).

    srun is the allocation's own authenticated way onto its nodes, where ssh
    may be refused; ``--overlap`` shares the CPUs the ranks' step holds.
    """
    return [srun, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--export=ALL", "--quiet",
            "sh", "-c", agent_command(path)]


class SlurmLauncher(Launcher):
    """Runs the ranks with srun inside the current allocation (see :class:`Launcher`)."""

    name = "slurm"
    summary = "srun inside an allocation"
    detects = "inside a Slurm allocation"
    priority = 20  # a batch system's job: its allocation says where the ranks go
    capabilities = Capabilities(host_list=False)
    refusals = {
        "elastic": ("elastic training (--min-np/--max-np/--host-discovery-script) needs {able}: an srun job step's "
                    "tasks are fixed; drop --launcher slurm (hora then runs the workers itself, on the hosts the "
                    "discovery script names)"),
        "controller": MPI_NEEDS_MPIRUN,
        "servers": SERVERS_NEED_HORA,
        "host_list": "--launcher slurm takes its hosts from the Slurm allocation; drop -H/--hostfile",
        "sync_dst_dir": SYNC_NEEDS_SSH,
        "mpi_args": MPI_ARGS_NEED_MPIRUN,
    }

    @classmethod
    def detect(cls, request: Request) -> bool:
        """Inside a Slurm allocation (``SLURM_JOB_ID`` set, srun on PATH) when no host list was given."""
        env = request.environ
        return (request.hosts is None and bool(env.get(envvars.SLURM_JOB_ID))
                and shutil.which("srun", path=env.get("PATH")) is not None)

    @classmethod
    def hosts(cls, config: LaunchConfig) -> list[HostSlots]:
        """The allocation's nodes with the ranks srun puts on each (:func:`allocation_hosts`)."""
        return allocation_hosts(config.num_proc)

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)

    def prepare(self, config: LaunchConfig, slots: Sequence[Slot]) -> Endpoints:
        """Rank 0's node (the allocation's first) hosts the rendezvous.

        Raises:
            LaunchError: not inside an allocation, or no srun.
        """
        find_srun(self.environ)
        first = allocation_nodes(self.environ)[0]
        if is_local_host(first):
            address = interface_address(config.network_interface) if config.network_interface else first
            return Endpoints(addr=address, port=free_port(""))
        # Another node: a port that is free there cannot be checked from here.
        return Endpoints(addr=first, port=random.randint(20000, 59999))

    def run(
        self,
        config: LaunchConfig,
        slots: Sequence[Slot],
        env: Mapping[str, str],
        sink: OutputSink,
        interrupt: Interrupt,
    ) -> JobResult:
        """Start srun and supervise it until it has ended."""
        command = srun_command(config, find_srun(env))
        if config.verbose:
            sink.emit_raw("stderr", f"hora run: {shlex.join(command)}".encode())
        try:
            proc = subprocess.Popen(
                command, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                close_fds=True, **new_group_kwargs(),
            )
        except OSError as e:
            raise LaunchError(f"cannot start srun {command[0]!r}: {e.strerror or e}") from e
        hosts = list(dict.fromkeys(s.host for s in slots))
        watch = None
        if len(hosts) > 1:
            from hora.runner.launchers.ssh import HostWatch  # the ssh launcher's agents, in watch mode

            srun, path = command[0], env.get("PATH")
            watch = HostWatch(hosts, SshOptions.from_config(config), HeartbeatConfig.from_env(), path=path,
                              command=lambda host: watch_command(srun, host, path), via="srun")
        try:
            return ToolSupervisor(proc, slots, sink, interrupt, config.grace_period, tool="srun", watch=watch).run()
        finally:
            if watch is not None:
                watch.close()

    def close(self) -> None:
        """Nothing to release: srun has ended when :meth:`run` returns."""
