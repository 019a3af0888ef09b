"""The Ray executor's pure decisions: placement-group bundles, ranks from where Ray placed the actors, the job's env.

Nothing here talks to Ray, so the rank layout and the environment each actor
gets are tested without a cluster (``tests/ray/test_plan.py`` and the
launcher/worker contract in ``tests/unit/test_env_contract.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence

from hora import envvars
from hora.errors import ConfigError
from hora.placement import Placement, place_groups
from hora.runner.env import Endpoints, build_env, require_gloo
from hora.runner.launch_config import LaunchConfig

log = logging.getLogger(__name__)

#: What the job's command is called where a launcher would print it (the actors run no command).
COMMAND = ("hora.ray",)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RaySettings:
    """What ``RayExecutor.create_settings`` returns: the executor's timeouts and network interfaces.

    Attributes:
        timeout_s: seconds the workers may take to start and to meet at the
            rendezvous (``HORA_START_TIMEOUT`` in every actor).
        placement_group_timeout_s: seconds Ray may take to reserve the
            workers' resources before :class:`hora.errors.PlacementTimeoutError`.
        nics: network interfaces for the rendezvous and gloo traffic (each
            node must have them); None lets the node's Ray address decide.
        verbose: 0 quiet, 1 the usual notices, 2 the placement of every rank (logged).
        worker_niceness: the scheduling priority the workers train at.  Ray
            starts its workers at nice 15 (its ``worker_niceness``), below
            everything else on the node, where ``hora run`` workers keep the
            launcher's; each actor lowers its niceness to this value where it
            may (root or ``CAP_SYS_NICE``).  None keeps Ray's.
    """

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    nics: tuple[str, ...] | None = None
    verbose: int = 1
    worker_niceness: int | None = 0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s={self.timeout_s!r} must be > 0 seconds")
        if not self.placement_group_timeout_s > 0:
            raise ConfigError(f"placement_group_timeout_s={self.placement_group_timeout_s!r} must be > 0 seconds")
        if self.nics is not None:
            if isinstance(self.nics, str):
                object.__setattr__(self, "nics", (self.nics,))
            nics = tuple(sorted(str(n) for n in self.nics))
            if not nics or not all(nics):
                raise ConfigError(f"nics={self.nics!r} names no interface: give e.g. {{'eth0'}} or leave it None")
            object.__setattr__(self, "nics", nics)
        if self.worker_niceness is not None and not -20 <= self.worker_niceness <= 19:
            raise ConfigError(f"worker_niceness={self.worker_niceness!r} must be in -20..19, or None to keep Ray's")

    @property
    def network_interface(self) -> str | None:
        """The interfaces as ``hora run --network-interface`` takes them (comma-separated), or None."""
        return ",".join(self.nics) if self.nics else None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ActorInfo:
    """Where Ray put one worker actor (what the actor reports about itself once placed)."""

    node_id: str
    node_ip: str
    hostname: str
    pid: int
    gpu_ids: tuple[str, ...] = ()


def bundles(
    *,
    num_workers: int | None,
    num_hosts: int | None,
    num_workers_per_host: int,
    cpus_per_worker: float,
    gpus_per_worker: float,
) -> tuple[list[dict[str, float]], str]:
    """The placement group to ask Ray for: its bundles and its strategy.

    ``num_workers`` gives one bundle per worker, packed onto as few nodes as
    fit (``PACK``).  ``num_hosts`` gives one bundle per host holding that
    host's ``num_workers_per_host`` workers, each bundle on its own node
    (``STRICT_SPREAD``), so every host runs the same number of ranks.
    """
    def resources(count: int) -> dict[str, float]:
        res = {"CPU": cpus_per_worker * count}
        if gpus_per_worker:
            res["GPU"] = gpus_per_worker * count
        return res

    if num_workers is not None:
        return [resources(1) for _ in range(num_workers)], "PACK"
    assert num_hosts is not None  # checked by the executor's constructor
    return [resources(num_workers_per_host) for _ in range(num_hosts)], "STRICT_SPREAD"


def assign(infos: Sequence[ActorInfo]) -> list[Placement]:
    """Each actor's place in the job, from where Ray put it: ``slots[i]`` belongs to ``infos[i]``.

    Actors on one node get consecutive ranks and local ranks 0..k-1 in the
    order they were created; nodes are ordered by IP address (then node id,
    for several Ray nodes on one address), which gives every node its cross
    rank, as ``hora run -H`` does for its hosts.  A node is named by its IP
    address (``HORA_HOSTNAME``).
    """
    by_node: dict[str, list[int]] = {}
    for index, info in enumerate(infos):
        by_node.setdefault(info.node_id, []).append(index)
    order = sorted(by_node, key=lambda node: (_ip_key(infos[by_node[node][0]].node_ip), node))
    return place_groups([(infos[by_node[node][0]].node_ip, by_node[node]) for node in order], len(infos))


def _ip_key(ip: str) -> tuple[int, ...] | tuple[str]:
    parts = ip.split(".")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        return tuple(int(p) for p in parts)
    return (ip,)


def check_controller(extra_env_vars: Mapping[str, str], driver_env: Mapping[str, str]) -> None:
    """Refuse a job that asks for MPI: under Ray the actors meet through gloo, MPI is never started.

    Raises:
        ConfigError: ``HORA_CONTROLLER`` or ``HOROVOD_CONTROLLER`` is set to
            something other than ``gloo`` in ``extra_env_vars`` or the driver's
            environment.
    """
    require_gloo({"extra_env_vars": extra_env_vars, "the driver's environment": driver_env},
                 "hora.ray runs its workers as Ray actors")


def job_env(
    *,
    num_workers: int,
    local_size: int,
    endpoints: Endpoints,
    settings: RaySettings,
    cpus_per_worker: float,
    extra_env_vars: Mapping[str, str],
    driver_env: Mapping[str, str],
) -> tuple[dict[str, str], str | None]:
    """The variables every actor sets before the user's code runs, and a notice to log once.

    The same variables ``hora run --gloo`` gives its workers, built by the
    same code (:func:`hora.runner.env.build_env`): the controller, rank 0's
    rendezvous address and port, a new job secret, ``HORA_START_TIMEOUT``
    (``timeout_s``), the interfaces of ``nics``.  Only the variables the job
    sets travel: each actor keeps the rest of its node's environment.
    Threads per worker are ``cpus_per_worker`` unless the user set
    ``OMP_NUM_THREADS`` (in ``extra_env_vars`` or the driver's environment).
    Rank variables come per actor from :meth:`hora.placement.Placement.env`.
    """
    config = LaunchConfig(
        command=COMMAND, num_proc=num_workers, launcher="local", controller="gloo",
        start_timeout=settings.timeout_s, network_interface=settings.network_interface,
        env={str(k): str(v) for k, v in extra_env_vars.items()},
    )
    base: dict[str, str] = {}
    notice = None
    user_threads = extra_env_vars.get(envvars.OMP_NUM_THREADS) or driver_env.get(envvars.OMP_NUM_THREADS)
    if user_threads:
        base[envvars.OMP_NUM_THREADS] = str(user_threads)
    else:
        threads = max(1, int(cpus_per_worker))
        base[envvars.OMP_NUM_THREADS] = str(threads)
        notice = (
            f"hora.ray: setting OMP_NUM_THREADS={threads} for each worker (its cpus_per_worker={cpus_per_worker:g}) "
            "to avoid oversubscribing the CPUs; set OMP_NUM_THREADS in extra_env_vars or the driver's "
            "environment to override."
        )
    env, _ = build_env(config, local_size=local_size, base=base, endpoints=endpoints)
    return env, notice


def death_cause(text: str) -> str:
    """A one-line cause from Ray's long actor-death message."""
    reason = re.search(r"The actor is dead because ([^.]*)\.", text)
    kind = re.search(r"Worker exit type: (\w+)", text)
    if reason:
        cause = f"died: {reason.group(1)}"
    else:
        cause = f"died: {text.strip().splitlines()[0] if text.strip() else type(text).__name__}"
    if kind:
        cause += f" (Ray's worker exit type {kind.group(1)})"
    if "node" not in cause:
        cause += "; it was killed (a signal, the OOM killer), crashed, or lost its node"
    return cause
