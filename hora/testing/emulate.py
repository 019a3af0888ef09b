"""An emulated multi-host cluster on one Linux machine, for tests and benchmarks.

Each host is a network namespace with its own address on a private bridge, its
own hostname (a UTS namespace) and its own ``/etc/hosts`` naming every host,
and it runs OpenSSH's ``sshd`` on its address with keys generated for the
cluster.  Hosts share the file system except for one private directory,
:attr:`EmulatedCluster.scratch`, so copying files to "another host" (what
``hora run --sync-dst-dir`` does) can be checked for real.  Links can be
shaped with ``tc`` (bandwidth and one-way latency per host link).

    with EmulatedCluster(n_hosts=3, link="1gbit", latency="0.1ms") as cluster:
        for host in cluster.hosts:
            print(host.name, host.addr)
        cluster.run("h1", ["hora", "run", "-np", "6", "-H", cluster.hosts_spec(2),
                           "--ssh-config-file", cluster.ssh_config, "python", "train.py"])

Commands run "on" a host with :meth:`EmulatedCluster.popen` / :meth:`run`
(``nsenter`` into the host's namespaces); a launcher started there reaches
the other hosts over ssh exactly as on a real cluster.  The user's own
``~/.ssh`` is never read or written: the cluster has its own ssh config,
identity and known_hosts files, passed to ssh with ``-F``.

Needs root, ``ip`` (iproute2), ``unshare``/``nsenter`` (util-linux) and
``sshd`` (Debian's openssh-server).  It installs nothing itself: the
project's test set-up does (``./dev setup``), and a missing tool raises
:class:`ClusterUnavailable` naming the ``apt-get install`` command that
provides it.  :func:`unavailable_reason` says why a machine cannot run it.
Set-up and teardown are idempotent; teardown runs on ``close()``, on leaving
the ``with`` block and at interpreter exit, and resources left by a process
that died (its start time no longer matches the record) are swept when the
next cluster starts.
``python -m hora.testing.emulate up|down|sweep`` drives it by hand.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hora.errors import HoraError

logger = logging.getLogger(__name__)

#: Where clusters register themselves (tmpfs: cleared at reboot, like the namespaces).
REGISTRY = "/run/hora-emulate"
#: Each cluster gets 10.231.<index>.0/24; the bridge holds .254.
SUBNET_PREFIX = "10.231"
MAX_CLUSTERS = 64
INTERFACE = "eth0"
SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/bin/sshd")
_RATE = re.compile(r"^\d+(\.\d+)?([kmg]?bit|[kmg]?bps)$", re.IGNORECASE)
_TIME = re.compile(r"^\d+(\.\d+)?(s|ms|us|usec|msec)$", re.IGNORECASE)


class ClusterUnavailable(HoraError):
    """This machine cannot run an emulated cluster (no root, no ``ip netns``, no sshd)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
    """One emulated host.

    Attributes:
        name: its hostname (``h1``, ``h2``, ...), resolvable on every host.
        addr: its IPv4 address on the cluster bridge.
        netns: the network namespace (``ip netns exec NETNS ...`` works too).
        interface: its network interface inside the namespace (``eth0``).
        pid: the host's sshd, whose namespaces :meth:`EmulatedCluster.popen` enters.
    """

    name: str
    addr: str
    netns: str
    interface: str
    pid: int


def _run(argv: Sequence[str], check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=60, **kwargs)
    if check and result.returncode != 0:
        raise ClusterUnavailable(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _find_sshd() -> str | None:
    for path in SSHD_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("sshd")


#: The Debian packages that provide each tool the emulated cluster may need; the test path
#: (``./dev setup``, ``tests/cluster/system-packages.sh``) installs them, never this module.
PACKAGES = {
    "sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client", "rsync": "rsync",
    "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "srun": "slurm-wlm", "sinfo": "slurm-wlm",
    "salloc": "slurm-wlm", "scontrol": "slurm-wlm",
    "sge_qmaster": "gridengine-master", "sge_execd": "gridengine-exec", "qsub": "gridengine-client",
    "qconf": "gridengine-client", "qrsh": "gridengine-client", "qstat": "gridengine-client",
}


def install_hint(tools: Sequence[str]) -> str:
    """``apt-get install -y PKG...`` for the Debian packages that provide ``tools``."""
    packages = dict.fromkeys(PACKAGES.get(os.path.basename(t), t) for t in tools)
    return "apt-get install -y " + " ".join(packages)


def require_tools(tools: Sequence[str], what: str) -> None:
    """Raise :class:`ClusterUnavailable` naming the install command when any of ``tools`` is missing.

    The emulated cluster never installs system packages by itself: the
    project's test set-up does (``./dev setup``), or the user, with the
    command the message names.
    """
    missing = [t for t in tools if _which(t) is None]
    if missing:
        raise ClusterUnavailable(
            f"{what} needs {', '.join(missing)}, which is not installed; run: {install_hint(missing)}"
        )


def _which(tool: str) -> str | None:
    if tool == "sshd":
        return _find_sshd()
    # Debian keeps the grid engine's daemons in /usr/sbin and its tools in /usr/lib/gridengine.
    return shutil.which(tool) or next(
        (p for p in (f"/usr/sbin/{tool}", f"/usr/lib/gridengine/{tool}") if os.access(p, os.X_OK)), None
    )


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot run here, or None when it can.

    It installs nothing: a missing tool is reported with the apt-get
    command that installs it.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth links, tc)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs {tool!r} on PATH"
    missing = [t for t in ("sshd", "ssh", "ssh-keygen") if _which(t) is None]
    if missing:
        return f"the emulated cluster needs {', '.join(missing)}; run: {install_hint(missing)}"
    probe = f"horaprobe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        return f"'ip netns add' does not work here: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


# --- the registry of running clusters and the stale sweep -------------------------


def _process_alive(pid: int, started: float | None) -> bool:
    """Whether ``pid`` is the process that registered a cluster (same start time, when one was recorded).

    psutil is used when installed; without it the start time comes from
    ``/proc/<pid>/stat``, in the same units (seconds since the epoch), so a
    live owner is never taken for dead and a reused pid is.
    """
    if pid <= 0:
        return False
    now = _start_time(pid)
    if now is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True  # alive, but its start time is unreadable: never sweep a cluster that may be in use
    return started is None or abs(now - started) < 1.0


def _start_time(pid: int) -> float | None:
    """When ``pid`` started, in seconds since the epoch (psutil's ``create_time``), or None if gone/unknown."""
    try:
        import psutil
    except ImportError:
        return _proc_start_time(pid)
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:
        return _proc_start_time(pid)


def _proc_start_time(pid: int) -> float | None:
    # Field 22 of /proc/<pid>/stat is the start in clock ticks after boot; the boot time is btime in
    # /proc/stat.  psutil computes create_time() the same way, so records from either path compare.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def _own_start_time() -> float | None:
    return _start_time(os.getpid())


def _netns_list() -> list[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _kill_netns_processes(netns: str) -> None:
    for _ in range(3):
        result = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
        pids = [int(p) for p in result.stdout.split() if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _destroy(index: int, state_dir: str | None) -> None:
    """Remove every trace of cluster ``index``; each step tolerates what is already gone."""
    prefix = f"hora{index}-h"
    for netns in _netns_list():
        if netns.startswith(prefix) and netns[len(prefix):].isdigit():
            _kill_netns_processes(netns)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
    # The kernel frees a deleted namespace's veth pairs asynchronously; delete our ends now, so
    # that a cluster built right after this one under the same index finds the names free.
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    for name in re.findall(rf"^\d+: (hora{index}v\d+)[@:]", links, flags=re.MULTILINE):
        subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", f"hora{index}br"], capture_output=True, timeout=30)
    if state_dir and os.path.basename(state_dir).startswith("hora-cluster"):
        _unmount_under(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(REGISTRY, f"{index}.json"))


def _unmount_under(path: str) -> None:
    # Bind mounts live in the hosts' private mount namespaces, which died with
    # their processes; this only matters if someone bind-mounted in ours.
    with contextlib.suppress(OSError), open("/proc/self/mounts", encoding="utf-8") as f:
        mounts = [line.split()[1] for line in f if line.split()[1].startswith(path + "/")]
    for mount in sorted(mounts, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)


def sweep_stale() -> list[int]:
    """Tear down clusters whose owning process has died; return their indexes."""
    swept: list[int] = []
    registered: set[int] = set()
    if os.path.isdir(REGISTRY):
        for name in os.listdir(REGISTRY):
            if not name.endswith(".json") or not name[:-5].isdigit():
                continue
            index = int(name[:-5])
            registered.add(index)
            try:
                with open(os.path.join(REGISTRY, name), encoding="utf-8") as f:
                    record = json.load(f)
            except (OSError, ValueError):
                record = {}
            if not record or not _process_alive(int(record.get("pid", 0)), record.get("started")):
                _destroy(index, record.get("state_dir"))
                swept.append(index)
    for netns in _netns_list():  # namespaces whose registry entry is gone
        match = re.fullmatch(r"hora(\d+)-h\d+", netns)
        if match and int(match.group(1)) not in registered and int(match.group(1)) not in swept:
            _destroy(int(match.group(1)), None)
            swept.append(int(match.group(1)))
    if swept:
        logger.warning("removed emulated clusters left behind by dead processes: %s", swept)
    return swept


def _claim_index(state_dir: str) -> int:
    os.makedirs(REGISTRY, exist_ok=True)
    record = json.dumps({"pid": os.getpid(), "started": _own_start_time(), "state_dir": state_dir})
    for index in range(MAX_CLUSTERS):
        try:
            fd = os.open(os.path.join(REGISTRY, f"{index}.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            f.write(record)
        return index
    raise ClusterUnavailable(f"all {MAX_CLUSTERS} emulated-cluster slots in {REGISTRY} are taken")


# --- the cluster ------------------------------------------------------------------


class EmulatedCluster:
    """N emulated hosts, each a network namespace with sshd, on one bridge.

    Args:
        n_hosts: how many hosts (named ``h1`` .. ``hN``).
        link: bandwidth of every host's link, in tc units (``"1gbit"``,
            ``"10gbit"``); None leaves links unshaped.
        latency: one-way delay added to every packet a host sends
            (``"0.1ms"``, ``"100us"``); None adds none.

    Raises:
        ClusterUnavailable: the machine cannot run it (see :func:`unavailable_reason`).
        ConfigError: ``link``/``latency`` are not tc values.
    """

    def __init__(
        self, n_hosts: int = 3, *, link: str | None = None, latency: str | None = None
    ) -> None:
        from hora.errors import ConfigError

        if not 1 <= n_hosts <= 250:
            raise ConfigError(f"n_hosts={n_hosts} must be between 1 and 250")
        for name, value, pattern in (("link", link, _RATE), ("latency", latency, _TIME)):
            if value is not None and not pattern.match(value):
                raise ConfigError(f"{name}={value!r} is not a tc value (e.g. link='1gbit', latency='0.1ms')")
        self.n_hosts = n_hosts
        self.link = link
        self.latency = latency
        self.hosts: list[Host] = []
        self.index: int | None = None
        self.state_dir: str | None = None
        self._sshd: dict[str, subprocess.Popen] = {}
        self._daemons: list[subprocess.Popen] = []
        self._sge_daemons: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- public API --

    @property
    def ssh_config(self) -> str:
        """The cluster's ssh client config: give it to ``hora run --ssh-config-file`` or ``ssh -F``."""
        return self._path("ssh_config")

    @property
    def identity_file(self) -> str:
        """The private key every host accepts (for ``--ssh-identity-file``)."""
        return self._path("id_ed25519")

    @property
    def known_hosts(self) -> str:
        """A known_hosts file with every host's key, by name and address."""
        return self._path("known_hosts")

    @property
    def scratch(self) -> str:
        """A directory that is private to each host (the same path shows different content on each)."""
        return self._path("scratch")

    @property
    def bridge_addr(self) -> str:
        """This machine's own address on the cluster bridge (reachable from every host)."""
        return f"{SUBNET_PREFIX}.{self.index}.254"

    def host(self, name: str) -> Host:
        """The host called ``name``."""
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} in this cluster ({', '.join(h.name for h in self.hosts)})")

    def hosts_spec(self, slots: int = 1) -> str:
        """``h1:slots,h2:slots,...`` for ``hora run -H``."""
        return ",".join(f"{h.name}:{slots}" for h in self.hosts)

    def host_path(self, host: str, path: str) -> str:
        """Where a path under :attr:`scratch`, as seen on ``host``, lives on this machine's file system."""
        relative = os.path.relpath(path, self.scratch)
        if relative.startswith(".."):
            raise ValueError(f"{path!r} is not under the private directory {self.scratch!r}")
        return os.path.normpath(os.path.join(self._path("hosts", self.host(host).name, "scratch"), relative))

    def command(self, host: str, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` prefixed so that it runs on ``host`` (in its network, UTS and mount namespaces)."""
        target = self.host(host)
        prefix = ["nsenter", "--target", str(target.pid), "--net", "--uts", "--mount"]
        prefix.append(f"--wdns={os.path.abspath(cwd) if cwd else os.getcwd()}")
        return [*prefix, "--", *argv]

    def popen(self, host: str, argv: Sequence[str], *, cwd: str | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on ``host``; keyword arguments go to :class:`subprocess.Popen`."""
        return subprocess.Popen(self.command(host, argv, cwd), **kwargs)

    def run(
        self, host: str, argv: Sequence[str], *, cwd: str | None = None, timeout: float = 120, **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to completion (text output captured unless told otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(host, argv, cwd), timeout=timeout, **kwargs)

    def ssh_command(self, host: str, remote_command: str) -> list[str]:
        """An ``ssh`` command line that runs ``remote_command`` on ``host`` with the cluster's keys."""
        return ["ssh", "-F", self.ssh_config, host, remote_command]

    def shape(self, link: str | None, latency: str | None) -> None:
        """Change (or with two Nones remove) the shaping of every host's link."""
        for name, value, pattern in (("link", link, _RATE), ("latency", latency, _TIME)):
            if value is not None and not pattern.match(value):
                from hora.errors import ConfigError

                raise ConfigError(f"{name}={value!r} is not a tc value (e.g. link='1gbit', latency='0.1ms')")
        self.link, self.latency = link, latency
        for number, host in enumerate(self.hosts, 1):
            self._shape_host(number, host)

    def start_slurm(self, cpus_per_host: int = 2, timeout: float = 30.0) -> dict[str, str]:
        """Run a Slurm cluster on the hosts: slurmctld on h1, slurmd on every host.

        It has its own config (no munge: ``auth/none``; no cgroups:
        ``proctrack/pgid``) and ports, so it touches no system Slurm.  The
        daemons stop with the cluster.

        Args:
            cpus_per_host: CPUs each node offers (tasks beyond them oversubscribe).
            timeout: seconds the nodes may take to come up.

        Returns:
            The environment to run Slurm commands with (``SLURM_CONF``), e.g.
            ``cluster.run("h1", ["salloc", "-N", "3", ...], env=env)``.

        Raises:
            ClusterUnavailable: Slurm is not installed or its nodes did not come up.
        """
        require_tools(("slurmctld", "slurmd", "srun", "sinfo", "salloc", "scontrol"), "start_slurm()")
        directory = self._path("slurm")
        os.makedirs(os.path.join(directory, "state"), exist_ok=True)
        for host in self.hosts:
            os.makedirs(os.path.join(directory, f"spool-{host.name}"), exist_ok=True)
        conf = os.path.join(directory, "slurm.conf")
        port = 16800 + 2 * (self.index or 0)
        names = f"h[1-{self.n_hosts}]" if self.n_hosts > 1 else "h1"
        with open(conf, "w", encoding="utf-8") as f:
            f.write("\n".join([
                "ClusterName=hora", "SlurmctldHost=h1", f"SlurmctldPort={port}", f"SlurmdPort={port + 1}",
                "AuthType=auth/none", "CredType=cred/none", "SlurmUser=root", "SlurmdUser=root",
                f"StateSaveLocation={directory}/state", f"SlurmdSpoolDir={directory}/spool-%n",
                f"SlurmctldPidFile={directory}/slurmctld.pid", f"SlurmdPidFile={directory}/slurmd-%n.pid",
                f"SlurmctldLogFile={directory}/slurmctld.log", f"SlurmdLogFile={directory}/slurmd-%n.log",
                "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "MpiDefault=none",
                "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2",
                "SchedulerType=sched/builtin", "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none", "MailProg=/bin/true",
                f"NodeName={names} CPUs={cpus_per_host} State=UNKNOWN",
                f"PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
            ]) + "\n")
        env = dict(os.environ, SLURM_CONF=conf)
        quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL,
                 "start_new_session": True, "env": env}
        self._daemons.append(self.popen("h1", ["slurmctld", "-D", "-f", conf], **quiet))
        for host in self.hosts:
            self._daemons.append(self.popen(host.name, ["slurmd", "-D", "-N", host.name, "-f", conf], **quiet))
        deadline = time.monotonic() + timeout
        while True:
            result = self.run("h1", ["sinfo", "-h", "-o", "%t %D"], env=env, timeout=30)
            states = dict(line.split() for line in result.stdout.splitlines() if len(line.split()) == 2)
            if states.get("idle") == str(self.n_hosts):
                return env
            if time.monotonic() > deadline:
                raise ClusterUnavailable(f"Slurm nodes did not come up in {timeout} s: sinfo says {states or result}")
            time.sleep(0.5)

    def stop_slurm(self) -> None:
        """Stop the Slurm daemons that :meth:`start_slurm` started (safe to call twice)."""
        daemons, self._daemons = self._daemons, []
        _stop(daemons)

    def stop_sge(self) -> None:
        """Stop the grid engine's daemons that :meth:`start_sge` started (safe to call twice)."""
        daemons, self._sge_daemons = self._sge_daemons, []
        # sge_qmaster takes more than 10 s to shut down on SIGTERM; its cell is thrown away anyway
        _stop(daemons, grace=2.0)

    def start_sge(self, slots_per_host: int = 2, timeout: float = 60.0) -> dict[str, str]:
        """Run Son of Grid Engine on the hosts: sge_qmaster on h1, sge_execd on every host.

        The grid engine gets a private ``SGE_ROOT`` and cell under the
        cluster's state directory (classic spooling, no system files touched)
        with one queue ``all.q`` of ``slots_per_host`` slots on every host and
        a parallel environment ``hora`` (``control_slaves TRUE``, so ``qrsh
        -inherit`` works: tight integration).  Root may run jobs (``min_uid 0``),
        the scheduler runs every second, jobs start without a login shell
        (``login_shells none``), no load threshold puts a busy machine's
        queues in alarm, and each host has its own ``tmpdir`` (the hosts
        share ``/tmp``).  The daemons stop with the cluster.

        Args:
            slots_per_host: slots each host's queue instance offers.
            timeout: seconds the qmaster and every execd may take to come up.

        Returns:
            The environment to run grid-engine commands with (``SGE_ROOT``,
            ``SGE_CELL``, ports), e.g. ``cluster.run("h1", ["qsub", ...], env=env)``.

        Raises:
            ClusterUnavailable: the grid engine is not installed or did not come up.
        """
        require_tools(("sge_qmaster", "sge_execd", "qsub", "qconf", "qrsh", "qstat"), "start_sge()")
        env = self._write_sge_cell(slots_per_host)
        quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL,
                 "start_new_session": True, "env": dict(env, SGE_ND="1")}  # SGE_ND: stay in the foreground
        self._sge_daemons.append(self.popen("h1", [_which("sge_qmaster") or "sge_qmaster"], **quiet))
        deadline = time.monotonic() + timeout
        while self.run("h1", ["qstat", "-f"], env=env, timeout=30).returncode != 0:
            if time.monotonic() > deadline or self._sge_daemons[-1].poll() is not None:
                raise ClusterUnavailable(f"sge_qmaster did not come up in {timeout} s: {self._sge_log('qmaster')}")
            time.sleep(0.3)
        self._configure_sge(env)
        for host in self.hosts:
            self._sge_daemons.append(self.popen(host.name, [_which("sge_execd") or "sge_execd"], **quiet))
        expected = self.n_hosts * slots_per_host
        while True:
            result = self.run("h1", ["qstat", "-g", "c"], env=env, timeout=30)
            available = _sge_available(result.stdout, "all.q")
            if available == expected:
                return env
            if time.monotonic() > deadline:
                raise ClusterUnavailable(
                    f"the grid engine's execds did not come up in {timeout} s ({available} of {expected} slots "
                    f"available): {result.stdout.strip()} {self._sge_log('execd')}"
                )
            time.sleep(0.3)

    def _write_sge_cell(self, slots_per_host: int) -> dict[str, str]:
        root = self._path("sge")
        # A cell left by an earlier start_sge() on this cluster (its daemons stopped) still lists its exec hosts,
        # queues and PE, and qconf refuses to add them again: start from an empty cell each time.
        self.stop_sge()  # no-op unless an earlier start's daemons still run on the cell removed below
        for old in ("default", "templates"):
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        common = os.path.join(root, "default", "common")
        spool = os.path.join(root, "default", "spool")
        templates = os.path.join(root, "templates")
        for directory in (common, os.path.join(spool, "qmaster"), templates):
            os.makedirs(directory, exist_ok=True)
        system_root = "/var/lib/gridengine"  # Debian's: binaries, libraries and utilities, shared read-only
        for name in ("bin", "lib", "utilbin", "util"):
            with contextlib.suppress(FileExistsError):
                os.symlink(os.path.join(system_root, name), os.path.join(root, name))
        names = [h.name for h in self.hosts]

        def write(path: str, lines: Sequence[str]) -> None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")

        qmaster_spool = os.path.join(spool, "qmaster")
        write(os.path.join(common, "bootstrap"), [
            "admin_user none", "default_domain none", "ignore_fqdn true", "spooling_method classic",
            "spooling_lib libspoolc", f"spooling_params {common};{qmaster_spool}",
            "binary_path /usr/lib/gridengine", f"qmaster_spool_dir {qmaster_spool}", "security_mode none",
            "listener_threads 2", "worker_threads 2", "scheduler_threads 1", "jvm_threads 0",
        ])
        write(os.path.join(common, "act_qmaster"), ["h1"])
        write(os.path.join(common, "cluster_name"), [f"hora{self.index}"])
        # Each host's name is its canonical name: without this, a name that also resolves to a
        # loopback address (127.0.0.1 is "localhost" first) can be taken for "localhost".
        write(os.path.join(common, "host_aliases"), [f"{n} {n}.hora{self.index}" for n in names])
        with open("/usr/share/gridengine/default-configuration", encoding="utf-8") as f:
            configuration = dict(line.split(None, 1) for line in f.read().splitlines()
                                 if line.strip() and not line.startswith("#"))
        configuration.update({
            "execd_spool_dir": spool, "mailer": "/bin/true", "min_uid": "0", "min_gid": "0",
            "login_shells": "none", "load_report_time": "00:00:05", "max_unheard": "00:01:00",
            "reporting_params": "accounting=false reporting=false flush_time=00:00:15 joblog=false "
                                "sharelog=00:00:00",
            "execd_params": "KEEP_ACTIVE=false",
        })
        write(os.path.join(templates, "configuration"), [f"{k} {v.strip()}" for k, v in configuration.items()])
        with open("/usr/share/gridengine/util/install_modules/inst_schedd_normal.conf", encoding="utf-8") as f:
            scheduler = dict(line.split(None, 1) for line in f.read().splitlines() if line.strip())
        # A job is scheduled within a second of its submission, whatever the load.
        scheduler.update(schedule_interval="0:0:1", job_load_adjustments="NONE",
                         load_adjustment_decay_time="0:0:0", flush_submit_sec="1", flush_finish_sec="1")
        write(os.path.join(templates, "sched_configuration"), [f"{k} {v.strip()}" for k, v in scheduler.items()])
        for kind in ("adminhosts", "submithosts"):
            for name in names:
                write(os.path.join(templates, kind, name), [f"hostname {name}"])
        for name in names:
            write(os.path.join(templates, "exechosts", name), [
                f"hostname {name}", "load_scaling NONE", "complex_values NONE", "user_lists NONE",
                "xuser_lists NONE", "projects NONE", "xprojects NONE", "usage_scaling NONE",
                "report_variables NONE",
            ])
        write(os.path.join(templates, "pes", "hora"), [
            "pe_name hora", "slots 9999", "user_lists NONE", "xuser_lists NONE", "start_proc_args NONE",
            "stop_proc_args NONE", "allocation_rule $fill_up", "control_slaves TRUE", "job_is_first_task FALSE",
            "urgency_slots min", "accounting_summary FALSE", "qsort_args NONE",
        ])
        tmpdirs = ",".join(f"[{n}={os.path.join(spool, 'tmp-' + n)}]" for n in names)
        for name in names:
            os.makedirs(os.path.join(spool, "tmp-" + name), exist_ok=True)
        queue = {
            "qname": "all.q", "hostlist": " ".join(names), "seq_no": "0", "load_thresholds": "NONE",
            "suspend_thresholds": "NONE", "nsuspend": "1", "suspend_interval": "00:05:00", "priority": "0",
            "min_cpu_interval": "00:05:00", "processors": "UNDEFINED", "qtype": "BATCH INTERACTIVE",
            "ckpt_list": "NONE", "pe_list": "hora", "rerun": "FALSE", "slots": str(slots_per_host),
            "tmpdir": f"/tmp,{tmpdirs}", "shell": "/bin/sh", "prolog": "NONE", "epilog": "NONE",
            "shell_start_mode": "unix_behavior", "starter_method": "NONE", "suspend_method": "NONE",
            "resume_method": "NONE", "terminate_method": "NONE", "notify": "00:00:60", "owner_list": "NONE",
            "user_lists": "NONE", "xuser_lists": "NONE", "subordinate_list": "NONE", "complex_values": "NONE",
            "projects": "NONE", "xprojects": "NONE", "calendar": "NONE", "initial_state": "default",
        }
        for limit in ("rt", "cpu", "fsize", "data", "stack", "core", "rss", "vmem"):
            queue[f"s_{limit}"] = queue[f"h_{limit}"] = "INFINITY"
        write(os.path.join(templates, "cqueues", "all.q"), [f"{k} {v}" for k, v in queue.items()])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SGE_", "JOB_", "PE_"))}
        env.update(SGE_ROOT=root, SGE_CELL="default", SGE_QMASTER_PORT="6444", SGE_EXECD_PORT="6445")
        spooldefaults = "/usr/lib/gridengine/spooldefaults"
        _run(["/usr/lib/gridengine/spoolinit", "classic", "libspoolc", f"{common};{qmaster_spool}", "init"], env=env)
        _run([spooldefaults, "configuration", os.path.join(templates, "configuration")], env=env)
        for kind, source in (("complexes", "/usr/share/gridengine/util/resources/centry"),
                             ("usersets", "/usr/share/gridengine/util/resources/usersets")):
            _run([spooldefaults, kind, source], env=env)
        _run([spooldefaults, "managers", "root"], env=env)
        for kind in ("adminhosts", "submithosts"):
            _run([spooldefaults, kind, os.path.join(templates, kind)], env=env)
        return env

    def _configure_sge(self, env: Mapping[str, str]) -> None:
        # What the qmaster must create itself (queue instances, the scheduler's settings) goes through qconf.
        templates = self._path("sge", "templates")
        commands = [["-Msconf", os.path.join(templates, "sched_configuration")]]
        commands += [["-Ae", os.path.join(templates, "exechosts", h.name)] for h in self.hosts]
        commands += [["-Ap", os.path.join(templates, "pes", "hora")],
                     ["-Aq", os.path.join(templates, "cqueues", "all.q")]]
        for arguments in commands:
            result = self.run("h1", ["qconf", *arguments], env=env, timeout=30)
            if result.returncode != 0:
                said = (result.stderr or result.stdout).strip()
                raise ClusterUnavailable(f"qconf {' '.join(arguments)} failed: {said}")

    def _sge_log(self, which: str) -> str:
        root = self._path("sge", "default", "spool")
        paths = [os.path.join(root, "qmaster", "messages")] if which == "qmaster" else [
            os.path.join(root, h.name, "messages") for h in self.hosts]
        tails = []
        for path in paths:
            with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
                tails.append(f"{path}: " + " / ".join(f.read().strip().splitlines()[-3:]))
        return "; ".join(tails) or "no log"

    def start(self) -> EmulatedCluster:
        """Create the hosts and start their sshd; returns ``self``.

        Raises:
            ClusterUnavailable: the machine cannot run it; nothing is left behind.
        """
        reason = unavailable_reason()
        if reason is not None:
            raise ClusterUnavailable(reason)
        sweep_stale()
        self.state_dir = tempfile.mkdtemp(prefix="hora-cluster")
        try:
            self.index = _claim_index(self.state_dir)
        except BaseException:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            raise
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every host and remove namespaces, links and files (safe to call twice)."""
        with self._lock:
            if self._closed or self.index is None:
                self._closed = True
                return
            self._closed = True
        self.stop_slurm()
        self.stop_sge()
        for proc in self._sshd.values():
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in self._sshd.values():
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=3)
        _destroy(self.index, self.state_dir)
        atexit.unregister(self.close)

    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building it --

    def _path(self, *parts: str) -> str:
        if self.state_dir is None:
            raise RuntimeError("the cluster is not started")
        return os.path.join(self.state_dir, *parts)

    def _build(self) -> None:
        index = self.index
        bridge = f"hora{index}br"
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.bridge_addr}/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        names = [f"h{i}" for i in range(1, self.n_hosts + 1)]
        addrs = {name: f"{SUBNET_PREFIX}.{index}.{i}" for i, name in enumerate(names, 1)}
        for i, name in enumerate(names, 1):
            netns, veth = f"hora{index}-{name}", f"hora{index}v{i}"
            _run(["ip", "netns", "add", netns])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", INTERFACE, "netns", netns])
            _run(["ip", "link", "set", veth, "master", bridge, "up"])
            inside = ["ip", "netns", "exec", netns]
            _run([*inside, "ip", "addr", "add", f"{addrs[name]}/24", "dev", INTERFACE])
            _run([*inside, "ip", "link", "set", INTERFACE, "up"])
            _run([*inside, "ip", "link", "set", "lo", "up"])
        self._write_ssh_files(names, addrs)
        os.makedirs(self.scratch, exist_ok=True)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        sshd = _find_sshd()
        for name in names:
            self._sshd[name] = self._start_host(name, sshd)  # type: ignore[arg-type]
        self.hosts = [
            Host(name=name, addr=addrs[name], netns=f"hora{index}-{name}", interface=INTERFACE,
                 pid=self._sshd[name].pid)
            for name in names
        ]
        for host in self.hosts:
            self._wait_for_sshd(host)
        for number, host in enumerate(self.hosts, 1):
            self._shape_host(number, host)

    def _write_ssh_files(self, names: list[str], addrs: Mapping[str, str]) -> None:
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
        _run([*keygen, "-C", "hora-emulated-cluster", "-f", self.identity_file])
        shutil.copy(self.identity_file + ".pub", self._path("authorized_keys"))
        hosts_lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        known, client = [], []
        for name in names:
            directory = self._path("hosts", name)
            os.makedirs(os.path.join(directory, "scratch"), exist_ok=True)
            key = os.path.join(directory, "ssh_host_ed25519_key")
            _run([*keygen, "-C", name, "-f", key])
            with open(key + ".pub", encoding="utf-8") as f:
                known.append(f"{name},{addrs[name]} {' '.join(f.read().split()[:2])}")
            hosts_lines.append(f"{addrs[name]} {name}")
            client += [f"Host {name}", f"    HostName {addrs[name]}"]
            with open(os.path.join(directory, "sshd_config"), "w", encoding="utf-8") as f:
                f.write("\n".join([
                    f"ListenAddress {addrs[name]}",
                    "Port 22",
                    f"HostKey {key}",
                    f"PidFile {os.path.join(directory, 'sshd.pid')}",
                    f"AuthorizedKeysFile {self._path('authorized_keys')}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",  # the key files live under /tmp, which is world-writable
                    "PrintMotd no",
                    "MaxStartups 200:30:400",
                    "MaxSessions 200",
                    "Subsystem sftp /usr/lib/openssh/sftp-server",
                    "LogLevel ERROR",
                ]) + "\n")
        with open(self.known_hosts, "w", encoding="utf-8") as f:
            f.write("\n".join(known) + "\n")
        with open(self._path("hosts_file"), "w", encoding="utf-8") as f:
            f.write("\n".join(hosts_lines) + "\n")
        with open(self.ssh_config, "w", encoding="utf-8") as f:
            f.write("\n".join([
                *client,
                "Host *",
                "    User root",
                f"    IdentityFile {self.identity_file}",
                "    IdentitiesOnly yes",
                f"    UserKnownHostsFile {self.known_hosts}",
                "    GlobalKnownHostsFile /dev/null",
                "    StrictHostKeyChecking yes",
                "    BatchMode yes",
                "    LogLevel ERROR",
            ]) + "\n")

    def _start_host(self, name: str, sshd: str) -> subprocess.Popen:
        directory = self._path("hosts", name)
        # nsenter -> unshare -> sh -> sshd all exec in place, so the Popen pid is sshd's.  nsenter
        # rather than `ip netns exec`, which remounts /sys and so hides /sys/fs/cgroup (slurmd needs it).
        script = (
            f"hostname {name} && mount --bind {self._path('hosts_file')} /etc/hosts && "
            f"mount --bind {os.path.join(directory, 'scratch')} {self.scratch} && "
            f"exec {sshd} -D -e -f {os.path.join(directory, 'sshd_config')}"
        )
        log = open(os.path.join(directory, "sshd.log"), "ab")  # noqa: SIM115 - handed to the child
        try:
            return subprocess.Popen(
                ["nsenter", f"--net=/var/run/netns/hora{self.index}-{name}", "unshare", "--uts", "--mount",
                 "--propagation", "private", "sh", "-c", script],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        finally:
            log.close()

    def _wait_for_sshd(self, host: Host, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            proc = self._sshd[host.name]
            if proc.poll() is not None:
                with open(self._path("hosts", host.name, "sshd.log"), encoding="utf-8", errors="replace") as f:
                    log = f.read().strip()
                raise ClusterUnavailable(f"sshd on {host.name} exited with code {proc.returncode}: {log}")
            try:
                with socket.create_connection((host.addr, 22), timeout=1.0) as s:
                    if s.recv(4).startswith(b"SSH"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ClusterUnavailable(f"sshd on {host.name} ({host.addr}) did not accept connections in {timeout} s")
            time.sleep(0.1)

    def _shape_host(self, number: int, host: Host) -> None:
        outward = ["ip", "netns", "exec", host.netns, "tc", "qdisc"]
        inward = ["tc", "qdisc"]
        veth = f"hora{self.index}v{number}"
        _run([*outward, "del", "dev", INTERFACE, "root"], check=False)
        _run([*inward, "del", "dev", veth, "root"], check=False)
        if self.link is None and self.latency is None:
            return
        # What a host sends is delayed and rate-limited on its own interface; what it
        # receives is rate-limited on the bridge side, so each link is shaped both ways.
        if self.latency is not None:
            netem = ["netem", "limit", "100000", "delay", self.latency]
            if self.link is not None:
                netem += ["rate", self.link]
            result = _run([*outward, "replace", "dev", INTERFACE, "root", *netem], check=False)
            if result.returncode != 0:
                raise ClusterUnavailable(
                    f"cannot add latency {self.latency}: tc netem failed ({result.stderr.strip()}); this kernel "
                    "probably lacks CONFIG_NET_SCH_NETEM, so only bandwidth (link=...) can be emulated here"
                )
        else:
            _run([*outward, "replace", "dev", INTERFACE, "root", *_tbf(self.link)])  # type: ignore[arg-type]
        if self.link is not None:
            _run([*inward, "replace", "dev", veth, "root", *_tbf(self.link)])


def _stop(daemons: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM every daemon, then SIGKILL those that have not exited ``grace`` seconds later."""
    for proc in daemons:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in daemons:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _sge_available(qstat_gc: str, queue: str) -> int:
    """The AVAIL column of ``qstat -g c`` for ``queue`` (0 when it is not listed)."""
    for line in qstat_gc.splitlines():
        fields = line.split()
        if fields and fields[0] == queue and len(fields) >= 5 and fields[4].isdigit():
            return int(fields[4])
    return 0


def latency_supported() -> bool:
    """Whether this kernel has tc netem, which :class:`EmulatedCluster` needs for ``latency=``."""
    name = f"horaq{os.getpid() % 100000}"
    if _run(["ip", "link", "add", name, "type", "veth", "peer", "name", name + "p"], check=False).returncode:
        return False
    try:
        return _run(["tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms"], check=False).returncode == 0
    finally:
        _run(["ip", "link", "del", name], check=False)


def _rate_bits(rate: str) -> float:
    match = re.match(r"^(\d+(?:\.\d+)?)([kmg]?)(bit|bps)$", rate, re.IGNORECASE)
    if match is None:
        raise ValueError(rate)
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    return float(match.group(1)) * scale * (8 if match.group(3).lower() == "bps" else 1)


def _tbf(rate: str) -> list[str]:
    # The bucket must hold a whole GSO super-packet (64 KiB) and about a
    # millisecond of traffic, or the shaper itself becomes the bottleneck.
    burst = max(128 * 1024, int(_rate_bits(rate) / 8 / 1000))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hora.testing.emulate up [-n 3] [--link 1gbit] [--latency 0.1ms] [--sge] | sweep``.

    ``up`` starts a cluster, prints how to use it and keeps it up until
    Ctrl-C; ``sweep`` removes clusters left by dead processes.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hora.testing.emulate")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start a cluster and keep it up until Ctrl-C")
    up.add_argument("-n", "--hosts", type=int, default=3)
    up.add_argument("--link")
    up.add_argument("--latency")
    up.add_argument("--sge", action="store_true", help="also run Son of Grid Engine on the hosts (start_sge)")
    sub.add_parser("sweep", help="remove clusters whose owner died")
    args = parser.parse_args(argv)
    if args.action == "sweep":
        print("swept:", sweep_stale() or "nothing")
        return 0
    with EmulatedCluster(args.hosts, link=args.link, latency=args.latency) as cluster:
        for host in cluster.hosts:
            print(f"{host.name} {host.addr} netns {host.netns}")
        print(f"ssh config: {cluster.ssh_config}")
        print(f"run on h1:  nsenter --target {cluster.hosts[0].pid} --net --uts --mount -- bash")
        print(f"then:       hora run -H {cluster.hosts_spec(2)} --ssh-config-file {cluster.ssh_config} ...")
        if args.sge:
            env = cluster.start_sge()
            print(f"grid engine: export SGE_ROOT={env['SGE_ROOT']} SGE_CELL={env['SGE_CELL']} "
                  f"SGE_QMASTER_PORT={env['SGE_QMASTER_PORT']} SGE_EXECD_PORT={env['SGE_EXECD_PORT']}; "
                  "then on h1: qsub -pe hora N ... or hora run --launcher sge -np N ...")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
