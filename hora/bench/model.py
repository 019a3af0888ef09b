"""A cost model of one gradient exchange: ring-allreduce against a parameter server.

Every host has one full-duplex link of ``B`` bytes/s (the bit rate over 8)
and a one-way latency ``L`` per message; hosts are otherwise unbounded, and
the time of a phase in which many hosts talk at once is set by the busiest
link (the most bytes that one host sends, or receives).  Two CPU terms can be
calibrated on a host: ``R``, the bytes/s at which a core sums one buffer into
another (:func:`measure_reduce_rate`), and a fixed overhead per collective.

**Ring allreduce** of ``S`` bytes on ``N`` hosts (reduce-scatter, then
allgather; each has ``N-1`` steps that move ``S/N`` bytes to the next host)::

    T_ring = 2(N-1)/N * S/B  +  2(N-1) * L  +  (N-1)/N * S/R

Each process sends ``2(N-1)/N`` of the payload whatever ``N`` is, so the
bandwidth term stays flat as ``N`` grows; only the latency term is linear.

**Parameter server**, ``dist_sync`` push then pull of ``S`` bytes per worker,
split evenly over ``k`` servers on hosts of their own (each worker sends
``S/k`` to every server, each server receives ``N*S/k``)::

    T_push = T_pull = max(S, N*S/k) / B  +  2L
    T_ps   = 2 * max(S/B, N*S/(k*B))  +  4L  +  (N-1) * S/(k*R)

The ``4L`` are two round trips (push and its ack, the pull request and its
answer); the last term is the server summing ``N`` pushes.  With one server
the time grows linearly in ``N``; it stops falling at ``k = N``, where the
workers' own links bind.  With servers *colocated* on the first ``k`` worker
hosts (MXNet's ``launch.py`` default) a host's own share stays local, and the
bytes per link are counted host by host (:meth:`CostModel.ps_phase_bytes`).

**One machine's cores shared by every host** (an emulated cluster): the
kernel's and the processes' work of moving a byte from one host to another
is done by the same few cores whichever host sends it.  Calibrated once as
``M``, the bytes per second the whole machine can move across emulated
links when every core works on it (:func:`hora.bench.emulate.calibrate`),
the bytes that cross links in one operation (ring ``2(N-1)*S``, parameter
server ``2N*S`` with dedicated servers) take at least ``bytes/M``; link
and CPU work at the same time, so the busier of the two binds (a roofline)::

    T = max(link term, bytes/M) + latency + CPU summing + overhead

``M`` is infinite (no such term) on real clusters and in ``hora bench plan``.

**Scaling efficiency** of training with a compute time ``C`` per step and a
fraction ``f`` of the communication hidden behind the backward pass::

    exposed = max(0, T_comm - f*C),    efficiency = C / (C + exposed)

and throughput on ``N`` workers = ``N * batch / (C + exposed)``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import socket
import threading
import time
from collections.abc import Hashable, Sequence

from hora.bench.units import parse_duration, parse_rate
from hora.errors import ConfigError


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Estimate:
    """A predicted time and the terms it is made of, all in seconds.

    Attributes:
        bandwidth: bytes over the busiest link divided by the link rate.
        latency: per-message latency terms.
        cpu: reduction (summing) time and fixed per-operation overhead.
        shared: bytes over all links divided by the machine's rate ``M``, when
            every host shares one machine's cores (0 otherwise); it runs at
            the same time as the transfers, so only the larger of the two counts.
    """

    bandwidth: float
    latency: float
    cpu: float
    shared: float = 0.0

    @property
    def total(self) -> float:
        """The predicted time: ``max(bandwidth, shared) + latency + cpu``."""
        return max(self.bandwidth, self.shared) + self.latency + self.cpu

    @property
    def bound(self) -> str:
        """``"link"`` or ``"cpu"``: which of the two concurrent terms sets the time."""
        return "cpu" if self.shared > self.bandwidth else "link"


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CostModel:
    """Link and host parameters; every prediction of :mod:`hora.bench` comes from here.

    Attributes:
        bandwidth_bps: link rate in bits per second (``parse_rate("25gbit")``).
        latency_s: one-way latency of one message in seconds.
        reduce_bytes_per_s: bytes per second a core sums one float32 buffer
            into another; ``inf`` leaves the CPU out.
        overhead_s: fixed software cost of one collective or push+pull.
        machine_bytes_per_s: bytes per second one machine moves across links
            when all hosts share its cores (an emulated cluster); ``inf``
            when every host has cores of its own.
    """

    bandwidth_bps: float
    latency_s: float = 0.0
    reduce_bytes_per_s: float = math.inf
    overhead_s: float = 0.0
    machine_bytes_per_s: float = math.inf

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0 or math.isinf(self.bandwidth_bps):
            raise ConfigError(f"link bandwidth {self.bandwidth_bps!r} bit/s must be positive and finite")
        if not self.latency_s >= 0:
            raise ConfigError(f"latency {self.latency_s!r} s must be >= 0")
        if not self.reduce_bytes_per_s > 0:
            raise ConfigError(f"reduction rate {self.reduce_bytes_per_s!r} B/s must be positive")
        if not self.overhead_s >= 0:
            raise ConfigError(f"overhead {self.overhead_s!r} s must be >= 0")
        if not self.machine_bytes_per_s > 0:
            raise ConfigError(f"machine transfer rate {self.machine_bytes_per_s!r} B/s must be positive")

    @classmethod
    def from_strings(cls, link: str, latency: str = "0", **kwargs: float) -> CostModel:
        """Build a model from ``tc``-style strings: ``CostModel.from_strings("10gbit", "0.1ms")``."""
        return cls(bandwidth_bps=parse_rate(link), latency_s=parse_duration(latency), **kwargs)

    @property
    def bytes_per_s(self) -> float:
        """The link rate in bytes per second."""
        return self.bandwidth_bps / 8.0

    # --- ring allreduce -------------------------------------------------------------
    def ring_allreduce(self, nbytes: float, workers: int) -> Estimate:
        """``T_ring = 2(N-1)/N * S/B + 2(N-1)L + (N-1)/N * S/R`` (zero for one worker)."""
        _check(nbytes, workers)
        if workers == 1:
            return Estimate(bandwidth=0.0, latency=0.0, cpu=0.0)
        n = workers
        share = (n - 1) / n * nbytes
        return Estimate(bandwidth=2 * share / self.bytes_per_s, latency=2 * (n - 1) * self.latency_s,
                        cpu=share / self.reduce_bytes_per_s + self.overhead_s,
                        shared=2 * n * share / self.machine_bytes_per_s)

    # --- parameter server -----------------------------------------------------------
    @staticmethod
    def ps_phase_bytes(nbytes: float, workers: int, servers: int, colocated: bool = False) -> float:
        """Bytes over the busiest link in one phase (push, or pull) of a ``dist_sync`` round.

        Dedicated server hosts: ``max(S, N*S/k)``.  Colocated (server ``j`` on
        worker host ``j``, ``k <= N``): a server host sends ``S*(k-1)/k`` and
        receives ``(N-1)*S/k``; a worker-only host sends ``S``.
        """
        _check(nbytes, workers)
        if servers < 1:
            raise ConfigError(f"a parameter server needs at least 1 server, got {servers}")
        n, k, s = workers, servers, float(nbytes)
        if not colocated:
            return max(s, n * s / k)
        if k > n:
            raise ConfigError(f"colocated servers: {k} servers do not fit on {n} worker hosts")
        server_host = max(s * (k - 1) / k, (n - 1) * s / k)
        return server_host if k == n else max(server_host, s)

    def ps_push_pull(self, nbytes: float, workers: int, servers: int, colocated: bool = False) -> Estimate:
        """``T_ps = 2 * max(S/B, N*S/(k*B)) + 4L + (N-1)*S/(k*R)`` (dedicated servers; see the module doc)."""
        phase = self.ps_phase_bytes(nbytes, workers, servers, colocated)
        merge = (workers - 1) * nbytes / servers / self.reduce_bytes_per_s
        # colocated: each of the k server hosts keeps its worker's S/k share off the links
        crossing = (workers - 1 if colocated else workers) * nbytes
        return Estimate(bandwidth=2 * phase / self.bytes_per_s, latency=4 * self.latency_s,
                        cpu=merge + self.overhead_s, shared=2 * crossing / self.machine_bytes_per_s)

    @staticmethod
    def ps_phase_bytes_placed(nbytes: float, worker_hosts: Sequence[Hashable],
                              server_hosts: Sequence[Hashable]) -> float:
        """Bytes over the busiest link in one phase, for workers and servers placed on named hosts.

        Each worker sends ``S/k`` to every server (the pull is the same
        traffic reversed); bytes between two processes of one host cross no
        link.  The busiest link is the largest per-host total sent or received.
        This covers dedicated and colocated servers, and any mix of them.
        """
        if not worker_hosts or not server_hosts:
            raise ConfigError("a placement needs at least one worker and one server")
        share = nbytes / len(server_hosts)
        sent: collections.Counter[Hashable] = collections.Counter()
        received: collections.Counter[Hashable] = collections.Counter()
        for w in worker_hosts:
            for s in server_hosts:
                if w != s:
                    sent[w] += share
                    received[s] += share
        return max([0.0, *sent.values(), *received.values()])

    def ps_push_pull_placed(self, nbytes: float, worker_hosts: Sequence[Hashable],
                            server_hosts: Sequence[Hashable]) -> Estimate:
        """:meth:`ps_push_pull` for an explicit placement (see :meth:`ps_phase_bytes_placed`)."""
        phase = self.ps_phase_bytes_placed(nbytes, worker_hosts, server_hosts)
        merge = (len(worker_hosts) - 1) * nbytes / len(server_hosts) / self.reduce_bytes_per_s
        share = nbytes / len(server_hosts)
        crossing = sum(share for w in worker_hosts for s in server_hosts if w != s)
        return Estimate(bandwidth=2 * phase / self.bytes_per_s, latency=4 * self.latency_s,
                        cpu=merge + self.overhead_s, shared=2 * crossing / self.machine_bytes_per_s)

    def servers_to_match_ring(self, nbytes: float, workers: int, tolerance: float = 1.1,
                              colocated: bool = False, max_servers: int | None = None) -> int | None:
        """The fewest servers whose push+pull is within ``tolerance`` x the ring's time, or None."""
        ring = self.ring_allreduce(nbytes, workers).total
        limit = max_servers or (workers if colocated else 4 * workers)
        for k in range(1, limit + 1):
            if self.ps_push_pull(nbytes, workers, k, colocated).total <= tolerance * ring:
                return k
        return None

    # --- training ------------------------------------------------------------------
    @staticmethod
    def scaling_efficiency(compute_s: float, comm_s: float, overlap: float = 0.0) -> float:
        """``C / (C + max(0, T_comm - f*C))``: the share of ideal linear speed-up that is kept."""
        if compute_s <= 0:
            raise ConfigError(f"compute time per step {compute_s!r} s must be positive")
        if not 0.0 <= overlap <= 1.0:
            raise ConfigError(f"overlap {overlap!r} must be a fraction in [0, 1]")
        exposed = max(0.0, comm_s - overlap * compute_s)
        return compute_s / (compute_s + exposed)

    @staticmethod
    def throughput(batch: int, workers: int, compute_s: float, comm_s: float, overlap: float = 0.0) -> float:
        """Samples per second of ``workers`` ranks that each step ``batch`` samples."""
        exposed = max(0.0, comm_s - overlap * compute_s)
        return workers * batch / (compute_s + exposed)


def bus_bandwidth(algbw: float, workers: int) -> float:
    """NCCL-tests' bus bandwidth of an allreduce: ``algbw * 2(n-1)/n``.

    It is comparable with the link rate whatever ``n`` is: a ring moves
    ``2(n-1)/n`` of the payload over each link.
    """
    return algbw * 2 * (workers - 1) / workers if workers > 1 else 0.0


def _check(nbytes: float, workers: int) -> None:
    if nbytes < 0:
        raise ConfigError(f"payload {nbytes!r} bytes must be >= 0")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"the number of workers must be an integer >= 1, got {workers!r}")


# --------------------------------------------------------------------------- calibration


def measure_reduce_rate(nbytes: int = 16 << 20, repeats: int = 5) -> float:
    """Bytes per second this host's CPU sums one float32 buffer into another (best of ``repeats``).

    numpy's ``add(a, b, out=a)`` is what a CPU backend does per step of a
    ring; the rate counts the bytes of one operand.
    """
    import numpy as np

    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def measure_loopback_rate(nbytes: int = 64 << 20, chunk: int = 1 << 20, timeout_s: float = 30.0) -> float:
    """Bits per second of one TCP stream over 127.0.0.1: the "link" of a localhost run.

    On one host the ranks share its memory and cores, so this is an upper
    bound for what one rank can push to another, not a network figure.

    Raises:
        ConfigError: the transfer did not finish within ``timeout_s``.
    """
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(timeout_s)
    received = [0]

    def sink() -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            buf = bytearray(chunk)
            while received[0] < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                received[0] += n

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    payload = bytes(chunk)
    try:
        with socket.create_connection(server.getsockname(), timeout=timeout_s) as client:
            t0 = time.perf_counter()
            sent = 0
            while sent < nbytes:
                client.sendall(payload)
                sent += chunk
            thread.join(timeout_s)
            elapsed = time.perf_counter() - t0
    finally:
        server.close()
    if received[0] < nbytes:
        raise ConfigError(f"loopback calibration moved {received[0]} of {nbytes} bytes in {timeout_s} s")
    return nbytes * 8 / elapsed


def measure_loopback_latency(rounds: int = 200, timeout_s: float = 10.0) -> float:
    """One-way latency in seconds of a 1-byte TCP message over 127.0.0.1 (half the median round trip)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(timeout_s)

    def echo() -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds):
                if not conn.recv(1):
                    return
                conn.sendall(b"x")

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    trips = []
    try:
        with socket.create_connection(server.getsockname(), timeout=timeout_s) as client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds):
                t0 = time.perf_counter()
                client.sendall(b"x")
                if not client.recv(1):
                    break
                trips.append(time.perf_counter() - t0)
        thread.join(timeout_s)
    finally:
        server.close()
    if not trips:
        raise ConfigError("loopback latency calibration got no answer")
    trips.sort()
    return trips[len(trips) // 2] / 2
