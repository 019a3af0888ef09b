"""Every knob hora has, read in one place.

Knobs are filled once, in this order of precedence: explicit arguments (the
launcher's CLI flags end up here as environment variables of the workers),
then environment variables, then defaults.  Each knob has a ``HORA_*`` name
and, where Horovod had one, the ``HOROVOD_*`` name is accepted too so existing
job scripts keep their tuning.

The launcher and the runtime meet only through the variables in
:data:`WORKER_ENV`; nothing else in hora reads ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from hora.errors import ConfigError

MiB = 1024 * 1024

#: The environment the launcher gives each worker (see docs/architecture in DESIGN.md).
WORKER_ENV = (
    "HORA_RANK",
    "HORA_SIZE",
    "HORA_LOCAL_RANK",
    "HORA_LOCAL_SIZE",
    "HORA_CROSS_RANK",
    "HORA_CROSS_SIZE",
    "HORA_HOSTNAME",
    "HORA_RENDEZVOUS_ADDR",
    "HORA_RENDEZVOUS_PORT",
    "HORA_SECRET",
    "HORA_CONTROLLER",
)


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
        timeline_filename: write a Chrome trace of engine activity here.
        mpi_threads: ask MPI for MPI_THREAD_MULTIPLE.
        overlap: run asynchronous collectives on the engine thread as soon as
            they are submitted, overlapping them with computation.  ``None``
            (auto) overlaps only when each local rank has at least two CPU
            cores: with one core per rank, communicating during backward only
            makes the two threads fight for the core, and it is faster to
            reduce everything when ``step()`` waits for it.
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
    mpi_threads: bool = True
    overlap: bool | None = None

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
        fusion_mb = _lookup(env, "HORA_FUSION_THRESHOLD_MB")
        fusion = (
            int(float(fusion_mb) * MiB)
            if fusion_mb is not None
            else _as_int(env, ("HORA_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"), 64 * MiB)
        )
        direct = _lookup(env, "HORA_DIRECT_THRESHOLD")
        values: dict[str, Any] = dict(
            controller=(_lookup(env, "HORA_CONTROLLER", "HOROVOD_CONTROLLER") or "auto").lower(),
            fusion_threshold_bytes=fusion,
            cycle_time_ms=_as_float(env, ("HORA_CYCLE_TIME", "HOROVOD_CYCLE_TIME"), 1.0),
            direct_threshold_bytes=int(direct) if direct is not None else None,
            cache_capacity=_as_int(env, ("HORA_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY"), 1024),
            stall_check_seconds=(
                0.0
                if _as_bool(env, ("HORA_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE"), False)
                else _as_float(env, ("HORA_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS"), 60.0)
            ),
            stall_shutdown_seconds=_as_float(
                env, ("HORA_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"), 0.0
            ),
            start_timeout_seconds=_as_float(env, ("HORA_START_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS"), 30.0),
            timeline_filename=_lookup(env, "HORA_TIMELINE", "HOROVOD_TIMELINE"),
            mpi_threads=not _as_bool(env, ("HORA_MPI_THREADS_DISABLE", "HOROVOD_MPI_THREADS_DISABLE"), False),
            overlap=None if (_lookup(env, "HORA_OVERLAP") or "auto") == "auto" else _as_bool(
                env, ("HORA_OVERLAP",), True),
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
    """

    addr: str | None = None
    port: int | None = None
    host_store: bool = True  # rank 0 hosts the store (False under torchrun's agent store)
    interface: str | None = None
    secret: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RendezvousConfig:
        env = os.environ if env is None else env
        addr = _lookup(env, "HORA_RENDEZVOUS_ADDR")
        port = _lookup(env, "HORA_RENDEZVOUS_PORT")
        host_store = True
        if addr is None and _lookup(env, "MASTER_ADDR") is not None:
            addr, port = env["MASTER_ADDR"], _lookup(env, "MASTER_PORT")
            host_store = (_lookup(env, "TORCHELASTIC_USE_AGENT_STORE") or "").lower() != "true"
        if port is not None and not port.isdigit():
            raise ConfigError(f"rendezvous port {port!r} is not a number")
        return cls(
            addr=addr,
            port=int(port) if port is not None else None,
            host_store=host_store,
            interface=_lookup(env, "HORA_NETWORK_INTERFACE", "GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE"),
            secret=_lookup(env, "HORA_SECRET"),
        )
