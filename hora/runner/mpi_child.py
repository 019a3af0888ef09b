"""The per-rank wrapper the mpi and slurm launchers run under mpirun or srun.

``mpirun ... python -m hora.runner.mpi_child -- CMD ARGS`` (or ``srun ...``)
starts this module once per rank.  It runs ``CMD`` as a child that inherits
the environment (so the child's ``MPI_Init`` joins the job exactly as if
mpirun had started it; under srun with gloo, ``GLOO_SOCKET_IFNAME`` is added
for the interface that reaches rank 0 unless one was chosen), prefixes each
line of the child's output with ``[rank]<stdout>:`` or ``[rank]<stderr>:``
like the local launcher does, and, when the child has
ended, writes one marker line to stderr that tells ``hora run`` how the rank
ended (``__hora_rank_exit__ {json}``); the launcher uses the first failure
among those as the root cause.

Signals: the child runs in its own process group and the wrapper forwards
SIGINT/SIGTERM/SIGHUP/SIGUSR1/SIGUSR2 to that group, so the child gets each
signal exactly once.  If the wrapper itself is killed, Linux's parent-death
signal kills the child too, and the wrapper gets SIGTERM if mpirun's daemon
dies first.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import BinaryIO

from hora import envvars
from hora.runner.agent import default_gloo_interface
from hora.runner.launchers.base import exit_status, parent_death_signal, signal_group
from hora.runner.output import prefix

MARKER = b"__hora_rank_exit__ "
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def rank_from_env(env: dict[str, str] | os._Environ) -> int:
    """This process's rank under mpirun (Open MPI, PMIx or MPICH variables) or srun."""
    for name in envvars.MPI_RANK_VARIABLES:
        if env.get(name, "").isdigit():
            return int(env[name])
    names = ", ".join(envvars.MPI_RANK_VARIABLES)
    raise SystemExit(f"hora.runner.mpi_child: none of {names} is set; run it under mpirun")


def marker_line(rank: int, returncode: int, stopped: bool) -> bytes:
    """The line that reports how a rank ended to the launcher."""
    record = {"rank": rank, "returncode": returncode, "stopped": stopped, "host": socket.gethostname()}
    return MARKER + json.dumps(record).encode() + b"\n"


def parse_marker(line: bytes) -> dict | None:
    """The record in a marker line, or None if ``line`` is not one."""
    # mpirun's own messages share the stream: its MPI_ABORT banner ends in a NUL byte that lands before the marker.
    # A rank's output never can: mpirun tags each of its lines with [rank]<stream>: first.
    line = line.lstrip(b" \t\0")
    if not line.startswith(MARKER):
        return None
    try:
        record = json.loads(line[len(MARKER):])
        return record if isinstance(record, dict) and "rank" in record else None
    except ValueError:
        return None


def _relay(source: BinaryIO, target: BinaryIO, line_prefix: bytes) -> threading.Thread:
    def run() -> None:
        try:
            for line in iter(source.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                target.write(line_prefix + line)
                target.flush()
        except (OSError, ValueError):
            pass  # our stdout went away; the child still runs to completion

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def run_child(command: Sequence[str], rank: int) -> int:
    """Run ``command`` as this rank's child, relay its output, return our exit status."""
    arm_term = parent_death_signal(signal.SIGTERM)
    if arm_term is not None:
        arm_term()
    arm_kill = parent_death_signal(signal.SIGKILL)
    stopped: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        stopped.append(signum)
        if proc is not None:
            signal_group(proc.pid, signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    if os.getppid() == 1:  # mpirun's daemon died before we armed the death signal
        stopped.append(signal.SIGTERM)
        return 128 + signal.SIGTERM

    def child_setup() -> None:  # runs in the forked child before exec
        os.setpgid(0, 0)
        if arm_kill is not None:
            arm_kill()

    err = sys.stderr.buffer
    env = dict(os.environ)
    if env.get(envvars.HORA_CONTROLLER) == "gloo":  # under srun: gloo must be told which interface reaches rank 0
        default_gloo_interface(env)
    try:
        proc = subprocess.Popen(
            list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=child_setup, env=env
        )
    except OSError as e:
        err.write(prefix(rank, "stderr") + f"hora: cannot start {command[0]!r}: {e.strerror or e}\n".encode())
        err.write(marker_line(rank, 127, False))
        err.flush()
        return 127
    relays = [
        _relay(proc.stdout, sys.stdout.buffer, prefix(rank, "stdout")),  # type: ignore[arg-type]
        _relay(proc.stderr, err, prefix(rank, "stderr")),  # type: ignore[arg-type]
    ]
    if stopped:  # a signal arrived while we were starting the child
        signal_group(proc.pid, stopped[-1])
    returncode = proc.wait()
    for thread in relays:
        thread.join(2.0)
    try:
        err.write(marker_line(rank, returncode, bool(stopped)))
        err.flush()
    except OSError:
        pass
    return exit_status(returncode)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m hora.runner.mpi_child -- CMD ARGS``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m hora.runner.mpi_child -- CMD [ARGS...]", file=sys.stderr)
        return 2
    return run_child(args, rank_from_env(os.environ))


if __name__ == "__main__":
    sys.exit(main())
