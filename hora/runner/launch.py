"""``launch(config)``: the one code path behind ``hora run`` and ``hora.run``.

It checks what can be checked before any process starts (hosts, the
command), builds the workers' environment, hands the job to a launcher with
the launcher's signals routed to it, and finally prints the root-cause
report when the job failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TextIO

from hora import envvars
from hora.errors import LaunchError
from hora.runner.env import build_env
from hora.runner.keys import WORKER
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers import get_launcher, launcher_class
from hora.runner.launchers.base import Interrupt, JobResult, Slot, signal_name
from hora.runner.output import OutputSink
from hora.runner.plan import plan_slots, workers_per_host

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def launch(config: LaunchConfig) -> int:
    """Run a job and return the exit code ``hora run`` exits with.

    Args:
        config: what to run and how.

    Returns:
        0 when every rank succeeded; else the root-cause rank's exit code
        (128+N if it died of signal N), or 128+N if the launcher got signal N.

    Raises:
        LaunchError: the job could not be started (unknown command, a host
            that cannot be reached, a launcher tool that is missing).
    """
    return run_job(config).exit_code


def run_job(config: LaunchConfig, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> JobResult:
    """Like :func:`launch`, but return the whole :class:`JobResult`.

    Args:
        config: what to run and how.
        stdout: where workers' stdout lines go (default ``sys.stdout``).
        stderr: where workers' stderr lines and the launcher's messages go
            (default ``sys.stderr``).
    """
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    if config.elastic:
        from hora.runner.elastic import run_elastic

        if not launcher_class(str(config.launcher)).checks_command:
            check_command(config.command, os.environ)
        with _route_signals() as interrupt:
            result = run_elastic(config, stdout, stderr, interrupt)
        report(result, stderr)
        return result
    launcher = get_launcher(str(config.launcher))
    if launcher.submits(config):  # a batch system runs the whole job, this same launch inside it
        with _route_signals() as interrupt:
            result = launcher.submit(config, stdout, stderr, interrupt)
        report(result, stderr)
        return result
    slots = plan_slots(config)
    try:
        endpoints = launcher.prepare(config, slots)
        env, notice = build_env(config, local_size=workers_per_host(slots), endpoints=endpoints)
        if not launcher.checks_command:
            check_command(config.command, env)
        if notice:
            print(notice, file=stderr, flush=True)
        if config.verbose:
            _print_plan(config, slots, env, stderr)
        sink = OutputSink(stdout, stderr, config.output_filename)
        try:
            with _route_signals() as interrupt:
                result = launcher.run(config, slots, env, sink, interrupt)
        finally:
            sink.close()
    finally:
        launcher.close()
    report(result, stderr)
    return result


def check_command(command: Sequence[str], env: Mapping[str, str]) -> None:
    """Fail before starting anything if the command cannot be executed.

    Raises:
        LaunchError: the program does not exist or is not executable.
    """
    program = command[0]
    if os.sep in program:
        if not os.path.exists(program):
            raise LaunchError(f"cannot run {program!r}: no such file")
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            raise LaunchError(f"cannot run {program!r}: it is not an executable file")
        return
    if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise LaunchError(f"cannot run {program!r}: command not found on PATH")


def report(result: JobResult, stderr: TextIO) -> None:
    """Print the root-cause block (or why the launcher stopped) to ``stderr``."""
    lines: list[str] = []
    if result.root_cause is not None:
        cause = result.root_cause
        lines += ["hora run: job failed", f"  root cause: {cause.describe()}"]
        if cause.stderr_tail:
            lines.append(f"  last stderr lines of {cause.name}:")
            lines += [f"    {line}" for line in cause.stderr_tail]
        else:
            lines.append(f"  {cause.name} wrote nothing to stderr")
        others = [e for e in result.exits.values() if e.key != cause.key and e.failed]
        ranks = [e.rank for e in others if e.role == WORKER]
        stopped = [f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}"] if ranks else []
        stopped += [e.name for e in others if e.role != WORKER]
        if stopped:
            lines.append(f"  stopped by hora run: {', '.join(stopped)}")
    elif result.interrupted_by is not None:
        lines.append(f"hora run: stopped all workers after receiving {signal_name(result.interrupted_by)}")
    elif result.message is not None:
        lines.append(f"hora run: job failed: {result.message}")
        lines += [f"    {line}" for line in result.details]
    if lines:
        stderr.write("\n".join(lines) + "\n")
        stderr.flush()


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"


def _print_plan(config: LaunchConfig, slots: Sequence[Slot], env: Mapping[str, str], stderr: TextIO) -> None:
    per_host: dict[str, int] = {}
    workers = [s for s in slots if s.role == WORKER]
    for slot in workers:
        per_host[slot.host] = per_host.get(slot.host, 0) + 1
    hosts = ",".join(f"{h}:{n}" for h, n in per_host.items())
    print(
        f"hora run: {len(workers)} ranks on {hosts}, launcher {config.launcher}, controller {config.controller}, "
        f"rendezvous {env[envvars.HORA_RENDEZVOUS_ADDR]}:{env[envvars.HORA_RENDEZVOUS_PORT]}",
        file=stderr,
        flush=True,
    )
    others = [f"{s.name} on {s.host}" for s in slots if s.role != WORKER]
    if others:
        print(
            f"hora run: {', '.join(others)}; "
            f"scheduler at {env[envvars.DMLC_PS_ROOT_URI]}:{env[envvars.DMLC_PS_ROOT_PORT]}",
            file=stderr, flush=True,
        )


@contextlib.contextmanager
def _route_signals() -> Iterator[Interrupt]:
    """Route SIGINT/SIGTERM/SIGHUP to an :class:`Interrupt` while the job runs.

    Handlers can only be installed from the main thread; from another thread
    (``hora.run`` called in a worker thread) signals keep their handlers.
    """
    interrupt = Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield interrupt
        return
    previous = {signum: signal.signal(signum, interrupt) for signum in HANDLED_SIGNALS}
    try:
        yield interrupt
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
