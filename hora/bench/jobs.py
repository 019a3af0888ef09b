"""Running one measurement as a real ``hora run`` job and reading what its workers report.

Every ``hora bench`` measurement is a job started exactly as a user would
start one, ``python -m hora.runner.cli run -np N [--gloo|--mpi] [-s S] [-H ...]
python -m hora.bench.workers.X ...``, in a subprocess of its own session.
The workers print one line per event, ``HORA_BENCH {json}``, to stdout; the
launcher prefixes it with ``[rank]<stdout>:`` and this module parses it back,
handing progress events to a callback while the job runs.  A job that fails
or outlives its timeout is stopped (its whole process group) and raises a
:class:`hora.errors.LaunchError` with the tail of its output.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hora import envvars
from hora.errors import ConfigError, LaunchError

#: Marker of a worker's event line.
EVENT_MARK = "HORA_BENCH "
_EVENT_LINE = re.compile(r"^(?:\[(\d+)\]<std(?:out|err)>:)?" + re.escape(EVENT_MARK) + r"(.*)$")
#: Launcher variables a nested job must not inherit (the bench may itself run inside a job).
_LAUNCHER_ENV_PREFIXES = ("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "PMI_", "PRTE_", "DMLC_", "SLURM_")
#: torchrun's variables, which a nested job must not inherit either.
_TORCHRUN_VARIABLES = (envvars.TORCHRUN_RANK, envvars.TORCHRUN_WORLD_SIZE, envvars.TORCHRUN_LOCAL_RANK, "LOCAL_SIZE",
                       envvars.TORCHRUN_LOCAL_WORLD_SIZE, envvars.MASTER_ADDR, envvars.MASTER_PORT)
#: Lines of output kept for the error message of a failed job.
TAIL_LINES = 40


def emit(event: str, **fields: Any) -> None:
    """Print one event line for the bench driver (workers call this; flushes at once)."""
    print(EVENT_MARK + json.dumps({"event": event, **fields}), flush=True)


@dataclasses.dataclass(kw_only=True, slots=True)
class JobSpec:
    """One ``hora run`` invocation.

    Attributes:
        worker: module of :mod:`hora.bench.workers` (``"allreduce"``), or a
            full command (a list) to run instead.
        args: the worker's arguments.
        num_proc: worker processes (``-np``).
        controller: ``"gloo"`` or ``"mpi"``.
        num_servers: parameter servers (``-s``), 0 for none.
        server_hosts: hosts for the servers (``--server-hosts``); empty: the
            launcher puts them on the workers' hosts.
        hosts: ``-H`` value passed through to the launcher.
        hostfile: ``--hostfile`` value passed through.
        run_args: further ``hora run`` flags, verbatim.
        env: extra environment for the job.
        timeout_s: the job is stopped after this many seconds.
        cwd: working directory of the job.
        prefix: a command that ``hora run`` is started under (``nsenter ... --``
            to start it on an emulated host).
    """

    worker: str | Sequence[str]
    args: Sequence[str] = ()
    num_proc: int = 2
    controller: str = "gloo"
    num_servers: int = 0
    server_hosts: Sequence[str] = ()
    hosts: str | None = None
    hostfile: str | None = None
    run_args: Sequence[str] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    timeout_s: float = 600.0
    cwd: str | None = None
    prefix: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.controller not in ("gloo", "mpi"):
            raise ConfigError(f"backend {self.controller!r} is not one of gloo, mpi")
        if self.num_proc < 1:
            raise ConfigError(f"-np {self.num_proc} must be >= 1")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout {self.timeout_s} s must be > 0")

    def command(self) -> list[str]:
        """The full ``hora run`` command line of this job."""
        cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(self.num_proc), f"--{self.controller}"]
        if self.num_servers:
            cmd += ["-s", str(self.num_servers)]
            if self.server_hosts:
                cmd += ["--server-hosts", ",".join(self.server_hosts)]
        if self.hosts:
            cmd += ["-H", self.hosts]
        if self.hostfile:
            cmd += ["--hostfile", self.hostfile]
        cmd += list(self.run_args)
        worker = ([sys.executable, "-m", f"hora.bench.workers.{self.worker}"] if isinstance(self.worker, str)
                  else list(self.worker))
        return [*self.prefix, *cmd, "--", *worker, *self.args]


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment minus launcher variables, with hora importable from where it is now."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV_PREFIXES)}
    for name in _TORCHRUN_VARIABLES:
        env.pop(name, None)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env[envvars.PYTHONUNBUFFERED] = "1"
    env.update(extra or {})
    return env


@dataclasses.dataclass(slots=True)
class JobOutput:
    """What a finished job reported: its events by rank, and the tail of its output."""

    events: list[dict[str, Any]]
    tail: list[str]
    seconds: float
    #: (peak RSS, stored bytes) that each parameter server logged when it exited
    server_memory: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def results(self) -> dict[int, dict[str, Any]]:
        """The ``result`` event of each rank that sent one, by rank."""
        return {int(e.get("rank", 0)): e for e in self.events if e.get("event") == "result"}


def run_job(spec: JobSpec, on_event: Callable[[dict[str, Any]], None] | None = None,
            echo: Callable[[str], None] | None = None) -> JobOutput:
    """Run ``spec`` to the end and return its events.

    Args:
        spec: the job.
        on_event: called in this thread with every event as it arrives.
        echo: called with every other output line (e.g. for ``--verbose``).

    Raises:
        LaunchError: the job exited non-zero or ran past ``spec.timeout_s``;
            the message has the command and the last lines of output.
    """
    cmd = spec.command()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=job_env(spec.env), cwd=spec.cwd, start_new_session=True)
    except OSError as e:
        raise LaunchError(f"cannot start {shlex.join(cmd)}: {e}") from e
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.put(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    events: list[dict[str, Any]] = []
    server_memory: list[tuple[int, int]] = []
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    deadline = t0 + spec.timeout_s
    timed_out = False
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            try:
                line = lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if line is None:
                break
            event = parse_event(line)
            if event is None:
                memory = _SERVER_MEMORY.search(line)
                if memory is not None:
                    server_memory.append((int(memory.group(1)), int(memory.group(2))))
                tail.append(line)
                if echo is not None:
                    echo(line)
                continue
            events.append(event)
            if on_event is not None:
                on_event(event)
        if not timed_out:  # output closed: the launcher is exiting
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        if proc.poll() is None:  # timed out, or interrupted (Ctrl-C, an exception in on_event)
            _stop(proc, grace_s=5.0)
        reader.join(5.0)
        if proc.stdout is not None:
            proc.stdout.close()
    seconds = time.monotonic() - t0
    if timed_out:
        raise LaunchError(f"benchmark job ran past its {spec.timeout_s:.0f} s timeout and was stopped: "
                          f"{shlex.join(cmd)}\n" + "\n".join(tail))
    if proc.returncode != 0:
        raise LaunchError(f"benchmark job exited with status {proc.returncode}: {shlex.join(cmd)}\n"
                          + "\n".join(tail))
    return JobOutput(events=events, tail=list(tail), seconds=seconds, server_memory=server_memory)


# What hora.kvstore.ps.server logs as it exits.
_SERVER_MEMORY = re.compile(r"peak RSS (\d+) bytes for (\d+) bytes of stored values")


def parse_event(line: str) -> dict[str, Any] | None:
    """The event of a ``[rank]<stdout>:HORA_BENCH {...}`` line (rank filled from the prefix), or None."""
    m = _EVENT_LINE.match(line)
    if not m:
        return None
    try:
        event = json.loads(m.group(2))
    except json.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    if m.group(1) is not None:
        event.setdefault("rank", int(m.group(1)))
    return event


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """Stop the job's launcher and everything in its process group: SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=max(wait_s, 0.5))
            if sig == signal.SIGTERM:
                # the launcher is gone; its workers share the group and get the same fate
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        except subprocess.TimeoutExpired:
            continue
