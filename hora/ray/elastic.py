"""Elastic jobs on Ray: ``hora run``'s elastic driver, with Ray's live nodes as the hosts and actors as the workers.

The driver (:class:`hora.runner.elastic.ElasticDriver`) does what it does for
``hora run --min-np``: it starts a worker per free slot, forms versioned
rendezvous rounds, blacklists hosts whose workers fail and ends the job.
Here it learns the hosts from Ray (:class:`RayNodes`: every live node, with
as many slots as its CPUs and GPUs hold workers) instead of a discovery
script, and its workers are Ray actors pinned to their node
(:class:`ActorSpawner`).  A node that leaves the cluster takes its actors
with it; the driver sees them die and re-forms the ring on the rest.
"""

from __future__ import annotations

import io
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)


def node_slots(nodes: Iterable[Mapping[str, Any]], cpus_per_worker: float, gpus_per_worker: float) -> dict[str, int]:
    """Host -> worker slots from ``ray.nodes()``: live nodes only, as many workers as their resources hold.

    A node is named by its IP address (``NodeManagerAddress``); nodes that
    cannot hold one worker are left out.
    """
    hosts: dict[str, int] = {}
    for node in nodes:
        if not node.get("Alive"):
            continue
        resources = node.get("Resources") or {}
        slots = int(resources.get("CPU", 0) // cpus_per_worker) if cpus_per_worker else 0
        if gpus_per_worker:
            slots = min(slots, int(resources.get("GPU", 0) // gpus_per_worker))
        if slots > 0:
            address = str(node["NodeManagerAddress"])
            hosts[address] = hosts.get(address, 0) + slots
    return hosts


class RayNodes:
    """The elastic driver's host discovery: Ray's view of the cluster (see :func:`node_slots`)."""

    def __init__(self, ray: Any, cpus_per_worker: float, gpus_per_worker: float) -> None:
        self.ray = ray
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker

    def find(self) -> dict[str, int]:
        """The live nodes and their slots now."""
        return node_slots(self.ray.nodes(), self.cpus_per_worker, self.gpus_per_worker)


class ActorSpawner:
    """Starts the elastic driver's workers as Ray actors pinned to their node and reports how they end.

    A worker's exit code is 0 when its function returned (or it was retired),
    1 when it raised, and -9 when its actor died (killed, or its node lost);
    what it raised or why it died goes to ``sink`` as its stderr, for the
    driver's failure report.  :attr:`results` maps each finished worker to
    ``(final rank, value)``.
    """

    def __init__(self, ray: Any, actor_options: Mapping[str, Any], env: Mapping[str, str], niceness: int | None,
                 task: tuple[Callable[..., Any], Sequence[Any], Mapping[str, Any]], sink: Any) -> None:
        from hora.ray.worker import Worker

        self.ray = ray
        self.remote = ray.remote(Worker)
        self.actor_options = dict(actor_options)
        self.env = dict(env)
        self.niceness = niceness
        self.task = task
        self.sink = sink
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self.actors: dict[int, Any] = {}
        self.results: dict[int, tuple[int | None, Any]] = {}

    def start(self, seq: int, host: str, extra_env: Mapping[str, str]) -> Any:
        """Start worker ``seq`` on the node ``host`` with the job's environment plus ``extra_env``."""
        actor = self.remote.options(**self.actor_options, resources={f"node:{host}": 0.001}).remote()
        self.actors[seq] = actor
        actor.configure.remote({**self.env, **extra_env}, self.niceness)  # an actor runs its calls in order
        fn, args, kwargs = self.task
        ref = actor.run_elastic.remote(fn, list(args), dict(kwargs))
        threading.Thread(target=self._wait, args=(seq, ref), name=f"hora-ray-elastic-{seq}", daemon=True).start()
        log.info("hora.ray: started elastic worker %d on node %s", seq, host)
        return actor

    def _wait(self, seq: int, ref: Any) -> None:
        from hora.ray.plan import death_cause

        try:
            self.results[seq] = self.ray.get(ref)
            code = 0
        except self.ray.exceptions.RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            self._stderr(seq, f"raised {type(cause).__name__}: {cause}")
            code = 1
        except self.ray.exceptions.RayError as e:
            self._stderr(seq, death_cause(str(e)))
            code = -9
        self.exits.put((seq, code))

    def _stderr(self, seq: int, text: str) -> None:
        for line in text.splitlines() or [text]:
            self.sink.emit(seq, "stderr", line.encode() + b"\n")

    def signal(self, seqs: Sequence[int], signum: int) -> None:
        """Stop the workers ``seqs``: an actor has no signals, so any signal kills it."""
        for seq in seqs:
            actor = self.actors.get(seq)
            if actor is not None:
                try:
                    self.ray.kill(actor, no_restart=True)
                except Exception as e:  # already gone
                    log.debug("hora.ray: killing elastic worker %d: %s", seq, e)

    def close(self) -> None:
        """Kill every actor this spawner started."""
        self.signal(list(self.actors), 9)


def run_elastic(
    ray: Any,
    *,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    env: Mapping[str, str],
    niceness: int | None,
    actor_options: Mapping[str, Any],
    min_workers: int,
    max_workers: int | None,
    reset_limit: int | None,
    elastic_timeout: float,
    cooldown_range: tuple[float, float] | None,
    cpus_per_worker: float,
    gpus_per_worker: float,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job on the Ray cluster; the results of the last round, by rank.

    Raises:
        LaunchError: the job failed: fewer than ``min_workers`` could run
            for ``elastic_timeout`` seconds, every node was blacklisted, or
            the ring re-formed more than ``reset_limit`` times.
    """
    from hora import envvars
    from hora.errors import LaunchError
    from hora.runner.elastic import ElasticDriver, ElasticSettings, HostManager
    from hora.runner.launchers.base import Interrupt
    from hora.runner.output import OutputSink

    env = dict(env)
    env.pop(envvars.HORA_RENDEZVOUS_ADDR, None)  # each round brings its own store
    env.pop(envvars.HORA_RENDEZVOUS_PORT, None)
    sink = OutputSink(io.StringIO(), io.StringIO())
    spawner = ActorSpawner(ray, actor_options, env, niceness, (fn, args, kwargs), sink)
    settings = ElasticSettings(num_proc=min_workers, min_np=min_workers, max_np=max_workers,
                               timeout_s=elastic_timeout, reset_limit=reset_limit)
    hosts = HostManager(cooldown_range)
    driver_ip = ray.util.get_node_ip_address()
    driver = ElasticDriver(settings, hosts, RayNodes(ray, cpus_per_worker, gpus_per_worker), spawner,
                           env[envvars.HORA_SECRET], sink, Interrupt(), bind_addr="0.0.0.0",
                           advertise=lambda host: driver_ip)
    try:
        result = driver.run()
    finally:
        spawner.close()
        sink.close()
    if result.exit_code != 0:
        cause = result.root_cause.describe() if result.root_cause is not None else ""
        tail = "\n".join(result.root_cause.stderr_tail) if result.root_cause is not None else ""
        raise LaunchError(" ".join(p for p in (f"the elastic job on Ray failed: {result.message or cause}",
                                              f"({cause}: {tail})" if result.message and cause else "") if p))
    finished = sorted((item for item in spawner.results.values() if item[0] is not None), key=lambda item: item[0])
    return [value for _, value in finished]
