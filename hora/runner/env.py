"""The environment every worker gets: :func:`build_env` fills in the launcher/worker contract.

The variable names and what each one carries are in :mod:`hora.envvars`;
the rank variables are added per worker by the launcher (:meth:`Slot.env`).
On other hosts (ssh launcher) a process gets the variables of
:func:`forwarded_names` from the launcher and the rest from its own login
environment.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Mapping

from hora import envvars
from hora.config import MiB, interface_names
from hora.errors import ConfigError, LaunchError
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import Endpoints

#: Variables a nested launch must not inherit from an outer ``hora run``: the rank variables, and the
#: per-job ones that an outer job's values must not leak into (the launcher sets them when they apply).
NOT_INHERITED = envvars.WORKER_PLACEMENT + envvars.HOROVOD_PLACEMENT + envvars.PS_JOB


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


def local_endpoints(config: LaunchConfig) -> Endpoints:
    """Endpoints of a job whose rank 0 runs on this machine: loopback, or the chosen interface.

    Raises:
        LaunchError: ``--network-interface`` names no interface with an IPv4 address here.
    """
    address = interface_address(config.network_interface) if config.network_interface else "127.0.0.1"
    port = free_port(address)
    ps_port = None
    while config.num_servers > 0 and ps_port in (None, port):
        ps_port = free_port(address)
    return Endpoints(addr=address, port=port, ps_port=ps_port)


def forwarded_names(env: Mapping[str, str], config: LaunchConfig) -> list[str]:
    """The variables that must reach processes on other hosts (mpirun ``-x``, the ssh launcher).

    The job's own variables (``HORA_*``, ``HOROVOD_*``, ``DMLC_*``, ``GLOO_*``,
    ``NCCL_*``), the thread and Python settings, the search paths, and
    whatever the user set for the job (``--env``).
    """
    names = {n for n in env if n.startswith(envvars.FORWARDED_PREFIXES)}
    names |= set(envvars.FORWARDED_NAMES) & set(env)
    names |= set(config.env) & set(env)
    return sorted(names)


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface (of the first, given a comma-separated list).

    Every interface of a list (gloo opens connections on each) must exist.

    Raises:
        LaunchError: an interface does not exist or the first has no IPv4 address.
    """
    import psutil  # only needed with --network-interface

    addresses = psutil.net_if_addrs()
    names = interface_names(interface)
    for name in names or [interface]:
        if name not in addresses:
            raise LaunchError(
                f"--network-interface {name!r} does not exist here; interfaces: {', '.join(sorted(addresses))}"
            )
    for addr in addresses[names[0]]:
        if addr.family == socket.AF_INET:
            return addr.address
    raise LaunchError(f"--network-interface {names[0]!r} has no IPv4 address")


def build_env(
    config: LaunchConfig,
    local_size: int,
    base: Mapping[str, str] | None = None,
    endpoints: Endpoints | None = None,
) -> tuple[dict[str, str], str | None]:
    """The environment shared by all processes of a job, and a notice for the user.

    Args:
        config: the launch.
        local_size: workers per host, used to split the CPUs between them.
        base: the environment to start from (default: the launcher's own).
        endpoints: where rank 0 and the scheduler listen (default: this
            machine, see :func:`local_endpoints`).

    Returns:
        ``(env, notice)``; ``notice`` is the OMP_NUM_THREADS message to print
        once, or None when the user chose OMP_NUM_THREADS.
    """
    env = dict(os.environ if base is None else base)
    env.update(config.env)
    for name in NOT_INHERITED:
        env.pop(name, None)
    if endpoints is None:
        endpoints = local_endpoints(config)
    if config.network_interface:
        env[envvars.HORA_NETWORK_INTERFACE] = config.network_interface
        env[envvars.GLOO_SOCKET_IFNAME] = config.network_interface
    env[envvars.HORA_CONTROLLER] = str(config.controller)
    env[envvars.HORA_RENDEZVOUS_ADDR] = endpoints.addr
    env[envvars.HORA_RENDEZVOUS_PORT] = str(endpoints.port)
    env[envvars.HORA_SECRET] = secrets.token_hex(16)
    if config.num_servers > 0:
        env[envvars.DMLC_ROLE] = "worker"
        env[envvars.DMLC_PS_ROOT_URI] = endpoints.addr
        ps_port = endpoints.ps_port if endpoints.ps_port is not None else free_port(endpoints.addr)
        env[envvars.DMLC_PS_ROOT_PORT] = str(ps_port)
        env[envvars.DMLC_NUM_SERVER] = str(config.num_servers)
        env[envvars.DMLC_NUM_WORKER] = str(config.num_proc)
        if config.network_interface:
            env[envvars.DMLC_INTERFACE] = config.network_interface
    if config.fusion_threshold_mb is not None:
        env.pop(envvars.HORA_FUSION_THRESHOLD_MB, None)  # the flag wins over an inherited MB value
        env[envvars.HORA_FUSION_THRESHOLD] = str(int(config.fusion_threshold_mb * MiB))
    if config.cycle_time_ms is not None:
        env[envvars.HORA_CYCLE_TIME] = _number(config.cycle_time_ms)
    if config.timeline_filename is not None:
        env[envvars.HORA_TIMELINE] = config.timeline_filename
    if config.start_timeout is not None:
        env[envvars.HORA_START_TIMEOUT] = _number(config.start_timeout)
    env[envvars.PYTHONUNBUFFERED] = "1"
    notice = None
    if not env.get(envvars.OMP_NUM_THREADS):
        cpus = available_cpus()
        threads = max(1, cpus // max(1, local_size))
        env[envvars.OMP_NUM_THREADS] = str(threads)
        notice = (
            f"hora run: setting OMP_NUM_THREADS={threads} for each process ({cpus} CPUs shared by "
            f"{local_size} local processes) to avoid oversubscribing the CPUs; "
            "set OMP_NUM_THREADS yourself to override."
        )
    return env, notice


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def require_gloo(sources: Mapping[str, Mapping[str, str]], engine: str) -> None:
    """Refuse a job whose environment asks for MPI where the ranks can only meet through gloo.

    ``hora.ray`` starts its ranks itself, as actors; ``mpirun`` never starts them,
    so MPI cannot join them.  (``hora.spark`` runs MPI itself: :mod:`hora.spark.mpi`.)

    Args:
        sources: where each environment came from (``{"env": ..., "the driver's environment": ...}``).
        engine: what starts the ranks, for the message (``"hora.ray runs its workers as Ray actors"``).

    Raises:
        ConfigError: ``HORA_CONTROLLER`` or ``HOROVOD_CONTROLLER`` names something other than gloo.
    """
    for where, values in sources.items():
        for name in (envvars.HORA_CONTROLLER, envvars.HOROVOD_CONTROLLER):
            value = str(values.get(name, "") or "").lower()
            if value and value != "gloo":
                raise ConfigError(
                    f"{name}={values[name]!r} in {where}: {engine}, which meet through gloo; mpirun does not "
                    "start them. Unset it or set it to 'gloo' (use 'hora run --mpi' for MPI)"
                )
