"""Where the processes of a job sit: hosts with slots, the placement record, and rank planning.

This is ground floor, under both the runner and the core: a launcher plans
:class:`Placement` s and exports them (:meth:`Placement.env`), a worker reads
its own back (:class:`hora.core.topology.Topology` is a placement that also
says who started it), and the elastic driver answers each round with one.
:func:`place_ranks` is the one rank planner: ``hora run``, ``hora.ray`` and
``hora.spark`` all fill hosts with it, so a host's ranks are consecutive
everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from hora import envvars
from hora.errors import ConfigError, TopologyError


@dataclasses.dataclass(frozen=True, slots=True)
class HostSlots:
    """One host of the job and how many processes it may run.

    ``fixed`` is False for the hosts of an MXNet-style hostfile (bare names,
    no slot counts): the workers are then spread evenly over them, as
    MXNet's launch.py does, instead of one per host.
    """

    host: str
    slots: int
    fixed: bool = True

    def __str__(self) -> str:
        return f"{self.host}:{self.slots}" if self.fixed else self.host


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """One process's place in the job: rank and size, local and cross ranks, and its host.

    ``cross_rank`` is the index of this process's host among the job's
    hosts and ``cross_size`` the number of hosts, as in Horovod (for a
    homogeneous job ``size == local_size * cross_size``).

    Raises:
        TopologyError: a rank lies outside its size.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: str

    def __post_init__(self) -> None:
        if self.size < 1:
            raise TopologyError(f"size={self.size} must be >= 1")
        if not 0 <= self.rank < self.size:
            raise TopologyError(f"rank={self.rank} is outside [0, size={self.size})")
        if not 0 <= self.local_rank < self.local_size:
            raise TopologyError(f"local_rank={self.local_rank} is outside [0, local_size={self.local_size})")
        if not 0 <= self.cross_rank < self.cross_size:
            raise TopologyError(f"cross_rank={self.cross_rank} is outside [0, cross_size={self.cross_size})")

    def env(self, *, host: bool = True) -> dict[str, str]:
        """The worker variables of this placement, under hora's names and horovodrun's (``HOROVOD_*``).

        Scripts and test suites written for Horovod read the ``HOROVOD_*``
        copies.  ``host=False`` leaves out ``HORA_HOSTNAME``, for a process
        that keeps the name its launcher gave it (an elastic worker).
        """
        values = (
            str(self.rank), str(self.size), str(self.local_rank), str(self.local_size),
            str(self.cross_rank), str(self.cross_size), self.host,
        )
        count = len(values) if host else len(values) - 1
        env = dict(zip(envvars.WORKER_PLACEMENT[:count], values[:count], strict=True))
        env.update(zip(envvars.HOROVOD_PLACEMENT[:count], values[:count], strict=True))
        return env


def place_ranks(hosts: Iterable[HostSlots], num_proc: int) -> list[Placement]:
    """Place ``num_proc`` ranks on ``hosts``: fill them in order, each up to its slots.

    The ranks of one host are consecutive (Horovod's placement), local ranks
    count from 0 on each host, and hosts that get no rank are left out of
    ``cross_size``.  A pure function: ``hora run``'s launchers, ``hora.ray``
    and ``hora.spark`` all place ranks with it.

    Raises:
        ConfigError: ``num_proc`` is below 1 or more than the slots of ``hosts``.
    """
    if num_proc < 1:
        raise ConfigError(f"cannot place {num_proc} ranks: a job has at least one")
    placed: list[tuple[str, int]] = []  # (host, ranks on it)
    left = num_proc
    for h in hosts:
        if left == 0:
            break
        take = min(h.slots, left)
        if take > 0:
            placed.append((h.host, take))
            left -= take
    if left:
        raise ConfigError(f"{num_proc} ranks do not fit in the {num_proc - left} slots of the hosts; place fewer "
                          "ranks or add slots")
    ranks: list[Placement] = []
    for cross_rank, (host, count) in enumerate(placed):
        for local_rank in range(count):
            ranks.append(Placement(
                rank=len(ranks), size=num_proc, local_rank=local_rank, local_size=count,
                cross_rank=cross_rank, cross_size=len(placed), host=host,
            ))
    return ranks


def place_groups(groups: Sequence[tuple[str, Sequence[int]]], count: int) -> list[Placement]:
    """Place ``count`` processes that arrived in any order, grouped by host: ``result[i]`` is process ``i``'s.

    Each group is a host and the indexes of its processes, in local-rank order; the groups come
    in the order their hosts take ranks.  ``hora.ray`` (actors) and ``hora.spark`` (barrier tasks)
    place what their schedulers started with it, through :func:`place_ranks`.
    """
    slots = iter(place_ranks([HostSlots(host, len(indexes)) for host, indexes in groups], count))
    result: list[Placement | None] = [None] * count
    for _, indexes in groups:
        for index in indexes:
            result[index] = next(slots)
    return result  # type: ignore[return-value]  # every index is in one group


def expand_slurm_counts(compressed: str) -> list[int]:
    """Expand Slurm's compressed task counts (``SLURM_TASKS_PER_NODE``): ``"2(x3),1"`` is ``[2, 2, 2, 1]``.

    The Slurm launcher (for its host list) and the ranks (for their local size) both read it, through this.

    Raises:
        TopologyError: the text is not in that notation.
    """
    counts: list[int] = []
    try:
        for part in compressed.split(","):
            if "(x" in part:
                count, repeat = part.rstrip(")").split("(x")
                counts += [int(count)] * int(repeat)
            else:
                counts.append(int(part))
    except ValueError:
        raise TopologyError(f"cannot read Slurm's task counts {compressed!r}") from None
    return counts
