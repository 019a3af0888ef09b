"""``hora.run(fn, ...)``: run a Python function on N processes and collect its results.

The signature follows ``horovod.runner.run`` so existing calls keep working;
parameters of features hora does not have yet (elastic sizes) raise
:class:`hora.errors.UnsupportedError` when set.  The function goes
through the same :func:`hora.runner.launch.run_job` path as ``hora run``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.errors import ConfigError, LaunchError, UnsupportedError, WorkerFailedError
from hora.runner.hostlist import parse_hostfile
from hora.runner.launch import run_job
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import JobResult
from hora.runner.run_task import PATH_FILE, TASK_FILE, result_file

logger = logging.getLogger(__name__)


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    np: int = 1,
    min_np: int | None = None,
    max_np: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | Sequence[str] | None = None,
    network_interface: str | None = None,
    executable: str | None = None,
    *,
    controller: str | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``np`` processes and return their results.

    Each process is a rank of one job, with the same environment ``hora run``
    gives (``hora.torch.init()`` inside ``func`` joins the job).  ``func`` and
    its arguments are serialized with cloudpickle.

    Args:
        func: the function each rank runs.
        args: positional arguments for ``func``.
        kwargs: keyword arguments for ``func``.
        np: number of processes.
        min_np: elastic training only; not available yet.
        max_np: elastic training only; not available yet.
        slots: not supported; give slots in ``hosts`` (``"localhost:4"``).
        reset_limit: elastic training only; not available yet.
        hosts: ``"host:slots,..."``; other hosts are reached over ssh (the
            function and its results travel through the working directory's
            file system, so the hosts must share it).
        hostfile: a file of hosts, as ``hora run --hostfile``.
        start_timeout: seconds the ranks may take to rendezvous.
        ssh_port: sshd port on the hosts.
        ssh_identity_file: private key for ssh.
        disable_cache: accepted for compatibility; hora caches nothing here.
        output_filename: also write each rank's output to ``DIR/rank.N/``.
        verbose: print the launch plan.
        use_gloo: run the gloo controller, processes started by hora.
        use_mpi: run under mpirun with the MPI controller.  With neither, a job
            on this machine runs under mpirun when MPI is installed, as with
            ``hora run``, and with gloo otherwise.
        mpi_args: extra mpirun arguments (a string or a list).
        network_interface: interface for rendezvous and gloo traffic.
        executable: the Python interpreter for the ranks (default: this one).
        controller: ``"gloo"`` or ``"mpi"``, an alternative to ``use_gloo``/``use_mpi``.
        env: extra environment variables for every rank.

    Returns:
        The return values of ``func``, ordered by rank.

    Raises:
        WorkerFailedError: a rank raised or died; the first one is reported,
            and when it raised, its exception is the ``__cause__``.
        UnsupportedError: a parameter of a feature hora does not have yet is set.
        ConfigError: parameters contradict each other or have bad values.
        LaunchError: the job could not start or was interrupted.
    """
    for name, value in (("min_np", min_np), ("max_np", max_np), ("reset_limit", reset_limit)):
        if value is not None:
            raise UnsupportedError(f"{name}={value!r}: elastic training is not available yet; leave {name} unset")
    if slots is not None:
        raise UnsupportedError(f"slots={slots!r} is not supported; give slots per host in hosts='localhost:{slots}'")
    if hosts is not None and hostfile is not None:
        raise ConfigError("give either hosts or hostfile, not both")
    if disable_cache is not None:
        logger.debug("disable_cache=%r has no effect: hora keeps no launch cache", disable_cache)

    directory = tempfile.mkdtemp(prefix="hora-run-")
    try:
        _write_task(directory, func, tuple(args), dict(kwargs or {}))
        config = LaunchConfig(
            command=[executable or sys.executable, "-m", "hora.runner.run_task", directory],
            num_proc=np,
            hosts=parse_hostfile(hostfile) if hostfile is not None else hosts,
            controller=_controller(use_gloo, use_mpi, controller),
            start_timeout=start_timeout,
            output_filename=output_filename,
            network_interface=network_interface,
            env=dict(env or {}),
            mpi_args=shlex.split(mpi_args) if isinstance(mpi_args, str) else tuple(mpi_args or ()),
            verbose=bool(verbose),
            ssh_port=ssh_port,
            ssh_identity_file=ssh_identity_file,
        )
        result = run_job(config)
        if result.exit_code != 0:
            _raise_failure(result, directory)
        return [_load_result(directory, rank)[1] for rank in range(np)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _controller(use_gloo: bool | None, use_mpi: bool | None, controller: str | None) -> str | None:
    if use_gloo and use_mpi:
        raise ConfigError("use_gloo=True and use_mpi=True contradict each other; set one")
    chosen = "mpi" if use_mpi else "gloo" if use_gloo else None
    if controller is not None and chosen is not None and controller != chosen:
        raise ConfigError(f"controller={controller!r} contradicts use_{chosen}=True")
    return controller or chosen


def _write_task(directory: str, func: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    import cloudpickle

    with open(os.path.join(directory, PATH_FILE), "w", encoding="utf-8") as f:
        json.dump([os.path.abspath(p) if p else os.getcwd() for p in sys.path], f)
    try:
        payload = cloudpickle.dumps((func, args, kwargs))
    except Exception as e:
        raise ConfigError(f"cannot serialize {getattr(func, '__name__', func)!r} or its arguments: {e}") from e
    with open(os.path.join(directory, TASK_FILE), "wb") as f:
        f.write(payload)


def _load_result(directory: str, rank: int) -> tuple[Any, ...]:
    import cloudpickle

    path = result_file(directory, rank)
    try:
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    except FileNotFoundError:
        raise LaunchError(f"rank {rank} ended without storing a result") from None


def _raise_failure(result: JobResult, directory: str) -> None:
    cause = result.root_cause
    if cause is None:
        if result.interrupted_by == signal.SIGINT:
            raise KeyboardInterrupt
        if result.interrupted_by is not None:
            raise LaunchError(f"hora.run was stopped by {signal.Signals(result.interrupted_by).name}")
        raise LaunchError(result.message or f"the job failed with exit code {result.exit_code}")
    error = WorkerFailedError(cause.rank, cause.returncode, cause.host, "\n".join(cause.stderr_tail))
    original: BaseException | None = None
    if os.path.exists(result_file(directory, cause.rank)):
        outcome = _load_result(directory, cause.rank)
        if outcome[0] == "error":
            original = outcome[1]
    raise error from original
