"""``RayExecutor``, Horovod's ``horovod.ray.RayExecutor`` on hora: Ray places the workers, hora's gloo job joins them.

Ray's part is placement only.  The executor reserves the workers' resources
in a placement group (``PACK`` for ``num_workers``, one ``STRICT_SPREAD``
bundle per host for ``num_hosts``), starts one :class:`~hora.ray.worker.Worker`
actor per rank in it, and asks each actor where it landed.  From then on it is
a ``hora run --gloo`` job: ranks are assigned by node (:func:`hora.ray.plan.assign`),
rank 0's node hosts the rendezvous store, and every actor sets the same
variables ``hora run`` gives its workers before the user's code runs.

Fail-fast as in ``hora run``: when an actor raises or dies, the executor
kills every actor of the job, removes the placement group it made, and raises
:class:`hora.errors.ActorFailedError` naming the rank, the actor, its node
and the cause.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.errors import ActorFailedError, ConfigError, HoraError, LaunchError, PlacementTimeoutError, UnsupportedError
from hora.ray.plan import ActorInfo, RaySettings, assign, bundles, check_controller, death_cause, job_env
from hora.runner.env import Endpoints

log = logging.getLogger(__name__)

#: After the first failure, how long to wait for the others before choosing the root cause: a rank that
#: is killed makes its peers' collectives fail at once, and Ray may report those before the death.
FAILURE_GRACE_S = 2.0
#: How long teardown waits for Ray to report the killed actors dead.
TEARDOWN_WAIT_S = 10.0
#: How long the failure report waits for silent ranks when every failure so far is a broken collective.
PROBE_S = 10.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise UnsupportedError("hora.ray needs Ray: pip install 'hora[ray]'") from e
    if not hasattr(ray, "remote"):  # a directory named ray on sys.path, not Ray
        raise UnsupportedError(
            f"hora.ray needs Ray, but 'import ray' found {list(ray.__path__)}: pip install 'hora[ray]'"
        )
    return ray


@dataclasses.dataclass(slots=True)
class _Member:
    """One started actor, and, once placed, its rank."""

    actor: Any
    actor_id: str
    info: ActorInfo | None = None
    rank: int | None = None

    @property
    def node(self) -> str:
        return self.info.node_ip if self.info is not None else "an unknown node"

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"worker actor {self.actor_id}"


class RayExecutor:
    """Run a hora (Horovod-API) job on a Ray cluster: Horovod's ``RayExecutor`` interface.

    Give either ``num_workers`` (packed onto as few nodes as fit) or
    ``num_hosts`` and ``num_workers_per_host`` (that many workers on each of
    that many distinct nodes).  Inside a placement group (a Ray Tune trial,
    an actor started with ``placement_group_capture_child_tasks=True``) the
    workers use that group unless ``use_current_placement_group=False``.
    ``start()`` places the workers and sets up the job; ``run``/``execute``
    run a function on every rank and return the results in rank order.

    With ``min_workers`` (and optionally ``max_workers``, ``reset_limit``,
    ``cooldown_range``, ``elastic_timeout``) the job is elastic instead: the
    hosts are Ray's live nodes, ``run(fn)`` starts a worker per free slot
    (up to ``max_workers``), and the function, written with
    ``hvd.elastic.run`` and a ``State``, goes on when nodes leave or join
    (:mod:`hora.ray.elastic`).  Elastic jobs only ``run``.
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: float = 100,
        nics: set[str] | Sequence[str] | str | None = None,
        verbose: int = 1,
        worker_niceness: int | None = 0,
    ) -> RaySettings:
        """The executor's settings, as Horovod's ``RayExecutor.create_settings``.

        ``timeout_s`` bounds the workers' start and rendezvous,
        ``placement_group_timeout_s`` the wait for Ray to reserve their
        resources, and ``nics`` names the interfaces gloo uses (every node
        must have them).  ``worker_niceness`` is the priority the workers
        train at (Ray's default, nice 15, puts them below everything else on
        the node; None keeps it).  ``ssh_identity_file`` and ``ssh_str`` are
        accepted for compatibility and unused: Ray starts the workers, not ssh.
        """
        if ssh_identity_file is not None or ssh_str is not None:
            log.debug("ssh_identity_file/ssh_str are not used: Ray starts the workers, not ssh")
        return RaySettings(
            timeout_s=float(timeout_s), placement_group_timeout_s=float(placement_group_timeout_s),
            nics=None if nics is None else tuple(nics) if not isinstance(nics, str) else (nics,), verbose=verbose,
            worker_niceness=worker_niceness,
        )

    def __init__(
        self,
        settings: RaySettings | Any = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: Sequence[int] | None = None,
        elastic_timeout: float = 600,
        override_discovery: bool = True,
    ) -> None:
        self.settings = _settings(settings)
        self.elastic = min_workers is not None
        if not self.elastic:
            given = {k: v for k, v in (("max_workers", max_workers), ("reset_limit", reset_limit),
                                       ("cooldown_range", cooldown_range)) if v is not None}
            if given:
                raise ConfigError(f"{', '.join(f'{k}={v!r}' for k, v in given.items())} belong to elastic jobs: "
                                  "give min_workers too (or leave them out for a job of fixed size)")
        else:
            if num_workers is not None or num_hosts is not None:
                raise ConfigError(f"min_workers={min_workers!r} makes the job elastic, with as many workers as "
                                  "Ray's nodes hold up to max_workers: leave num_workers and num_hosts out")
            if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
                raise ConfigError(f"min_workers={min_workers!r} must be a positive integer")
            if max_workers is not None and (not isinstance(max_workers, int) or max_workers < min_workers):
                raise ConfigError(f"max_workers={max_workers!r} must be an integer >= min_workers={min_workers}")
            if not override_discovery:
                raise UnsupportedError("override_discovery=False: hora.ray always takes the hosts from Ray's nodes")
            num_workers = min_workers  # what placement-free code below sizes by; the driver decides the rest
        self.min_workers, self.max_workers, self.reset_limit = min_workers, max_workers, reset_limit
        self.cooldown_range = tuple(cooldown_range) if cooldown_range is not None else None
        if (num_workers is None) == (num_hosts is None):
            raise ConfigError(
                f"give either num_workers or num_hosts (with num_workers_per_host), not "
                f"{'both' if num_workers is not None else 'neither'} (num_workers={num_workers!r}, "
                f"num_hosts={num_hosts!r})"
            )
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if not cpus_per_worker > 0:
            raise ConfigError(f"cpus_per_worker={cpus_per_worker!r} must be > 0")
        if gpus_per_worker is not None and not use_gpu:
            raise ConfigError(f"gpus_per_worker={gpus_per_worker!r} needs use_gpu=True")
        if use_gpu and gpus_per_worker is None:
            gpus_per_worker = 1
        if gpus_per_worker is not None and not gpus_per_worker > 0:
            raise ConfigError(f"gpus_per_worker={gpus_per_worker!r} must be > 0")
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = bool(use_gpu)
        self.gpus_per_worker = float(gpus_per_worker or 0)
        self.use_current_placement_group = use_current_placement_group
        self.elastic_timeout = elastic_timeout
        self.placement_group: Any = None
        self.created_placement_group = False
        #: Seconds spent in each phase of the last :meth:`start` (placement_group, actors, setup, total).
        self.start_timings: dict[str, float] = {}
        self._elastic_env: dict[str, str] | None = None
        self._members: list[_Member] = []  # in rank order once started

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self.num_workers if self.num_workers is not None else self.num_hosts * self.num_workers_per_host

    # -- starting ---------------------------------------------------------------------------------

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: Mapping[str, Any] | None = None,
        extra_env_vars: Mapping[str, Any] | None = None,
    ) -> None:
        """Place the workers, give them the job's environment, and create ``executable_cls`` in each.

        Ray must be initialised (``ray.init()``, or ``ray.init(address="auto")``
        on a cluster).  ``extra_env_vars`` are set in every actor before
        ``executable_cls(*executable_args, **executable_kwargs)`` is created,
        so its ``__init__`` may call ``hvd.init()``.

        Raises:
            PlacementTimeoutError: Ray could not reserve the resources within
                ``placement_group_timeout_s`` (the cluster lacks CPUs, GPUs or nodes).
            ActorFailedError: an actor died or ``executable_cls`` raised.
            LaunchError: the actors did not start within ``timeout_s``, or
                the executor is already started.
            ConfigError: MPI was asked for, or Ray is not initialised.
        """
        ray = _ray()
        if self._members:
            raise LaunchError("this RayExecutor is already started: call shutdown() before start() again")
        if not ray.is_initialized():
            raise ConfigError("Ray is not initialised: call ray.init() (ray.init(address='auto') to join a running "
                              "cluster) before RayExecutor.start()")
        extra = {str(k): str(v) for k, v in (extra_env_vars or {}).items()}
        check_controller(extra, os.environ)
        if self.elastic:
            if executable_cls is not None:
                raise UnsupportedError("executable_cls is not supported in elastic jobs: workers come and go; "
                                       "build what you need inside the function given to run()")
            self._elastic_env, notice = job_env(
                num_workers=self.min_workers, local_size=1, endpoints=Endpoints(addr="0.0.0.0", port=0),
                settings=self.settings, cpus_per_worker=self.cpus_per_worker, extra_env_vars=extra,
                driver_env=os.environ)
            if notice and self.settings.verbose >= 1:
                log.info(notice)
            return
        t0 = time.perf_counter()
        try:
            self._place(ray)
            t_group = time.perf_counter()
            self._create_actors(ray)
            t_actors = time.perf_counter()
            self._set_up(ray, extra)
            self._collect([m.actor.start_executable.remote(executable_cls, list(executable_args or ()),
                                                           dict(executable_kwargs or {})) for m in self._members],
                          "creating the executable", self.settings.timeout_s)
        except BaseException:
            self._teardown()
            raise
        t_end = time.perf_counter()
        self.start_timings = {
            "placement_group": t_group - t0, "actors": t_actors - t_group,
            "setup": t_end - t_actors, "total": t_end - t0,
        }
        log.debug("hora.ray: %d workers ready in %.2f s %s", self.world_size, t_end - t0, self.start_timings)

    def _place(self, ray: Any) -> None:
        from ray.util.placement_group import get_current_placement_group

        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            log.info("hora.ray: placing the workers in the current placement group; pass "
                     "use_current_placement_group=False to create one of their own")
            self.placement_group, self.created_placement_group = current, False
            return
        specs, strategy = bundles(
            num_workers=self.num_workers, num_hosts=self.num_hosts, num_workers_per_host=self.num_workers_per_host,
            cpus_per_worker=self.cpus_per_worker, gpus_per_worker=self.gpus_per_worker,
        )
        group = ray.util.placement_group(specs, strategy=strategy)
        self.placement_group, self.created_placement_group = group, True
        ready, _ = ray.wait([group.ready()], timeout=self.settings.placement_group_timeout_s)
        if not ready:
            raise PlacementTimeoutError(
                f"Ray could not place {len(specs)} bundle(s) of {specs[0]} ({strategy}) within "
                f"placement_group_timeout_s={self.settings.placement_group_timeout_s:g} s; the cluster has "
                f"{ray.available_resources()} available. Lower num_workers/cpus_per_worker/gpus_per_worker, add "
                "nodes, or raise placement_group_timeout_s"
            )

    def _create_actors(self, ray: Any) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from hora.ray.worker import Worker

        remote = ray.remote(Worker)
        per_bundle = 1 if self.num_workers is not None else self.num_workers_per_host
        for index in range(self.world_size):
            bundle = index // per_bundle if self.created_placement_group else -1
            actor = remote.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=bundle,
                    placement_group_capture_child_tasks=False,
                ),
            ).remote()
            self._members.append(_Member(actor=actor, actor_id=actor._actor_id.hex()))
        described = self._collect([m.actor.describe.remote() for m in self._members], "starting the worker actors",
                                  self.settings.timeout_s)
        for member, info in zip(self._members, described, strict=True):
            member.info = ActorInfo(**info)

    def _set_up(self, ray: Any, extra: dict[str, str]) -> None:
        slots = assign([m.info for m in self._members])
        for member, slot in zip(self._members, slots, strict=True):
            member.rank = slot.rank
        order = sorted(range(len(slots)), key=lambda i: slots[i].rank)
        self._members = [self._members[i] for i in order]
        slots = [slots[i] for i in order]
        if self.settings.verbose >= 2:
            for member, slot in zip(self._members, slots, strict=True):
                log.info("hora.ray: rank %d on %s (local rank %d, cross rank %d), actor %s pid %d", slot.rank,
                         slot.host, slot.local_rank, slot.cross_rank, member.actor_id, member.info.pid)
        visible = self._visible_gpus(slots)
        (addr, port), = self._collect([self._members[0].actor.rendezvous_endpoint.remote(
            self.settings.network_interface)], "finding the rendezvous port", self.settings.timeout_s,
            members=self._members[:1])
        env, notice = job_env(
            num_workers=len(slots), local_size=max(s.local_size for s in slots),
            endpoints=Endpoints(addr=addr, port=int(port)), settings=self.settings,
            cpus_per_worker=self.cpus_per_worker, extra_env_vars=extra, driver_env=os.environ,
        )
        if notice and self.settings.verbose >= 1:
            log.info(notice)
        refused = self._collect([m.actor.configure.remote({**env, **s.env(), **visible.get(s.host, {})},
                                                          self.settings.worker_niceness)
                                 for m, s in zip(self._members, slots, strict=True)], "setting up the workers",
                                self.settings.timeout_s)
        reasons = {r for r in refused if r}
        if reasons and self.settings.verbose >= 1:
            log.warning("hora.ray: the workers could not lower their niceness to worker_niceness=%s (%s), so they "
                        "train below the node's other processes; start Ray with RAY_worker_niceness=0 in its "
                        "environment, or pass worker_niceness=None to create_settings to keep Ray's silently",
                        self.settings.worker_niceness, "; ".join(sorted(reasons)))

    def _visible_gpus(self, slots: Sequence[Any]) -> dict[str, dict[str, str]]:
        """Every worker on a node sees the node's GPUs of this job, in local-rank order, so
        ``torch.cuda.set_device(hvd.local_rank())`` picks the GPU Ray gave it and peers can use CUDA IPC."""
        if not self.use_gpu:
            return {}
        per_node: dict[str, list[str]] = {}
        for member, slot in zip(self._members, slots, strict=True):
            per_node.setdefault(slot.host, []).extend(member.info.gpu_ids)
        return {host: {"CUDA_VISIBLE_DEVICES": ",".join(ids)} for host, ids in per_node.items() if ids}

    # -- running ----------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        callbacks: Sequence[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return the results in rank order.

        Raises:
            ActorFailedError: a rank raised (its exception is the ``__cause__``)
                or its actor died; every actor of the job is gone by then.
        """
        _no_callbacks(callbacks)
        if self.elastic:
            return self._run_elastic(fn, args, kwargs)
        return self._collect(self.run_remote(fn, args, kwargs), "run", None)

    def _run_elastic(self, fn: Callable[..., Any], args: Sequence[Any] | None,
                     kwargs: Mapping[str, Any] | None) -> list[Any]:
        from hora.ray.elastic import run_elastic

        if getattr(self, "_elastic_env", None) is None:
            raise LaunchError("this RayExecutor is not started: call start() first")
        return run_elastic(
            _ray(), fn=fn, args=list(args or ()), kwargs=dict(kwargs or {}), env=self._elastic_env,
            niceness=self.settings.worker_niceness,
            actor_options={"num_cpus": self.cpus_per_worker, "num_gpus": self.gpus_per_worker},
            min_workers=self.min_workers, max_workers=self.max_workers, reset_limit=self.reset_limit,
            elastic_timeout=self.elastic_timeout, cooldown_range=self.cooldown_range,
            cpus_per_worker=self.cpus_per_worker, gpus_per_worker=self.gpus_per_worker,
        )

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every rank; return Ray ``ObjectRef`` s in rank order (``ray.get`` them).

        Failures surface as Ray's own exceptions from ``ray.get``; the executor
        does not tear the job down for them (use :meth:`run` for that).
        """
        self._require_started()
        return [m.actor.run.remote(fn, list(args or ()), dict(kwargs or {})) for m in self._members]

    def execute(self, fn: Callable[[Any], Any], callbacks: Sequence[Callable[..., Any]] | None = None) -> list[Any]:
        """Run ``fn(executable)`` on every rank (the object ``start(executable_cls=...)`` made) and return
        the results in rank order; failures as :meth:`run`."""
        _no_callbacks(callbacks)
        self._require_started()
        return self._collect([m.actor.execute.remote(fn) for m in self._members], "execute", None)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(executable)`` on rank 0 only and return its result (no collective may run inside)."""
        self._require_started()
        return self._collect([self._members[0].actor.execute.remote(fn)], "execute_single", None,
                             members=self._members[:1])[0]

    def shutdown(self) -> None:
        """Kill every worker actor and remove the placement group this executor made; safe to call twice."""
        self._teardown()

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def workers(self) -> list[Any]:
        """The worker actors' handles, in rank order."""
        return [m.actor for m in self._members]

    # -- supervision ------------------------------------------------------------------------------

    def _require_started(self) -> None:
        if self.elastic:
            raise UnsupportedError("an elastic job only runs functions with run(): its workers come and go")
        if not self._members:
            raise LaunchError("this RayExecutor has no workers: call start() first (after a failure, start() again)")

    def _collect(
        self,
        refs: Sequence[Any],
        what: str,
        timeout: float | None,
        members: Sequence[_Member] | None = None,
    ) -> list[Any]:
        """Wait for one call per actor; on the first failure tear the job down and raise its root cause."""
        ray = _ray()
        members = list(self._members if members is None else members)
        pending = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        failures: list[tuple[int, Exception]] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_end: float | None = None
        while pending:
            now = time.monotonic()
            ends = [t for t in (deadline, grace_end) if t is not None]
            wait = max(0.0, min(ends) - now) if ends else None
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if not ready:
                if grace_end is not None and time.monotonic() >= grace_end:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    late = ", ".join(members[i].label for i in sorted(pending.values()))
                    self._teardown()
                    raise LaunchError(f"{what}: {late} did not answer within timeout_s={timeout:g} s; the job was "
                                      "stopped. Check the cluster's resources and the workers' logs, or raise "
                                      "timeout_s in RayExecutor.create_settings")
                continue
            for ref in ready:
                index = pending.pop(ref)
                try:
                    results[index] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    failures.append((index, e))
            if failures and grace_end is None:
                grace_end = time.monotonic() + FAILURE_GRACE_S
        if failures:
            self._fail(ray, failures, members, what, pending)
        return [results[i] for i in range(len(refs))]

    def _fail(self, ray: Any, failures: list[tuple[int, Exception]], members: list[_Member], what: str,
              pending: dict[Any, int]) -> None:
        # A death is a root cause; a rank whose collective broke because its peer died is a consequence.
        deaths = [f for f in failures if not isinstance(f[1], ray.exceptions.RayTaskError)]
        if not deaths and pending and all(isinstance(getattr(e, "cause", None), HoraError) for _, e in failures):
            deaths = self._silent(ray, pending)
        index, error = (deaths or failures)[0]
        member = members[index]
        if isinstance(error, TimeoutError):
            original = None
            cause = f"stopped answering: {error} (its node may be lost or cut off)"
        elif isinstance(error, ray.exceptions.RayTaskError):
            original = error.cause
            if original is None:
                cause = f"raised: {str(error).strip().splitlines()[-1]}"
            else:
                cause = f"raised {type(original).__name__}: {original}"
        else:
            original = error
            cause = death_cause(str(error))
        for other_index, other in failures:
            if other_index != index:
                log.info("hora.ray: %s also failed (%s), after %s", members[other_index].label,
                         type(other).__name__, member.label)
        self._teardown()
        raise ActorFailedError(
            member.rank if member.rank is not None else -1, member.actor_id, member.node, f"{cause} (during {what}); "
            "every worker actor of the job was stopped",
        ) from original

    def _silent(self, ray: Any, pending: dict[Any, int]) -> list[tuple[int, Exception]]:
        """The ranks still running when every failure so far is a broken collective: when a node is lost,
        its peers' collectives fail at once, while Ray may take many seconds to declare its actors dead.
        Waits up to :data:`PROBE_S` for Ray's verdict; a rank still silent then is the root cause."""
        ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=PROBE_S)
        lost: list[tuple[int, Exception]] = []
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError:
                continue
            except ray.exceptions.RayError as e:
                lost.append((pending[ref], e))
        if not lost:
            lost = [(pending[ref], TimeoutError(f"its peers' collectives broke and it gave no result within "
                                                f"{PROBE_S:g} s more")) for ref in late]
        return sorted(lost, key=lambda item: item[0])

    def _teardown(self) -> None:
        members, self._members = self._members, []
        group, created = self.placement_group, self.created_placement_group
        self.placement_group, self.created_placement_group = None, False
        if not members and group is None:
            return
        ray = _ray()
        for member in members:
            try:
                ray.kill(member.actor, no_restart=True)
            except Exception as e:  # already gone
                log.debug("hora.ray: killing %s: %s", member.label, e)
        # Wait until Ray reports each one dead, so nothing of the job is left when this returns.
        probes = []
        for member in members:
            try:
                probes.append(member.actor.describe.remote())
            except Exception:
                continue
        if probes:
            ray.wait(probes, num_returns=len(probes), timeout=TEARDOWN_WAIT_S)
        if created and group is not None:
            try:
                ray.util.remove_placement_group(group)
            except Exception as e:
                log.debug("hora.ray: removing the placement group: %s", e)


def _settings(settings: Any) -> RaySettings:
    if settings is None:
        return RaySettings()
    if isinstance(settings, RaySettings):
        return settings
    # Horovod's MiniSettings or Settings object: take the fields that apply.
    nics = getattr(settings, "nics", None)
    return RaySettings(
        timeout_s=float(getattr(settings, "timeout_s", 30)),
        placement_group_timeout_s=float(getattr(settings, "placement_group_timeout_s", 100)),
        nics=tuple(nics) if nics else None, verbose=int(getattr(settings, "verbose", 1) or 0),
    )


def _no_callbacks(callbacks: Sequence[Callable[..., Any]] | None) -> None:
    if callbacks:
        raise UnsupportedError("callbacks are not supported by hora.ray: return values from the function instead, "
                               "or log from rank 0 inside it")
