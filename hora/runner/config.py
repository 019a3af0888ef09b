"""What a job launch needs, as one validated dataclass.

The CLI (:mod:`hora.runner.cli`) and the Python API (:func:`hora.run`) both
build a :class:`LaunchConfig` and hand it to :func:`hora.runner.launch.launch`,
so the two share one code path.  Everything a user can get wrong is checked
here, at construction, with a message that names the flag and the value.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence

from hora.errors import ConfigError

#: Launchers that exist in this release.
AVAILABLE_LAUNCHERS = ("local", "mpi")
#: Launchers that are planned; asking for one gives a clear "not available yet".
PLANNED_LAUNCHERS = ("ssh", "slurm")
CONTROLLERS = ("gloo", "mpi")


@dataclasses.dataclass(frozen=True, slots=True)
class HostSlots:
    """One host of the job and how many processes it may run."""

    host: str
    slots: int

    def __str__(self) -> str:
        return f"{self.host}:{self.slots}"


def parse_hosts(spec: str) -> tuple[HostSlots, ...]:
    """Parse horovodrun's ``-H host1:2,host2:4`` syntax.

    A host without ``:slots`` gets one slot, as in horovodrun.

    Raises:
        ConfigError: an entry is empty or its slot count is not a positive integer.
    """
    hosts: list[HostSlots] = []
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            raise ConfigError(f"-H {spec!r} has an empty host entry")
        name, sep, count = entry.rpartition(":")
        if not sep or "]" in count or (name.count(":") and not name.endswith("]")):
            name, count = entry, "1"  # no slot count (or a bare IPv6 address)
        hosts.append(HostSlots(name.strip("[]"), _slot_count(count, entry)))
    return tuple(hosts)


def parse_hostfile(path: str) -> tuple[HostSlots, ...]:
    """Read a hostfile: one host per line as ``host``, ``host:N`` or ``host slots=N``.

    The first two forms are MXNet launch.py's, the last is horovodrun's
    (and Open MPI's).  Blank lines and ``#`` comments are skipped.

    Raises:
        ConfigError: the file cannot be read, is empty or has a malformed line.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read hostfile {path!r}: {e.strerror}") from e
    hosts: list[HostSlots] = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) == 1:
            hosts.extend(parse_hosts(fields[0]))
        elif len(fields) == 2 and fields[1].startswith("slots="):
            hosts.append(HostSlots(fields[0], _slot_count(fields[1][6:], f"{path}:{number}")))
        else:
            raise ConfigError(f"{path}:{number}: cannot parse {raw!r} (use 'host slots=N' or 'host:N')")
    if not hosts:
        raise ConfigError(f"hostfile {path!r} lists no hosts")
    return tuple(hosts)


def _slot_count(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ConfigError(f"slot count {text!r} in {where!r} is not an integer") from None
    if slots < 1:
        raise ConfigError(f"slot count {slots} in {where!r} must be >= 1")
    return slots


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (a loopback address or our own hostname)."""
    name = host.strip("[]").lower()
    if name in ("localhost", "localhost.localdomain"):
        return True
    try:
        if ipaddress.ip_address(name).is_loopback:
            return True
    except ValueError:
        pass
    own = {socket.gethostname().lower(), socket.getfqdn().lower()}
    own |= {n.split(".")[0] for n in own}
    return name in own


@dataclasses.dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """Everything ``hora run`` / ``hora.run`` needs to start a job.

    Attributes:
        command: the program each worker runs, e.g. ``["python", "train.py"]``.
        num_proc: number of worker processes (``-np``).
        hosts: hosts and their slots (``-H`` / ``--hostfile``); ``None`` means
            ``localhost:num_proc``.  A string is parsed like ``-H``.
        controller: ``"gloo"`` or ``"mpi"``; ``None`` picks ``mpi`` for the mpi
            launcher and ``gloo`` otherwise.
        launcher: ``"local"`` or ``"mpi"`` (``"ssh"``/``"slurm"`` are planned);
            ``None`` picks ``mpi`` for the mpi controller and ``local`` otherwise.
        num_servers: parameter servers (MXNet's ``-s``); must be 0 for now.
        fusion_threshold_mb: engine fusion buffer size, exported as
            ``HORA_FUSION_THRESHOLD`` in bytes.
        cycle_time_ms: engine cycle time, exported as ``HORA_CYCLE_TIME``.
        timeline_filename: exported as ``HORA_TIMELINE`` (absolute path).
        output_filename: directory for per-rank logs ``DIR/rank.N/{stdout,stderr}``.
        start_timeout: seconds the workers may take to rendezvous
            (``HORA_START_TIMEOUT``).
        network_interface: interface whose address is the rendezvous address;
            exported as ``HORA_NETWORK_INTERFACE`` and ``GLOO_SOCKET_IFNAME``.
        env: extra environment variables for every worker.
        mpi_args: extra arguments for mpirun (mpi launcher only).
        verbose: print the launch plan.
        grace_period: seconds between SIGTERM and SIGKILL when stopping workers.
    """

    command: Sequence[str]
    num_proc: int
    hosts: tuple[HostSlots, ...] | str | None = None
    controller: str | None = None
    launcher: str | None = None
    num_servers: int = 0
    fusion_threshold_mb: float | None = None
    cycle_time_ms: float | None = None
    timeline_filename: str | None = None
    output_filename: str | None = None
    start_timeout: float | None = None
    network_interface: str | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    mpi_args: Sequence[str] = ()
    verbose: bool = False
    grace_period: float = 3.0

    def __post_init__(self) -> None:
        self.command = tuple(self.command)
        if not self.command or not self.command[0]:
            raise ConfigError("no command to run: put it after the flags, e.g. 'hora run -np 2 python train.py'")
        if isinstance(self.num_proc, bool) or not isinstance(self.num_proc, int):
            raise ConfigError(f"-np {self.num_proc!r} must be an integer")
        if self.num_proc < 1:
            raise ConfigError(f"-np {self.num_proc} must be at least 1")
        if isinstance(self.hosts, str):
            self.hosts = parse_hosts(self.hosts)
        elif self.hosts is not None:
            self.hosts = tuple(self.hosts)
            if not self.hosts:
                raise ConfigError("the host list is empty")
        if self.hosts is not None and self.num_proc > self.total_slots:
            raise ConfigError(
                f"-np {self.num_proc} is more than the {self.total_slots} slots in "
                f"-H {','.join(map(str, self.hosts))}; lower -np or add slots"
            )
        self._check_strategy()
        self._check_knobs()
        self.env = {str(k): str(v) for k, v in dict(self.env).items()}
        self.mpi_args = tuple(self.mpi_args)
        if self.mpi_args and self.launcher != "mpi":
            raise ConfigError("mpi_args only apply to the mpi launcher (pass --mpi)")
        for name in ("timeline_filename", "output_filename"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, os.path.abspath(value))

    def _check_strategy(self) -> None:
        if self.controller is not None and self.controller not in CONTROLLERS:
            raise ConfigError(f"controller {self.controller!r} is not one of {', '.join(CONTROLLERS)}")
        known = AVAILABLE_LAUNCHERS + PLANNED_LAUNCHERS
        if self.launcher is not None and self.launcher not in known:
            raise ConfigError(f"--launcher {self.launcher!r} is not one of {', '.join(known)}")
        if self.launcher is None:
            self.launcher = "mpi" if self.controller == "mpi" else "local"
        if self.controller is None:
            self.controller = "mpi" if self.launcher == "mpi" else "gloo"
        if self.controller == "mpi" and self.launcher != "mpi":
            raise ConfigError(
                f"--mpi needs the mpi launcher (mpirun starts MPI jobs), not --launcher {self.launcher}"
            )
        if self.launcher == "mpi" and self.controller != "mpi":
            raise ConfigError("--launcher mpi runs the MPI controller; drop --gloo or use --launcher local")
        if self.num_servers < 0:
            raise ConfigError(f"-s {self.num_servers} must be >= 0")
        if self.num_servers > 0:
            raise ConfigError(
                f"-s {self.num_servers}: parameter servers arrive with the KVStore issue; "
                "for now run without -s (allreduce only)"
            )

    def _check_knobs(self) -> None:
        if self.fusion_threshold_mb is not None and self.fusion_threshold_mb < 0:
            raise ConfigError(f"--fusion-threshold-mb {self.fusion_threshold_mb} must be >= 0")
        if self.cycle_time_ms is not None and self.cycle_time_ms <= 0:
            raise ConfigError(f"--cycle-time-ms {self.cycle_time_ms} must be > 0")
        if self.start_timeout is not None and self.start_timeout <= 0:
            raise ConfigError(f"--start-timeout {self.start_timeout} must be > 0 seconds")
        if self.grace_period < 0:
            raise ConfigError(f"grace period {self.grace_period} s must be >= 0")

    @property
    def total_slots(self) -> int:
        """Slots over all hosts (``num_proc`` when no hosts were given)."""
        if self.hosts is None:
            return self.num_proc
        return sum(h.slots for h in self.hosts)  # type: ignore[union-attr]

    @property
    def host_list(self) -> tuple[HostSlots, ...]:
        """The hosts, defaulting to ``localhost:num_proc``."""
        if self.hosts is None:
            return (HostSlots("localhost", self.num_proc),)
        return self.hosts  # type: ignore[return-value]
