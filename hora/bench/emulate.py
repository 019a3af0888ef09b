"""``--emulate-hosts N --link 1gbit [--latency 0.1ms]``: run a benchmark on an emulated cluster.

The emulation is :mod:`hora.testing.emulate`: one Linux network namespace per
host on a bridge, each host's link shaped both ways with ``tc``, sshd on
every host.  :func:`emulated_hosts` is the only place ``hora bench`` touches
it: it starts ``N`` hosts, yields a :class:`Placement` (the ``-H`` list, the
cluster's ssh config for ``hora run``, and the ``nsenter`` prefix that starts
the launcher on the first host), and tears the cluster down afterwards.  The
launcher then reaches the other hosts over ssh, as on a real cluster, so
every rank and every server talks over a shaped link.  Workers take the
first hosts, one rank each; servers go on the hosts beyond them
(``hora run --server-hosts``), so ``W`` workers and ``k`` servers on hosts of
their own need ``--emulate-hosts W+k`` (the scheduler shares rank 0's host).
Before the first job, :func:`calibrate` measures what the cluster's links
and shared cores deliver, for the cost model.  Where the emulation cannot
run (no root, no ``ip netns``), asking for it raises
:class:`hora.errors.UnsupportedError` with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator

from hora.bench.units import MiB, fmt_rate, parse_duration, parse_rate
from hora.errors import ConfigError, HoraError, UnsupportedError
from hora.testing.emulate import EmulatedCluster

#: Port the calibration streams listen on (each emulated host has a network namespace of its own).
CALIBRATION_PORT = 5201
#: Most stream pairs the machine-rate calibration runs at once.
CALIBRATION_PAIRS = 4


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class LinkCalibration:
    """What one emulated cluster's links and machine really deliver, measured once when it starts.

    Attributes:
        goodput_bps: payload bits per second of one TCP stream over one shaped
            link (below the link rate by the TCP/IP and Ethernet headers).
        machine_bytes_per_s: payload bytes per second the machine moved with
            ``pairs`` streams at once over unshaped links, every core busy:
            how fast the shared cores can move bytes between hosts at all.
        pairs: concurrent streams of that measurement.
    """

    goodput_bps: float
    machine_bytes_per_s: float
    pairs: int

    def describe(self) -> str:
        """``TCP goodput 0.94 Gbit/s per link; the machine moves 1.1 GB/s between hosts``."""
        return (f"TCP goodput {fmt_rate(self.goodput_bps)} per link; the machine moves "
                f"{self.machine_bytes_per_s / 1e9:.3g} GB/s between hosts ({self.pairs} unshaped streams)")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Placement:
    """Where the jobs of a benchmark run: ``-H`` hosts, extra ``hora run`` flags, and a command prefix.

    On localhost or real hosts only ``hosts`` may be set; on an emulated
    cluster ``prefix`` starts ``hora run`` inside the first host,
    ``run_args`` give it the cluster's ssh config, ``names`` are the
    hosts, in order (see :meth:`for_job`), and ``calibration`` what its
    links deliver.
    """

    hosts: str | None = None
    run_args: tuple[str, ...] = ()
    prefix: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    calibration: LinkCalibration | None = None

    def for_job(self, num_proc: int, num_servers: int = 0) -> tuple[str | None, tuple[str, ...]]:
        """The ``-H`` value and the ``--server-hosts`` of one job.

        On an emulated cluster (``names`` set) the workers take the first
        ``num_proc`` hosts, one each, and the servers go round-robin over the
        hosts beyond them, so no worker shares a server's link; with no host
        to spare they share the workers' hosts (``hora run``'s default).
        Elsewhere ``hosts`` is passed through and the launcher places the servers.

        Raises:
            ConfigError: the emulated cluster has fewer hosts than ``num_proc``.
        """
        if not self.names:
            return self.hosts, ()
        if num_proc > len(self.names):
            raise ConfigError(f"-np {num_proc} needs one emulated host per rank: raise --emulate-hosts "
                              f"{len(self.names)} to at least {num_proc}")
        hosts = ",".join(f"{name}:1" for name in self.names[:num_proc])
        return hosts, (self.names[num_proc:] if num_servers else ())


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Emulation:
    """An emulated cluster: ``hosts`` namespace hosts, each on a link of ``link`` (tc units) with ``latency``."""

    hosts: int
    link: str
    latency: str | None = None

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise ConfigError(f"--emulate-hosts {self.hosts} must be >= 1")
        parse_rate(self.link)
        if self.latency is not None:
            parse_duration(self.latency)

    @classmethod
    def from_args(cls, hosts: int | None, link: str | None, latency: str | None) -> Emulation | None:
        """The emulation the flags ask for, or None without ``--emulate-hosts``.

        Raises:
            ConfigError: ``--emulate-hosts`` without ``--link``, or a bad value.
        """
        if hosts is None:
            return None
        if link is None or link == "auto":
            raise ConfigError("--emulate-hosts needs the emulated link's rate: add --link 1gbit (or 10gbit, ...)")
        return cls(hosts=hosts, link=link, latency=latency)

    @property
    def link_bps(self) -> float:
        """The link rate in bits per second."""
        return parse_rate(self.link)

    @property
    def latency_s(self) -> float:
        """The one-way latency in seconds (0 when none is added)."""
        return parse_duration(self.latency) if self.latency is not None else 0.0

    def describe(self) -> str:
        """``8 emulated hosts, 1 Gbit/s links, 0.1 ms latency``."""
        return f"{self.hosts} emulated hosts, {fmt_rate(self.link_bps)} links, {self.latency_s * 1e3:g} ms latency"


@contextlib.contextmanager
def emulated_hosts(emulation: Emulation, calibrate_links: bool = True) -> Iterator[Placement]:
    """Start the emulated cluster; yield where jobs run on it; tear it down after.

    With ``calibrate_links`` (and two hosts or more) the links are measured
    first (:func:`calibrate`), for the cost model.

    Raises:
        UnsupportedError: the cluster cannot run here (no root, no ``ip netns``, no sshd).
    """
    try:
        cluster = EmulatedCluster(emulation.hosts, link=emulation.link, latency=emulation.latency)
        cluster.start()
    except HoraError as e:
        if isinstance(e, ConfigError):
            raise
        raise UnsupportedError(f"cannot start {emulation.describe()}: {e}") from e
    try:
        first = cluster.hosts[0].name
        calibration = calibrate(cluster, emulation) if calibrate_links and emulation.hosts > 1 else None
        yield Placement(hosts=cluster.hosts_spec(1), run_args=("--ssh-config-file", cluster.ssh_config),
                        prefix=tuple(cluster.command(first, [])), names=tuple(h.name for h in cluster.hosts),
                        calibration=calibration)
    finally:
        cluster.close()


def calibrate(cluster: EmulatedCluster, emulation: Emulation, timeout_s: float = 60.0) -> LinkCalibration:
    """Measure a started cluster: one stream's goodput over a shaped link, then the machine's rate unshaped.

    The goodput stream runs from the first host to the second and carries
    half a second of the link's rate (8 to 256 MiB).  For the machine's
    rate the links are unshaped for a moment and up to
    :data:`CALIBRATION_PAIRS` pairs of hosts stream 256 MiB each at once;
    the rate is their bytes over the slowest stream's time.  The shaping is
    put back whatever happens.  Any other load on the machine lowers the
    second figure, as it slows the benchmark's jobs.

    Raises:
        UnsupportedError: a stream failed or timed out.
    """
    hosts = [(h.name, h.addr) for h in cluster.hosts]
    nbytes = int(min(256 * MiB, max(8 * MiB, emulation.link_bps / 8 * 0.5)))
    goodput = _streams(cluster, [(hosts[0], hosts[1])], nbytes, timeout_s)
    pairs = [(hosts[2 * i], hosts[2 * i + 1]) for i in range(min(CALIBRATION_PAIRS, len(hosts) // 2))]
    cluster.shape(None, None)
    try:
        machine = _streams(cluster, pairs, 256 * MiB, timeout_s)
    finally:
        cluster.shape(emulation.link, emulation.latency)
    return LinkCalibration(goodput_bps=goodput * 8, machine_bytes_per_s=machine, pairs=len(pairs))


def _streams(cluster: EmulatedCluster, pairs: list[tuple[tuple[str, str], tuple[str, str]]], nbytes: int,
             timeout_s: float) -> float:
    """Bytes per second of ``pairs`` (sender, receiver) streams of ``nbytes`` each, run at once."""
    from hora.bench.jobs import job_env

    env = job_env()
    module = [sys.executable, "-m", "hora.bench.workers.stream"]
    procs: list[subprocess.Popen] = []
    try:
        receivers = []
        for _, (name, addr) in pairs:
            proc = cluster.popen(name, [*module, "recv", f"{addr}:{CALIBRATION_PORT}", str(nbytes), "--timeout",
                                        str(timeout_s)], env=env, stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            receivers.append(proc)
            if proc.stdout is None or proc.stdout.readline().strip() != "ready":
                raise UnsupportedError(f"the calibration stream's receiver on {name} did not start")
        for (name, _), (_, addr) in pairs:
            procs.append(cluster.popen(name, [*module, "send", f"{addr}:{CALIBRATION_PORT}", str(nbytes),
                                              "--timeout", str(timeout_s)], env=env))
        deadline = time.monotonic() + timeout_s
        results = []
        for proc in receivers:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(json.loads(out.strip().splitlines()[-1]))
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as e:
        raise UnsupportedError(f"calibrating the emulated links failed: {e}") from e
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(r["bytes"] < nbytes or r["seconds"] <= 0 for r in results):
        raise UnsupportedError(f"calibrating the emulated links: a stream moved only {results}")
    return sum(r["bytes"] for r in results) / max(r["seconds"] for r in results)
