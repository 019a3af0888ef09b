"""The launcher registry: each launcher declares, in its own class, its names, detection, capabilities and host list.

A launcher is a subclass of :class:`Launcher` in its own module under
``hora/runner/launchers/``; the registry imports every module there, so a
new launcher is its own file (plus its tests).  Its class says, in one place:

- ``name`` and ``aliases``: what ``--launcher`` accepts (MXNet launch.py's
  ``--launcher local|ssh|mpi|sge`` are hora's names too);
- ``priority`` and :meth:`Launcher.detect`: whether the environment ``hora
  run`` runs in calls for it when ``--launcher`` is left out;
- ``capabilities``: what it serves (:class:`Capabilities`), and ``refusals``:
  its own message for each thing it does not;
- :meth:`Launcher.hosts`: where the job's host list comes from;
- :meth:`Launcher.prepare`, :meth:`Launcher.run`, :meth:`Launcher.close`: how
  its processes are started, supervised and stopped.

When ``--launcher`` is left out, the launchers that serve the controller
asked for (and elastic training, when asked for) are asked in ``priority``
order, lowest first, whether the environment is theirs:

====  =======================================================================
10    ssh: a host that is not this machine
20    a batch system's job: slurm (``SLURM_JOB_ID`` and srun), sge (a parallel
      environment's ``PE_HOSTFILE`` and ``JOB_ID``, and qrsh)
30    mpi: ``--mpi``, or neither ``--gloo`` nor ``-s`` and MPI is installed
100   local: always (the fallback)
====  =======================================================================
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, TextIO

from hora.errors import ConfigError, LaunchError
from hora.placement import HostSlots
from hora.runner.hostlist import is_local_host, merged_hosts

if TYPE_CHECKING:
    from hora.runner.launchers.base import Endpoints, Interrupt, JobResult, Slot
    from hora.runner.output import OutputSink

CONTROLLERS = ("gloo", "mpi")

#: What a job may ask of its launcher, in the order they are checked; a launcher without one of them
#: declares its message for it in ``refusals``.
NEEDS = ("elastic", "controller", "servers", "host_list", "remote_hosts", "sync_dst_dir", "mpi_args")

#: Refusals several launchers share (``str.format`` fields as in :attr:`Launcher.refusals`).
MPI_NEEDS_MPIRUN = ("--mpi needs {able} (mpirun starts MPI jobs and reaches other hosts itself), "
                    "not --launcher {launcher}")
SYNC_NEEDS_SSH = "--sync-dst-dir copies files to other hosts over ssh; it needs {able}, not --launcher {launcher}"
MPI_ARGS_NEED_MPIRUN = "mpi_args only apply to {able} (pass --mpi), not to --launcher {launcher}"
SERVERS_NEED_HORA = ("-s {servers}: parameter servers are started by {able}, not by --launcher {launcher}; "
                     "use --launcher ssh (or -s 0 with dist_sync_allreduce)")

#: Launchers that MXNet's launch.py knows and hora cannot run, with what to do instead.
UNAVAILABLE = {
    "yarn": (
        "--launcher yarn: hora has no YARN launcher, because no Hadoop ResourceManager can be run to test one; "
        "on a YARN cluster, start the ranks from Spark on YARN with hora.spark (see README.md, 'Launchers')"
    ),
}


class ConfigView(Protocol):
    """What the registry reads of a :class:`hora.runner.launch_config.LaunchConfig` (which validates through here)."""

    command: Sequence[str]
    num_proc: int
    hosts: Sequence[HostSlots] | str | None
    controller: str | None
    num_servers: int
    sync_dst_dir: str | None
    mpi_args: Sequence[str]

    @property
    def elastic(self) -> bool: ...

    @property
    def host_list(self) -> tuple[HostSlots, ...]: ...

    @property
    def server_host_list(self) -> tuple[str, ...]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What a launcher can serve.

    Attributes:
        controllers: the controllers its ranks may run (``--gloo``, ``--mpi``).
        servers: it starts parameter servers and their scheduler (``-s``).
        elastic: it runs elastic jobs (the elastic driver starts workers through it).
        sync_dst_dir: it copies the working directory to the hosts (``--sync-dst-dir``).
        host_list: it takes ``-H``/``--hostfile`` (else the host list comes from its environment).
        remote_hosts: it starts processes on hosts other than this machine.
        mpi_args: it passes extra arguments to mpirun (``--mpi-args``).
    """

    controllers: tuple[str, ...] = ("gloo",)
    servers: bool = False
    elastic: bool = False
    sync_dst_dir: bool = False
    host_list: bool = True
    remote_hosts: bool = True
    mpi_args: bool = False

    def serves(self, need: str, config: ConfigView) -> bool:
        """Whether a launcher with these capabilities serves ``need`` (one of :data:`NEEDS`) as ``config`` asks."""
        if need == "controller":
            return config.controller in self.controllers
        if need == "remote_hosts":
            return self.remote_hosts or not remote_hosts(config)
        return bool(getattr(self, need))


def asked(need: str, config: ConfigView) -> bool:
    """Whether ``config`` asks for ``need`` (one of :data:`NEEDS`; the controller is always asked for)."""
    if need == "elastic":
        return config.elastic
    if need == "servers":
        return config.num_servers > 0
    if need == "host_list":
        return config.hosts is not None
    if need == "remote_hosts":
        return bool(remote_hosts(config))
    if need == "sync_dst_dir":
        return config.sync_dst_dir is not None
    if need == "mpi_args":
        return bool(config.mpi_args)
    return need == "controller"


def remote_hosts(config: ConfigView) -> list[str]:
    """The hosts of the job (workers' and ``--server-hosts``) that are not this machine, in order."""
    names = (*(h.host for h in config.host_list), *config.server_host_list)
    return [h for h in dict.fromkeys(names) if not is_local_host(h)]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """What ``hora run`` was asked for, as launcher detection sees it.

    Attributes:
        hosts: every host named (``-H``/``--hostfile`` and ``--server-hosts``);
            None when none was.
        controller: ``"gloo"``, ``"mpi"`` or None (not asked for).
        servers: parameter servers asked for (``-s``).
        elastic: an elastic job.
        environ: the environment ``hora run`` runs in.
        mpi: whether MPI can start jobs here; None probes the machine.
    """

    hosts: tuple[HostSlots, ...] | None = None
    controller: str | None = None
    servers: int = 0
    elastic: bool = False
    environ: Mapping[str, str] = dataclasses.field(default_factory=dict)
    mpi: bool | None = None


class Launcher:
    """A way to start the processes of a job; subclasses declare themselves (see the module docstring).

    An instance runs one job: :meth:`prepare` does what must happen before
    the environment can be built (the ssh launcher copies files and reaches
    every host) and returns where rank 0 and the parameter-server scheduler
    listen.  :meth:`run` then starts one process per slot
    (``config.command`` for workers,
    :func:`hora.runner.plan.slot_command` for the others) with ``env`` plus
    :meth:`Slot.env`, prints their output through ``sink``, stops every
    process soon after the first one fails or after a signal is polled from
    ``interrupt`` (SIGTERM/SIGINT, then SIGKILL after
    ``config.grace_period``), and returns a :class:`JobResult` whose
    ``root_cause`` is the first process that failed on its own.
    :meth:`close` releases whatever :meth:`prepare` acquired, and is safe to
    call twice.
    """

    #: The launcher's name, as ``--launcher`` takes it.
    name: ClassVar[str]
    #: Other spellings ``--launcher`` accepts for it.
    aliases: ClassVar[tuple[str, ...]] = ()
    #: How it starts processes, for ``--help`` ("srun inside an allocation").
    summary: ClassVar[str] = ""
    #: When detection picks it, for ``--help`` ("inside an allocation"); empty: never picked by itself.
    detects: ClassVar[str] = ""
    #: Detection order: lower is asked first (see the module docstring).
    priority: ClassVar[int] = 50
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: This launcher's message for each need of :data:`NEEDS` it does not serve; ``str.format`` fields:
    #: ``launcher``, ``able`` ("the local and ssh launchers"), ``controller``, ``servers``, ``remote``.
    refusals: ClassVar[Mapping[str, str]] = {}
    #: Whether it checks that the command exists where each process runs (else ``hora run`` checks here).
    checks_command: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return  # an intermediate base, not a launcher
        missing = [n for n in NEEDS if n not in cls.refusals and not _can_ever(cls.capabilities, n)]
        if missing:
            raise TypeError(f"launcher {cls.name!r} ({cls.__name__}) must declare its refusal for {missing}")
        for name in (cls.name, *cls.aliases):
            if name in _REGISTRY and _REGISTRY[name] is not cls:
                raise TypeError(f"--launcher {name} is declared by both {_REGISTRY[name].__name__} and {cls.__name__}")
            _REGISTRY[name] = cls

    @classmethod
    def detect(cls, request: Request) -> bool:
        """Whether the environment calls for this launcher when ``--launcher`` is left out."""
        return False

    @classmethod
    def hosts(cls, config: ConfigView) -> list[HostSlots]:
        """The hosts the workers fill in order: ``-H``/``--hostfile`` with this machine's names merged."""
        return merged_hosts(config.host_list)

    @classmethod
    def server_hosts(cls, hosts: Sequence[HostSlots], workers: Sequence[Slot], count: int) -> list[str]:
        """Where ``count`` parameter servers run when ``--server-hosts`` is not given: round-robin over ``hosts``."""
        return [hosts[index % len(hosts)].host for index in range(count)]

    @classmethod
    def check(cls, config: ConfigView) -> None:
        """Refuse, with this launcher's message, what ``config`` asks and this launcher does not serve.

        Raises:
            ConfigError: the first need (in :data:`NEEDS` order) that is asked for and not served.
        """
        for need in NEEDS:
            if asked(need, config) and not cls.capabilities.serves(need, config):
                raise ConfigError(cls.refusals[need].format(**_message_fields(cls, need, config)))

    def submits(self, config: ConfigView) -> bool:
        """Whether this job goes to a batch system as a whole (:meth:`submit`) instead of starting here."""
        return False

    def submit(self, config: ConfigView, stdout: TextIO, stderr: TextIO, interrupt: Interrupt) -> JobResult:
        """Hand the whole job to a batch system, which runs this same launch inside it; its outcome."""
        raise NotImplementedError

    def prepare(self, config: ConfigView, slots: Sequence[Slot]) -> Endpoints:
        """Get ready to start ``slots``; return where rank 0 and the scheduler listen."""
        raise NotImplementedError

    def run(
        self,
        config: ConfigView,
        slots: Sequence[Slot],
        env: Mapping[str, str],
        sink: OutputSink,
        interrupt: Interrupt,
    ) -> JobResult:
        """Start every process of ``slots``, supervise them until all have ended, and report."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what :meth:`prepare` acquired (safe to call twice)."""


_REGISTRY: dict[str, type[Launcher]] = {}
_loaded = False


def _can_ever(capabilities: Capabilities, need: str) -> bool:
    if need == "controller":
        return set(capabilities.controllers) >= set(CONTROLLERS)
    return bool(getattr(capabilities, need))


def _message_fields(cls: type[Launcher], need: str, config: ConfigView) -> dict[str, object]:
    if need == "controller":
        able = [c for c in launchers() if config.controller in c.capabilities.controllers]
    elif need == "remote_hosts":
        able = [c for c in launchers() if c.capabilities.remote_hosts and c.capabilities.host_list]
    else:
        able = [c for c in launchers() if _can_ever(c.capabilities, need)]
    names = sorted(c.name for c in able)
    listed = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    remote = remote_hosts(config)
    return {
        "launcher": cls.name, "able": f"the {listed} launcher{'s' if len(names) > 1 else ''}",
        "controller": config.controller, "servers": config.num_servers, "remote": remote[0] if remote else "",
    }


def launchers() -> list[type[Launcher]]:
    """Every registered launcher, in detection order (``priority``, then name)."""
    _load()
    return sorted(set(_REGISTRY.values()), key=lambda c: (c.priority, c.name))


def launcher_names() -> tuple[str, ...]:
    """Every name ``--launcher`` accepts: each launcher's name and aliases, then the known but unavailable ones."""
    return (*(n for c in launchers() for n in (c.name, *c.aliases)), *UNAVAILABLE)


def launcher_help() -> str:
    """The help of ``--launcher``: each launcher's summary, then the detection order."""
    every = launchers()
    what = ", ".join(f"{c.name} ({c.summary})" if c.summary else c.name for c in every)
    order = "; ".join(f"{c.name} {c.detects}" for c in every if c.detects)
    return f"how processes start: {what}. Default, the first that fits: {order}"


def launcher_class(name: str) -> type[Launcher]:
    """The launcher that ``--launcher name`` means.

    Raises:
        ConfigError: no launcher has that name (for one MXNet knows and hora cannot run, what to do instead).
    """
    _load()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in UNAVAILABLE:
        raise ConfigError(UNAVAILABLE[name])
    known = ", ".join(sorted(c.name for c in launchers()))
    raise ConfigError(f"--launcher {name!r} is not one of {known}")


def get_launcher(name: str) -> Launcher:
    """A new launcher called ``name`` (one per job: a launcher keeps the job's connections).

    Raises:
        LaunchError: the launcher does not exist.
    """
    try:
        return launcher_class(name)()
    except ConfigError as e:
        raise LaunchError(f"unknown launcher {name!r}: {e}") from None


def choose(request: Request) -> type[Launcher]:
    """The launcher for a job that left ``--launcher`` out.

    The candidates are the launchers serving the controller asked for (and
    elastic training, when asked for, if any does); the first of them in
    ``priority`` order whose :meth:`Launcher.detect` says yes is chosen.

    Raises:
        ConfigError: no launcher serves the request.
    """
    pool = [c for c in launchers() if request.controller is None or request.controller in c.capabilities.controllers]
    if request.elastic:
        # elastic jobs run under the launchers that can; the others refuse them in their own words
        pool = [c for c in pool if c.capabilities.elastic] or pool
    for candidate in pool:
        if candidate.detect(request):
            return candidate
    raise ConfigError(f"no launcher serves controller {request.controller!r} here: give --launcher")


def detect_launcher(
    hosts: Sequence[HostSlots] | None,
    controller: str | None,
    environ: Mapping[str, str] | None = None,
    *,
    servers: int = 0,
    elastic: bool = False,
    mpi: bool | None = None,
) -> str:
    """The name of the launcher :func:`choose` picks (``environ`` defaults to this process's environment)."""
    request = Request(
        hosts=None if hosts is None else tuple(hosts), controller=controller, servers=servers, elastic=elastic,
        environ=os.environ if environ is None else environ, mpi=mpi,
    )
    return choose(request).name


def _load() -> None:
    """Import every launcher module of this package once; each launcher registers itself."""
    global _loaded
    if _loaded:
        return
    package = __name__.rpartition(".")[0]  # by name: the launchers import this module, not the reverse
    for module in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if module.name not in ("base", "registry"):
            importlib.import_module(f"{package}.{module.name}")
    _loaded = True
