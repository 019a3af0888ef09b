"""Where this process sits in the job: rank, size, local and cross ranks.

hora's own launcher sets ``HORA_*`` variables.  So that ``hvd.init()`` also
works under other launchers, the environments of Open MPI / PMIx, MPICH /
Hydra (PMI), torchrun and Slurm's srun are understood too.  Detection is a
pure function of an environment mapping, so it is tested without launching.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping

from hora import envvars
from hora.errors import TopologyError
from hora.placement import Placement, expand_slurm_counts


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Topology(Placement):
    """This process's :class:`~hora.placement.Placement`, and which launcher started it.

    ``launcher`` is ``"hora"``, ``"mpi"``, ``"torchrun"``, ``"slurm"`` or
    ``"single"`` (no launcher recognised: a one-process job).
    """

    launcher: str

    @property
    def started_by_mpi(self) -> bool:
        """Whether mpirun started this process (its ranks come from MPI's own variables)."""
        return self.launcher == "mpi"


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise TopologyError(f"environment variable {name}={raw!r} is not an integer") from None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        if name in env and env[name] != "":
            return name
    return None


def detect(env: Mapping[str, str]) -> Topology:
    """Read the topology from a launcher's environment.

    Args:
        env: the process environment (or a test's dictionary).

    Returns:
        The topology; a single-process job if no launcher is recognised.

    Raises:
        TopologyError: a launcher's variables are present but inconsistent.
    """
    host = env.get(envvars.HORA_HOSTNAME) or socket.gethostname()
    if envvars.HORA_RANK in env:
        size = _int(env, envvars.HORA_SIZE)
        rank = _int(env, envvars.HORA_RANK)
        local_size = _int(env, envvars.HORA_LOCAL_SIZE) if envvars.HORA_LOCAL_SIZE in env else size
        return Topology(
            rank=rank,
            size=size,
            local_rank=_int(env, envvars.HORA_LOCAL_RANK) if envvars.HORA_LOCAL_RANK in env else rank,
            local_size=local_size,
            cross_rank=_int(env, envvars.HORA_CROSS_RANK) if envvars.HORA_CROSS_RANK in env else 0,
            cross_size=(
                _int(env, envvars.HORA_CROSS_SIZE) if envvars.HORA_CROSS_SIZE in env else max(1, size // local_size)
            ),
            host=host,
            launcher="hora",
        )
    if envvars.OMPI_COMM_WORLD_RANK in env:  # Open MPI's mpirun / prterun
        return _from_counts(
            env, "mpi", host,
            rank=envvars.OMPI_COMM_WORLD_RANK,
            size=envvars.OMPI_COMM_WORLD_SIZE,
            local_rank=envvars.OMPI_COMM_WORLD_LOCAL_RANK,
            local_size=envvars.OMPI_COMM_WORLD_LOCAL_SIZE,
            node_rank=envvars.OMPI_COMM_WORLD_NODE_RANK,
        )
    if envvars.PMI_RANK in env:  # MPICH / Hydra
        return _from_counts(
            env, "mpi", host, rank=envvars.PMI_RANK, size=envvars.PMI_SIZE,
            local_rank=envvars.MPI_LOCALRANKID, local_size=envvars.MPI_LOCALNRANKS, node_rank=None,
        )
    torchrun = (envvars.TORCHRUN_RANK, envvars.TORCHRUN_WORLD_SIZE, envvars.TORCHRUN_LOCAL_RANK)
    if all(name in env for name in torchrun):
        return _from_counts(
            env, "torchrun", host, rank=envvars.TORCHRUN_RANK, size=envvars.TORCHRUN_WORLD_SIZE,
            local_rank=envvars.TORCHRUN_LOCAL_RANK, local_size=envvars.TORCHRUN_LOCAL_WORLD_SIZE,
            node_rank=envvars.TORCHRUN_GROUP_RANK,
        )
    if envvars.SLURM_PROCID in env and envvars.SLURM_NTASKS in env:  # srun
        return _from_counts(
            env, "slurm", host, rank=envvars.SLURM_PROCID, size=envvars.SLURM_NTASKS,
            local_rank=envvars.SLURM_LOCALID, local_size=None, node_rank=envvars.SLURM_NODEID,
        )
    return Topology(
        rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
        host=host, launcher="single",
    )


def _from_counts(
    env: Mapping[str, str],
    launcher: str,
    host: str,
    *,
    rank: str,
    size: str,
    local_rank: str,
    local_size: str | None,
    node_rank: str | None,
) -> Topology:
    r = _int(env, rank)
    n = _int(env, size)
    lr = _int(env, local_rank) if local_rank in env else 0
    if local_size is not None and local_size in env:
        ls = _int(env, local_size)
    elif launcher == "slurm" and envvars.SLURM_TASKS_PER_NODE in env:
        ls = _slurm_local_size(env[envvars.SLURM_TASKS_PER_NODE], env.get(envvars.SLURM_NODEID, "0"))
    else:
        ls = n if lr == r else max(lr + 1, 1)
    cross_size = max(1, -(-n // ls))
    cr = _int(env, node_rank) if node_rank is not None and node_rank in env else r // ls
    return Topology(
        rank=r, size=n, local_rank=lr, local_size=ls,
        cross_rank=min(cr, cross_size - 1), cross_size=cross_size,
        host=host, launcher=launcher,
    )


def _slurm_local_size(tasks_per_node: str, node_id: str) -> int:
    counts = expand_slurm_counts(tasks_per_node)
    index = int(node_id)
    if not 0 <= index < len(counts):
        raise TopologyError(f"SLURM_NODEID={node_id} but SLURM_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[index]
