"""What a job launch needs, as one validated dataclass.

The CLI (:mod:`hora.runner.cli`) and the Python API (:func:`hora.run`) both
build a :class:`LaunchConfig` and hand it to :func:`hora.runner.launch.launch`,
so the two share one code path.  Everything a user can get wrong is checked
here, at construction, with a message that names the flag and the value;
what a launcher cannot serve, the launcher's class refuses in its own words
(:mod:`hora.runner.launchers.registry`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

from hora.errors import ConfigError
from hora.placement import HostSlots
from hora.runner.hostlist import check_host_name, check_unique_hosts, parse_hosts, split_entry, spread
from hora.runner.launchers.registry import CONTROLLERS, Request, choose, launcher_class


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
            :func:`hora.runner.launchers.registry.choose`) and ``gloo`` otherwise.
        launcher: a launcher's name (``"local"``, ``"ssh"``, ``"mpi"``,
            ``"slurm"``, ... as registered in :mod:`hora.runner.launchers.registry`);
            ``None`` chooses one from the environment and the other fields.
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
        self._check_servers()
        self._check_elastic()
        self.env = {str(k): str(v) for k, v in dict(self.env).items()}
        self.mpi_args = tuple(self.mpi_args)
        self._choose_launcher()
        self._check_knobs()
        self._check_ssh()
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
            if ":" in name and split_entry(name)[1] is not None:
                raise ConfigError(f"{where}: give host names without slot counts ({name!r}); the servers go "
                                  "round-robin over the hosts, so list a host twice to give it two servers")
            checked.append(check_host_name(name, where))
        if not checked:
            raise ConfigError("--server-hosts lists no hosts: give host1,host2,... or leave it out")
        self.server_hosts = tuple(checked)

    def _check_servers(self) -> None:
        if isinstance(self.num_servers, bool) or not isinstance(self.num_servers, int) or self.num_servers < -1:
            raise ConfigError(f"-s {self.num_servers} must be >= 0 (or -s alone for as many servers as workers)")
        if self.num_servers == -1:
            self.num_servers = self.num_proc
        if self.server_hosts and self.num_servers == 0:
            raise ConfigError(f"--server-hosts {','.join(self.server_host_list)} places parameter servers, but "
                              "none are started: add -s N")

    def _choose_launcher(self) -> None:
        """Take ``--launcher`` (or detect one), default the controller; the launcher refuses what it cannot serve."""
        if self.controller is not None and self.controller not in CONTROLLERS:
            raise ConfigError(f"controller {self.controller!r} is not one of {', '.join(CONTROLLERS)}")
        if self.launcher is None:
            every_host = None if self.hosts is None and not self.server_hosts else (
                *self.host_list, *(HostSlots(h, 1) for h in self.server_host_list))
            chosen = choose(Request(hosts=every_host, controller=self.controller, servers=self.num_servers,
                                    elastic=self.elastic, environ=os.environ))
            self.mpi_by_default = self.controller is None and "gloo" not in chosen.capabilities.controllers
        else:
            chosen = launcher_class(self.launcher)
        self.launcher = chosen.name
        if (self.sge_queue or self.sge_pe) and self.launcher != "sge":
            raise ConfigError("--sge-queue and --sge-pe apply to --launcher sge only")
        if self.controller is None:
            self.controller = chosen.capabilities.controllers[0]
        chosen.check(self)

    @property
    def elastic(self) -> bool:
        """Whether this is an elastic job: a discovery script, ``--min-np`` or ``--max-np`` was given."""
        return (self.host_discovery_script is not None or self.min_np is not None or self.max_np is not None)

    def _check_elastic(self) -> None:
        if not self.elastic:
            return
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
