"""The environment every worker gets: the launcher/runtime contract.

The launcher and the workers meet only through these variables (the rank
ones are added per worker by the launcher, see :meth:`Slot.env`):

==========================  ==================================================
``HORA_RANK`` ...           rank, size, local/cross rank and size, hostname
                            (gloo mode; under mpirun the ``OMPI_*`` ones serve)
``HORA_CONTROLLER``         ``gloo`` or ``mpi``
``HORA_RENDEZVOUS_ADDR``    where rank 0 hosts the rendezvous store
``HORA_RENDEZVOUS_PORT``    a TCP port that was free when the launcher started
``HORA_SECRET``             random per-job secret (hex)
``HORA_FUSION_THRESHOLD``   bytes, only if ``--fusion-threshold-mb`` was given
``HORA_CYCLE_TIME``         ms, only if ``--cycle-time-ms`` was given
``HORA_TIMELINE``           only if ``--timeline-filename`` was given
``HORA_START_TIMEOUT``      seconds, only if ``--start-timeout`` was given
``HORA_NETWORK_INTERFACE``  and ``GLOO_SOCKET_IFNAME``, with ``--network-interface``
``OMP_NUM_THREADS``         cpus // local_size unless the user set it
``PYTHONUNBUFFERED``        ``1``, so output arrives line by line
==========================  ==================================================
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Mapping

from hora.config import MiB
from hora.errors import LaunchError
from hora.runner.config import LaunchConfig

#: Variables a nested launch must not inherit from an outer ``hora run``.
_RANK_VARIABLES = (
    "HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE",
    "HORA_CROSS_RANK", "HORA_CROSS_SIZE", "HORA_HOSTNAME",
)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, so containers count right)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_port(address: str) -> int:
    """A TCP port on ``address`` that is free right now.

    Another process could take it before rank 0 binds it; the window is short
    and rank 0 reports a clear error if it happens.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface.

    Raises:
        LaunchError: the interface does not exist or has no IPv4 address.
    """
    import psutil  # only needed with --network-interface

    addresses = psutil.net_if_addrs()
    if interface not in addresses:
        raise LaunchError(
            f"--network-interface {interface!r} does not exist here; interfaces: {', '.join(sorted(addresses))}"
        )
    for addr in addresses[interface]:
        if addr.family == socket.AF_INET:
            return addr.address
    raise LaunchError(f"--network-interface {interface!r} has no IPv4 address")


def build_env(
    config: LaunchConfig, local_size: int, base: Mapping[str, str] | None = None
) -> tuple[dict[str, str], str | None]:
    """The environment shared by all workers of a job, and a notice for the user.

    Args:
        config: the launch.
        local_size: workers per host, used to split the CPUs between them.
        base: the environment to start from (default: the launcher's own).

    Returns:
        ``(env, notice)``; ``notice`` is the OMP_NUM_THREADS message to print
        once, or None when the user chose OMP_NUM_THREADS.
    """
    env = dict(os.environ if base is None else base)
    env.update(config.env)
    for name in _RANK_VARIABLES:
        env.pop(name, None)
    if config.network_interface:
        address = interface_address(config.network_interface)
        env["HORA_NETWORK_INTERFACE"] = config.network_interface
        env["GLOO_SOCKET_IFNAME"] = config.network_interface
    else:
        address = "127.0.0.1"
    env["HORA_CONTROLLER"] = str(config.controller)
    env["HORA_RENDEZVOUS_ADDR"] = address
    env["HORA_RENDEZVOUS_PORT"] = str(free_port(address))
    env["HORA_SECRET"] = secrets.token_hex(16)
    if config.fusion_threshold_mb is not None:
        env.pop("HORA_FUSION_THRESHOLD_MB", None)  # the flag wins over an inherited MB value
        env["HORA_FUSION_THRESHOLD"] = str(int(config.fusion_threshold_mb * MiB))
    if config.cycle_time_ms is not None:
        env["HORA_CYCLE_TIME"] = _number(config.cycle_time_ms)
    if config.timeline_filename is not None:
        env["HORA_TIMELINE"] = config.timeline_filename
    if config.start_timeout is not None:
        env["HORA_START_TIMEOUT"] = _number(config.start_timeout)
    env["PYTHONUNBUFFERED"] = "1"
    notice = None
    if not env.get("OMP_NUM_THREADS"):
        cpus = available_cpus()
        threads = max(1, cpus // max(1, local_size))
        env["OMP_NUM_THREADS"] = str(threads)
        notice = (
            f"hora run: setting OMP_NUM_THREADS={threads} for each process ({cpus} CPUs shared by "
            f"{local_size} local processes) to avoid oversubscribing the CPUs; "
            "set OMP_NUM_THREADS yourself to override."
        )
    return env, notice


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
