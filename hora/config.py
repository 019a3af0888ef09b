"""Every knob hora has, read in one place.

Knobs are filled once, in this order of precedence: explicit arguments (the
launcher's CLI flags end up here as environment variables of the workers),
then environment variables, then defaults.  Each knob has a ``HORA_*`` name
and, where Horovod had one, the ``HOROVOD_*`` name is accepted too so existing
job scripts keep their tuning.

The variable names are constants of :mod:`hora.envvars`, which the launcher
uses too; nothing else in hora reads ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from hora import envvars
from hora.errors import ConfigError

MiB = 1024 * 1024

def _lookup(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name)
        if value is not None and value != "":
            return value
    return None


def _as_float(env: Mapping[str, str], names: tuple[str, ...], default: float) -> float:
    raw = _lookup(env, *names)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{names[0]}={raw!r} is not a number") from None


def _as_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    raw = _lookup(env, *names)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{names[0]}={raw!r} is not an integer") from None


def _as_bool(env: Mapping[str, str], names: tuple[str, ...], default: bool) -> bool:
    raw = _lookup(env, *names)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{names[0]}={raw!r} is not a boolean (use 1 or 0)")


@dataclasses.dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Knobs of the collective engine.

    Attributes:
        controller: ``"auto"``, ``"mpi"`` or ``"gloo"``: which CPU backend runs
            negotiation and CPU collectives.  ``auto`` picks MPI when the job
            was started by mpirun, gloo otherwise.
        fusion_threshold_bytes: largest fused buffer; 0 disables fusion.
        cycle_time_ms: how long a rank waits before re-negotiating after a
            round in which nothing was ready on every rank.
        direct_threshold_bytes: tensors at least this large skip the fusion
            buffer and are reduced in place (no copy); ``None`` lets the
            backend choose.
        cache_capacity: negotiated tensor names remembered as integer ids.
        stall_check_seconds: warn about tensors that some ranks submitted and
            others did not after this long; 0 disables the check.
        stall_shutdown_seconds: after this long, every rank raises
            :class:`hora.errors.StallError` instead of waiting; 0 waits forever.
        start_timeout_seconds: how long rendezvous may take at ``init()``.
        timeline_filename: write a Chrome trace of engine activity here
            (:mod:`hora.core.timeline`; rank 0 only unless ``timeline_all_ranks``).
        timeline_mark_cycles: add a ``CYCLE_START`` instant per engine round.
        timeline_max_mb: size cap of the timeline file in MiB; 0: none.
        timeline_rotate: at the cap, continue in a new file instead of stopping.
        timeline_all_ranks: every rank writes its own file beside rank 0's
            (``<stem>.rank<r><suffix>``).
        timeline_queue: records the timeline's queue holds before dropping new ones.
        autotune: tune fusion threshold, cycle time, direct threshold and
            overlap while the job runs (:mod:`hora.core.autotune`).
        autotune_log_file: CSV of every autotune trial (rank 0).
        autotune_warmup_samples: samples discarded before the first trial (the step after each change of
            settings is discarded too).
        autotune_steps_per_sample: training steps in one scored sample.
        autotune_max_samples: trials before autotune settles on the best.
        autotune_space: the candidates, when not the default grid (see
            :func:`hora.core.autotune.parse_space`).
        mpi_threads: ask MPI for MPI_THREAD_MULTIPLE.
        overlap: run asynchronous collectives on the engine thread as soon as
            they are submitted, overlapping them with computation.  ``None``
            (auto) overlaps only when each local rank has at least two CPU
            cores: with one core per rank, communicating during backward only
            makes the two threads fight for the core, and it is faster to
            reduce everything when ``step()`` waits for it.
        malloc_tuning: fix glibc malloc's mmap and trim thresholds at
            ``init()`` so that tensors freed and reallocated every step reuse
            heap memory instead of faulting in fresh pages (see
            :mod:`hora.core.allocator`); ``HORA_MALLOC_TUNING=0`` leaves them.
    """

    controller: str = "auto"
    fusion_threshold_bytes: int = 64 * MiB
    cycle_time_ms: float = 1.0
    direct_threshold_bytes: int | None = None
    cache_capacity: int = 1024
    stall_check_seconds: float = 60.0
    stall_shutdown_seconds: float = 0.0
    start_timeout_seconds: float = 30.0
    timeline_filename: str | None = None
    timeline_mark_cycles: bool = False
    timeline_max_mb: float = 0.0
    timeline_rotate: bool = False
    timeline_all_ranks: bool = False
    timeline_queue: int = 1 << 16
    autotune: bool = False
    autotune_log_file: str | None = None
    autotune_warmup_samples: int = 1
    autotune_steps_per_sample: int = 10
    autotune_max_samples: int = 20
    autotune_space: str | None = None
    mpi_threads: bool = True
    overlap: bool | None = None
    malloc_tuning: bool = True

    def __post_init__(self) -> None:
        if self.controller not in ("auto", "mpi", "gloo"):
            raise ConfigError(
                f"controller={self.controller!r} is not one of 'auto', 'mpi', 'gloo' "
                "(set HORA_CONTROLLER or pass --gloo/--mpi to hora run)"
            )
        if self.fusion_threshold_bytes < 0:
            raise ConfigError(f"fusion threshold {self.fusion_threshold_bytes} bytes must be >= 0")
        if self.cycle_time_ms < 0:
            raise ConfigError(f"cycle time {self.cycle_time_ms} ms must be >= 0")
        if self.cache_capacity < 0:
            raise ConfigError(f"cache capacity {self.cache_capacity} must be >= 0")
        if self.timeline_max_mb < 0 or self.timeline_queue < 1:
            raise ConfigError(f"HORA_TIMELINE_MAX_MB={self.timeline_max_mb} must be >= 0 and HORA_TIMELINE_QUEUE="
                              f"{self.timeline_queue} >= 1")
        if self.autotune_warmup_samples < 0 or self.autotune_steps_per_sample < 1 or self.autotune_max_samples < 1:
            raise ConfigError(
                f"autotune needs HORA_AUTOTUNE_WARMUP_SAMPLES >= 0 (got {self.autotune_warmup_samples}), "
                f"HORA_AUTOTUNE_STEPS_PER_SAMPLE >= 1 (got {self.autotune_steps_per_sample}) and "
                f"HORA_AUTOTUNE_MAX_SAMPLES >= 1 (got {self.autotune_max_samples})")
        if self.stall_shutdown_seconds and self.stall_check_seconds and (
            self.stall_shutdown_seconds < self.stall_check_seconds
        ):
            raise ConfigError(
                f"stall shutdown time ({self.stall_shutdown_seconds} s) must not be shorter than "
                f"the stall warning time ({self.stall_check_seconds} s)"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> EngineConfig:
        """Build the config from environment variables, then explicit overrides."""
        env = os.environ if env is None else env
        fusion_mb = _lookup(env, envvars.HORA_FUSION_THRESHOLD_MB)
        fusion = (
            int(float(fusion_mb) * MiB)
            if fusion_mb is not None
            else _as_int(env, (envvars.HORA_FUSION_THRESHOLD, envvars.HOROVOD_FUSION_THRESHOLD), 64 * MiB)
        )
        direct = _lookup(env, envvars.HORA_DIRECT_THRESHOLD)
        values: dict[str, Any] = dict(
            controller=(_lookup(env, envvars.HORA_CONTROLLER, envvars.HOROVOD_CONTROLLER) or "auto").lower(),
            fusion_threshold_bytes=fusion,
            cycle_time_ms=_as_float(env, (envvars.HORA_CYCLE_TIME, envvars.HOROVOD_CYCLE_TIME), 1.0),
            direct_threshold_bytes=int(direct) if direct is not None else None,
            cache_capacity=_as_int(env, (envvars.HORA_CACHE_CAPACITY, envvars.HOROVOD_CACHE_CAPACITY), 1024),
            stall_check_seconds=(
                0.0
                if _as_bool(env, (envvars.HORA_STALL_CHECK_DISABLE, envvars.HOROVOD_STALL_CHECK_DISABLE), False)
                else _as_float(
                    env, (envvars.HORA_STALL_CHECK_TIME_SECONDS, envvars.HOROVOD_STALL_CHECK_TIME_SECONDS), 60.0
                )
            ),
            stall_shutdown_seconds=_as_float(
                env, (envvars.HORA_STALL_SHUTDOWN_TIME_SECONDS, envvars.HOROVOD_STALL_SHUTDOWN_TIME_SECONDS), 0.0
            ),
            start_timeout_seconds=_as_float(
                env, (envvars.HORA_START_TIMEOUT, envvars.HOROVOD_GLOO_TIMEOUT_SECONDS), 30.0
            ),
            timeline_filename=_lookup(env, envvars.HORA_TIMELINE, envvars.HOROVOD_TIMELINE),
            timeline_mark_cycles=_as_bool(
                env, (envvars.HORA_TIMELINE_MARK_CYCLES, envvars.HOROVOD_TIMELINE_MARK_CYCLES), False),
            timeline_max_mb=_as_float(env, (envvars.HORA_TIMELINE_MAX_MB,), 0.0),
            timeline_rotate=_as_bool(env, (envvars.HORA_TIMELINE_ROTATE,), False),
            timeline_all_ranks=_as_bool(env, (envvars.HORA_TIMELINE_ALL_RANKS,), False),
            timeline_queue=_as_int(env, (envvars.HORA_TIMELINE_QUEUE,), 1 << 16),
            autotune=_as_bool(env, (envvars.HORA_AUTOTUNE, envvars.HOROVOD_AUTOTUNE), False),
            autotune_log_file=_lookup(env, envvars.HORA_AUTOTUNE_LOG, envvars.HOROVOD_AUTOTUNE_LOG),
            autotune_warmup_samples=_as_int(
                env, (envvars.HORA_AUTOTUNE_WARMUP_SAMPLES, envvars.HOROVOD_AUTOTUNE_WARMUP_SAMPLES), 1),
            autotune_steps_per_sample=_as_int(
                env, (envvars.HORA_AUTOTUNE_STEPS_PER_SAMPLE, envvars.HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE), 10),
            autotune_max_samples=_as_int(
                env, (envvars.HORA_AUTOTUNE_MAX_SAMPLES, envvars.HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES), 20),
            autotune_space=_lookup(env, envvars.HORA_AUTOTUNE_SPACE),
            mpi_threads=not _as_bool(
                env, (envvars.HORA_MPI_THREADS_DISABLE, envvars.HOROVOD_MPI_THREADS_DISABLE), False
            ),
            overlap=None if (_lookup(env, envvars.HORA_OVERLAP) or "auto") == "auto" else _as_bool(
                env, (envvars.HORA_OVERLAP,), True),
            malloc_tuning=_as_bool(env, (envvars.HORA_MALLOC_TUNING,), True),
        )
        values.update(overrides)
        return cls(**values)


def environ() -> Mapping[str, str]:
    """The process environment, as a read-only snapshot for topology detection."""
    return dict(os.environ)


@dataclasses.dataclass(kw_only=True, slots=True)
class RendezvousConfig:
    """Where the ranks of a gloo job meet, and which network they use.

    ``hora run`` sets ``HORA_RENDEZVOUS_ADDR``/``PORT`` and rank 0 hosts the
    store there; under torchrun the agent already hosts one at
    ``MASTER_ADDR``/``MASTER_PORT``, so every rank connects as a client.

    ``interface`` may name several interfaces separated by commas, as
    ``GLOO_SOCKET_IFNAME`` does.  ``gloo_devices`` is how many gloo devices
    (each its own TCP connection to every peer and its own I/O thread) hora
    opens per interface: gloo spreads concurrent collectives over them, which
    is how a round's allreduces in flight together get more than one
    connection's throughput (``HORA_GLOO_DEVICES``, default 4).
    """

    addr: str | None = None
    port: int | None = None
    host_store: bool = True  # rank 0 hosts the store (False under torchrun's agent store)
    interface: str | None = None
    secret: str | None = None
    gloo_devices: int = 4

    def __post_init__(self) -> None:
        if self.gloo_devices < 1:
            raise ConfigError(f"HORA_GLOO_DEVICES={self.gloo_devices} must be at least 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RendezvousConfig:
        env = os.environ if env is None else env
        addr = _lookup(env, envvars.HORA_RENDEZVOUS_ADDR)
        port = _lookup(env, envvars.HORA_RENDEZVOUS_PORT)
        host_store = True
        if addr is None and _lookup(env, envvars.MASTER_ADDR) is not None:
            addr, port = env[envvars.MASTER_ADDR], _lookup(env, envvars.MASTER_PORT)
            host_store = (_lookup(env, envvars.TORCHELASTIC_USE_AGENT_STORE) or "").lower() != "true"
        if port is not None and not port.isdigit():
            raise ConfigError(f"rendezvous port {port!r} is not a number")
        return cls(
            addr=addr,
            port=int(port) if port is not None else None,
            host_store=host_store,
            interface=_lookup(
                env, envvars.HORA_NETWORK_INTERFACE, envvars.GLOO_SOCKET_IFNAME, envvars.HOROVOD_GLOO_IFACE
            ),
            secret=_lookup(env, envvars.HORA_SECRET),
            gloo_devices=_as_int(env, (envvars.HORA_GLOO_DEVICES,), 4),
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class ElasticConfig:
    """A worker's view of an elastic job (``hora run`` with an elastic driver).

    Attributes:
        driver_addr: where the driver listens (``HORA_ELASTIC_DRIVER_ADDR``);
            None outside elastic jobs.
        driver_port: its port (``HORA_ELASTIC_DRIVER_PORT``).
        worker_id: the driver's name for this process (``HORA_ELASTIC_WORKER_ID``).
        secret: the job secret authenticating every message (``HORA_SECRET``).
        timeout_s: how long ``init()`` waits for the driver to form the next
            round (``HORA_ELASTIC_TIMEOUT``, ``HOROVOD_ELASTIC_TIMEOUT``, default 600).
        collective_timeout_s: gloo's per-collective timeout in elastic jobs
            (``HORA_ELASTIC_COLLECTIVE_TIMEOUT``, default 60): a peer that
            vanished without closing its connections is given up after this long.
            A peer that dies is noticed at once, from its closed connections.
    """

    driver_addr: str | None = None
    driver_port: int | None = None
    worker_id: str | None = None
    secret: str | None = None
    timeout_s: float = 600.0
    collective_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ConfigError(f"HORA_ELASTIC_TIMEOUT={self.timeout_s} and HORA_ELASTIC_COLLECTIVE_TIMEOUT="
                              f"{self.collective_timeout_s} must be > 0 seconds")
        if self.driver_addr is not None and (self.driver_port is None or not self.worker_id):
            raise ConfigError("an elastic worker needs HORA_ELASTIC_DRIVER_PORT and HORA_ELASTIC_WORKER_ID beside "
                              "HORA_ELASTIC_DRIVER_ADDR; start elastic jobs with hora run")

    @property
    def enabled(self) -> bool:
        """Whether this process is a worker of an elastic job."""
        return self.driver_addr is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ElasticConfig:
        """Build the config from the environment the elastic driver set."""
        env = os.environ if env is None else env
        port = _lookup(env, envvars.HORA_ELASTIC_DRIVER_PORT)
        if port is not None and not port.isdigit():
            raise ConfigError(f"{envvars.HORA_ELASTIC_DRIVER_PORT}={port!r} is not a port number")
        return cls(
            driver_addr=_lookup(env, envvars.HORA_ELASTIC_DRIVER_ADDR),
            driver_port=int(port) if port is not None else None,
            worker_id=_lookup(env, envvars.HORA_ELASTIC_WORKER_ID),
            secret=_lookup(env, envvars.HORA_SECRET),
            timeout_s=_as_float(env, (envvars.HORA_ELASTIC_TIMEOUT, envvars.HOROVOD_ELASTIC_TIMEOUT), 600.0),
            collective_timeout_s=_as_float(env, (envvars.HORA_ELASTIC_COLLECTIVE_TIMEOUT,), 60.0),
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class RunDefaults:
    """The flags of ``hora run`` that fall back on the environment it runs in, as MXNet's and Horovod's launchers do.

    Attributes:
        num_servers: ``-s``, else ``DMLC_NUM_SERVER``, else 0.
        network_interface: ``--network-interface``, else ``DMLC_INTERFACE``, else None.
        elastic_timeout: ``--elastic-timeout``, else ``HORA_ELASTIC_TIMEOUT`` or
            ``HOROVOD_ELASTIC_TIMEOUT``, else 600 seconds.
    """

    num_servers: int = 0
    network_interface: str | None = None
    elastic_timeout: float = 600.0

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        num_servers: int | None = None,
        network_interface: str | None = None,
        elastic_timeout: float | None = None,
    ) -> RunDefaults:
        """Fill each field from its flag when given (not None), else from ``env`` (default: the process's).

        Raises:
            ConfigError: a variable the flag falls back on has a malformed value.
        """
        env = os.environ if env is None else env
        if num_servers is None:
            raw = _lookup(env, envvars.DMLC_NUM_SERVER) or "0"
            if not raw.isdigit():
                raise ConfigError(f"{envvars.DMLC_NUM_SERVER}={raw!r} is not a number of servers")
            num_servers = int(raw)
        if elastic_timeout is None:
            raw = _lookup(env, envvars.HORA_ELASTIC_TIMEOUT, envvars.HOROVOD_ELASTIC_TIMEOUT)
            try:
                elastic_timeout = float(raw) if raw else 600.0
            except ValueError:
                raise ConfigError(f"{envvars.HOROVOD_ELASTIC_TIMEOUT}={raw!r} is not a number of seconds") from None
        return cls(
            num_servers=num_servers,
            network_interface=network_interface or _lookup(env, envvars.DMLC_INTERFACE),
            elastic_timeout=elastic_timeout,
        )


def interface_names(value: str) -> list[str]:
    """The interfaces of a comma-separated list (``eth0,eth1``), as ``GLOO_SOCKET_IFNAME`` takes them."""
    return [name.strip() for name in value.split(",") if name.strip()]


PS_ROLES = ("worker", "server", "scheduler")


@dataclasses.dataclass(kw_only=True, slots=True)
class PSConfig:
    """Knobs of the parameter-server roles (scheduler, servers, workers).

    The ``DMLC_*`` names of MXNet/ps-lite are accepted beside the ``HORA_PS_*``
    ones, so hand-started roles work as they did with MXNet's ``launch.py``.

    Attributes:
        role: ``worker``, ``server`` or ``scheduler`` (``DMLC_ROLE``).
        root_uri: host of the scheduler (``DMLC_PS_ROOT_URI``).
        root_port: TCP port of the scheduler (``DMLC_PS_ROOT_PORT``).
        num_servers: servers in the job (``DMLC_NUM_SERVER``).
        num_workers: workers in the job (``DMLC_NUM_WORKER``, else ``HORA_SIZE``).
        worker_rank: the rank this worker asks the scheduler for (``HORA_RANK``
            or ``DMLC_WORKER_ID``); ``None`` takes the next free one.
        interface: network interface whose IPv4 address servers bind
            (``DMLC_INTERFACE``, ``HORA_NETWORK_INTERFACE``); by default the
            address that routes to ``root_uri``.
        node_host: this host's address for servers to bind, as ps-lite's
            ``DMLC_NODE_HOST`` (wins over ``interface``).
        secret: the job secret keying every message's HMAC (``HORA_SECRET``).
        bigarray_bound: keys with at least this many elements are split
            across all servers (``HORA_PS_BIGARRAY_BOUND``,
            ``MXNET_KVSTORE_BIGARRAY_BOUND``).
        part_bytes: largest payload of one message; bigger pushes and pulls
            travel as several, which pipeline and bound a server's memory
            (``HORA_PS_PART_BYTES``).
        resend_timeout_ms: an unanswered request is sent again after this
            long, doubling each time; 0 never resends (``HORA_PS_RESEND_TIMEOUT_MS``,
            ``PS_RESEND_TIMEOUT``).  ZeroMQ over TCP loses nothing while a
            connection lives, and a dist_sync push is answered only once every
            worker's push has arrived, so the default is generous (10 s):
            a short one resends on slow links, only adding load.
        timeout_s: a peer silent for this long is declared dead and every
            worker's pending and later calls raise (``HORA_PS_TIMEOUT``,
            ``PS_HEARTBEAT_TIMEOUT``).
        heartbeat_s: interval of the heartbeats that prove a node alive
            (``HORA_PS_HEARTBEAT_INTERVAL``, ``PS_HEARTBEAT_INTERVAL``);
            by default a quarter of ``timeout_s``, at most 1 s.
        start_timeout_s: how long a node waits for every role to register.
        server_threads: threads a server uses to work on keys concurrently.
        test_drop_reply_every: testing aid: a server drops every Nth reply it
            would send (0: never), to exercise resends.
        shm: let co-located peers (same host, same user) pass payloads through
            shared memory instead of the socket (``HORA_PS_SHM``; 0 forces the
            socket path).
        shm_min_bytes: smaller shards always travel through the socket
            (``HORA_PS_SHM_MIN_BYTES``).
        server_index: the launcher's index of this server (``HORA_PS_SERVER_INDEX``);
            the scheduler uses it as the server id when the indices are 0..S-1.
        encrypt: encrypt every parameter-server connection with CURVE
            (``HORA_PS_ENCRYPT``, default off).  Connections are authenticated at
            the ZeroMQ handshake either way, by credentials derived from ``secret``;
            every role of a job must use the same setting.  See docs/security.md.
        max_frame_bytes: largest frame a server or worker accepts; a larger one
            closes the sender's connection (``HORA_PS_MAX_FRAME_BYTES``, default
            1 GiB).  Pushes and pulls travel in ``part_bytes`` pieces; a single
            optimizer-state array (``save_optimizer_states``) must fit.
    """

    role: str = "worker"
    root_uri: str = "127.0.0.1"
    root_port: int | None = None
    num_servers: int | None = None
    num_workers: int | None = None
    worker_rank: int | None = None
    interface: str | None = None
    node_host: str | None = None
    secret: str | None = None
    bigarray_bound: int = 1_000_000
    part_bytes: int = 4 * MiB
    resend_timeout_ms: float = 10000.0
    timeout_s: float = 60.0
    heartbeat_s: float | None = None
    start_timeout_s: float = 120.0
    server_threads: int = 0
    test_drop_reply_every: int = 0
    shm: bool = True
    shm_min_bytes: int = 256 * 1024
    server_index: int | None = None
    encrypt: bool = False
    max_frame_bytes: int = 1024 * MiB

    def __post_init__(self) -> None:
        if self.role not in PS_ROLES:
            raise ConfigError(f"DMLC_ROLE={self.role!r} is not one of {', '.join(PS_ROLES)}")
        if self.root_port is not None and not 0 < self.root_port < 65536:
            raise ConfigError(f"DMLC_PS_ROOT_PORT={self.root_port} is not a TCP port (1-65535)")
        for name in ("num_servers", "num_workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be >= 1 (DMLC_NUM_SERVER / DMLC_NUM_WORKER)")
        if self.worker_rank is not None and self.worker_rank < 0:
            raise ConfigError(f"worker rank {self.worker_rank} must be >= 0")
        if self.bigarray_bound < 1:
            raise ConfigError(f"HORA_PS_BIGARRAY_BOUND={self.bigarray_bound} must be >= 1 element")
        if self.part_bytes < 64:
            raise ConfigError(f"HORA_PS_PART_BYTES={self.part_bytes} must be at least 64 bytes")
        if self.resend_timeout_ms < 0:
            raise ConfigError(f"HORA_PS_RESEND_TIMEOUT_MS={self.resend_timeout_ms} must be >= 0 (0 disables resends)")
        if self.heartbeat_s is None and self.timeout_s > 0:
            self.heartbeat_s = min(1.0, self.timeout_s / 4)
        if self.timeout_s <= 0 or self.heartbeat_s is None or self.heartbeat_s <= 0 or self.start_timeout_s <= 0:
            raise ConfigError(
                f"parameter-server timeouts must be > 0: HORA_PS_TIMEOUT={self.timeout_s}, "
                f"HORA_PS_HEARTBEAT_INTERVAL={self.heartbeat_s}, HORA_PS_START_TIMEOUT={self.start_timeout_s}"
            )
        if self.heartbeat_s * 2 > self.timeout_s:
            raise ConfigError(
                f"the heartbeat interval ({self.heartbeat_s} s) must be at most half the dead-peer timeout "
                f"({self.timeout_s} s): set HORA_PS_HEARTBEAT_INTERVAL lower or HORA_PS_TIMEOUT higher"
            )
        if self.server_threads < 0 or self.test_drop_reply_every < 0:
            raise ConfigError("HORA_PS_SERVER_THREADS and HORA_PS_TEST_DROP_REPLY_EVERY must be >= 0")
        if self.shm_min_bytes < 0 or (self.server_index is not None and self.server_index < 0):
            raise ConfigError(f"HORA_PS_SHM_MIN_BYTES={self.shm_min_bytes} and HORA_PS_SERVER_INDEX="
                              f"{self.server_index} must be >= 0")
        if self.max_frame_bytes < self.part_bytes:
            raise ConfigError(f"HORA_PS_MAX_FRAME_BYTES={self.max_frame_bytes} must be at least HORA_PS_PART_BYTES="
                              f"{self.part_bytes}, the size of the pieces pushes and pulls travel in")

    def require_job(self) -> None:
        """Check that the knobs every role needs are present.

        Raises:
            ConfigError: the scheduler port or the role counts are missing.
        """
        missing = [name for name, value in ((envvars.DMLC_PS_ROOT_PORT, self.root_port),
                                            (envvars.DMLC_NUM_SERVER, self.num_servers),
                                            (envvars.DMLC_NUM_WORKER, self.num_workers)) if value is None]
        if missing:
            raise ConfigError(
                f"the parameter-server job is not configured: {', '.join(missing)} not set. Start the job with "
                "`hora run -np W -s S ...`, or set DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER and "
                "DMLC_NUM_WORKER for every role"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> PSConfig:
        """Build the config from environment variables, then explicit overrides."""
        env = os.environ if env is None else env

        def opt_int(*names: str) -> int | None:
            return None if _lookup(env, *names) is None else _as_int(env, names, 0)

        values: dict[str, Any] = dict(
            role=(_lookup(env, envvars.HORA_PS_ROLE, envvars.DMLC_ROLE) or "worker").lower(),
            root_uri=_lookup(env, envvars.HORA_PS_ROOT_URI, envvars.DMLC_PS_ROOT_URI) or "127.0.0.1",
            root_port=opt_int(envvars.HORA_PS_ROOT_PORT, envvars.DMLC_PS_ROOT_PORT),
            num_servers=opt_int(envvars.HORA_PS_NUM_SERVER, envvars.DMLC_NUM_SERVER),
            num_workers=opt_int(envvars.HORA_PS_NUM_WORKER, envvars.DMLC_NUM_WORKER, envvars.HORA_SIZE),
            worker_rank=opt_int(envvars.HORA_RANK, envvars.DMLC_WORKER_ID),
            interface=_lookup(env, envvars.HORA_PS_INTERFACE, envvars.DMLC_INTERFACE, envvars.HORA_NETWORK_INTERFACE),
            node_host=_lookup(env, envvars.HORA_PS_NODE_HOST, envvars.DMLC_NODE_HOST),
            secret=_lookup(env, envvars.HORA_SECRET),
            bigarray_bound=_as_int(
                env, (envvars.HORA_PS_BIGARRAY_BOUND, envvars.MXNET_KVSTORE_BIGARRAY_BOUND), 1_000_000
            ),
            part_bytes=_as_int(env, (envvars.HORA_PS_PART_BYTES,), 4 * MiB),
            resend_timeout_ms=_as_float(env, (envvars.HORA_PS_RESEND_TIMEOUT_MS, envvars.PS_RESEND_TIMEOUT), 10000.0),
            timeout_s=_as_float(env, (envvars.HORA_PS_TIMEOUT, envvars.PS_HEARTBEAT_TIMEOUT), 60.0),
            heartbeat_s=(None if _lookup(env, envvars.HORA_PS_HEARTBEAT_INTERVAL, envvars.PS_HEARTBEAT_INTERVAL) is None
                         else _as_float(env, (envvars.HORA_PS_HEARTBEAT_INTERVAL, envvars.PS_HEARTBEAT_INTERVAL), 1.0)),
            start_timeout_s=_as_float(env, (envvars.HORA_PS_START_TIMEOUT,), 120.0),
            server_threads=_as_int(env, (envvars.HORA_PS_SERVER_THREADS,), 0),
            test_drop_reply_every=_as_int(env, (envvars.HORA_PS_TEST_DROP_REPLY_EVERY,), 0),
            shm=_as_bool(env, (envvars.HORA_PS_SHM,), True),
            shm_min_bytes=_as_int(env, (envvars.HORA_PS_SHM_MIN_BYTES,), 256 * 1024),
            server_index=opt_int(envvars.HORA_PS_SERVER_INDEX),
            encrypt=_as_bool(env, (envvars.HORA_PS_ENCRYPT,), False),
            max_frame_bytes=_as_int(env, (envvars.HORA_PS_MAX_FRAME_BYTES,), 1024 * MiB),
        )
        values.update(overrides)
        return cls(**values)


def ps_optimizer_modules(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The modules that register users' own optimizers for the parameter servers (``HORA_PS_OPTIMIZER_MODULES``).

    A comma-separated list of importable module names.  Servers and workers
    import them before they look an optimizer up by name, so an optimizer that
    is not one of MXNet's runs on the servers only when the job names the code
    that defines it: an explicit, auditable choice (nothing is unpickled).
    """
    env = os.environ if env is None else env
    raw = env.get(envvars.HORA_PS_OPTIMIZER_MODULES, "")
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(f"{envvars.HORA_PS_OPTIMIZER_MODULES}={raw!r}: {name!r} is not a module name "
                              "(give importable modules, comma-separated)")
    return names
