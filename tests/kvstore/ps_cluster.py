"""Start parameter-server jobs by hand for the tests: scheduler, servers and worker scripts.

Every role is started the MXNet way, with ``python -m hora.kvstore.ps.node``
(or the worker script) and the ``DMLC_*`` environment, which is also what
``hora run -s`` does.  :class:`Cluster` is a context manager: whatever it
started is killed on exit, so a failing test leaves no processes behind, and
every wait has a timeout, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "ps_workers.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Finished:
    """A finished process: its exit code and output."""

    returncode: int
    stdout: str
    stderr: str

    def lines(self, prefix: str) -> list[str]:
        return [line[len(prefix):].strip() for line in self.stdout.splitlines() if line.startswith(prefix)]


class Cluster:
    """A scheduler, ``servers`` servers and up to ``workers`` workers on localhost."""

    def __init__(self, tmp_path: Path, workers: int, servers: int, env: Mapping[str, str] | None = None,
                 secret: str = "test-secret") -> None:
        self.dir = tmp_path
        self.num_workers, self.num_servers = workers, servers
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("HORA_", "DMLC_", "OMPI_", "PMIX_", "MXNET_", "PS_"))}
        base.update({
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
            "DMLC_NUM_SERVER": str(servers), "DMLC_NUM_WORKER": str(workers), "HORA_SECRET": secret,
            "HORA_PS_TIMEOUT": "10", "HORA_PS_START_TIMEOUT": "60",
        })
        base.update(env or {})
        self.env = base
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.scheduler: subprocess.Popen | None = None
        self.servers: list[subprocess.Popen] = []

    # --- starting ---------------------------------------------------------------------------------
    def _start(self, name: str, args: Sequence[str], env: Mapping[str, str],
               wrap: Sequence[str] = ()) -> subprocess.Popen:
        out = open(self.dir / f"{name}.out", "w")
        err = open(self.dir / f"{name}.err", "w")
        proc = subprocess.Popen([*wrap, sys.executable, *args], env={**self.env, **env}, cwd=ROOT, stdout=out,
                                stderr=err, start_new_session=True)
        out.close()
        err.close()
        self.procs.append((name, proc))
        return proc

    def start_roles(self, scheduler_env: Mapping[str, str] | None = None,
                    server_env: Mapping[str, str] | None = None, server_index: Sequence[int] | None = None) -> Cluster:
        """Start the scheduler and the servers (the i-th with ``HORA_PS_SERVER_INDEX=server_index[i]`` when
        given, as the launcher sets it)."""
        self.scheduler = self._start("scheduler", ["-m", "hora.kvstore.ps.node"],
                                     {"DMLC_ROLE": "scheduler", **(scheduler_env or {})})
        for i in range(self.num_servers):
            index = {} if server_index is None else {"HORA_PS_SERVER_INDEX": str(server_index[i])}
            self.servers.append(self._start(f"server{i}", ["-m", "hora.kvstore.ps.node"],
                                            {"DMLC_ROLE": "server", **index, **(server_env or {})}))
        return self

    @property
    def shm_token(self) -> str:
        """The job part of this job's shared-memory segment names."""
        from hora.kvstore.ps import shm

        secret = self.env["HORA_SECRET"].encode()
        return shm.job_token(secret, f"tcp://127.0.0.1:{self.env['DMLC_PS_ROOT_PORT']}")

    def segments(self) -> list[str]:
        """This job's shared-memory segment names in /dev/shm now."""
        from hora.kvstore.ps import shm

        prefix = f"{shm.PREFIX}{self.shm_token}-"
        return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix))

    def start_worker(self, scenario: str, *args: str, rank: int | None = None,
                     env: Mapping[str, str] | None = None, wrap: Sequence[str] = ()) -> subprocess.Popen:
        """Start ``ps_workers.py SCENARIO ARGS`` as a worker (asking for ``rank`` when given), under the
        command ``wrap`` when given (such as ``unshare``)."""
        extra = {"DMLC_ROLE": "worker", **({"HORA_RANK": str(rank)} if rank is not None else {}), **(env or {})}
        index = sum(name.startswith("worker") for name, _ in self.procs)
        return self._start(f"worker{index}", [str(WORKERS), scenario, *args], extra, wrap)

    # --- waiting ----------------------------------------------------------------------------------
    def finish(self, proc: subprocess.Popen, timeout: float) -> Finished:
        """Wait for ``proc`` (killing it after ``timeout`` seconds, which fails the test) and read its output."""
        name = next(n for n, p in self.procs if p is proc)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            raise AssertionError(f"{name} did not finish within {timeout:.0f} s:\n{self.report()}") from None
        return Finished(proc.returncode, (self.dir / f"{name}.out").read_text(),
                        (self.dir / f"{name}.err").read_text())

    def run_workers(self, scenario: str, *args: str, timeout: float = 90, env: Mapping[str, str] | None = None,
                    ranks: bool = True) -> list[Finished]:
        """Start every worker with the same scenario and wait for all of them."""
        procs = [self.start_worker(scenario, *args, rank=r if ranks else None, env=env)
                 for r in range(self.num_workers)]
        deadline = time.monotonic() + timeout
        return [self.finish(p, max(1.0, deadline - time.monotonic())) for p in procs]

    def wait_roles(self, timeout: float = 30) -> list[int]:
        """Exit codes of the scheduler and the servers once they ended."""
        procs = [p for p in (self.scheduler, *self.servers) if p is not None]
        deadline = time.monotonic() + timeout
        return [self.finish(p, max(1.0, deadline - time.monotonic())).returncode for p in procs]

    def output(self, name: str) -> str:
        parts = []
        for ext in ("out", "err"):
            path = self.dir / f"{name}.{ext}"
            if path.exists():
                parts.append(f"--- {name}.{ext}\n{path.read_text()[-4000:]}")
        return "\n".join(parts)

    def report(self) -> str:
        """Everybody's output, for assertion messages."""
        return "\n".join(self.output(name) for name, _ in self.procs)

    # --- cleanup ----------------------------------------------------------------------------------
    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL one process (to simulate a crash)."""
        self._kill(proc)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for _, proc in self.procs:
            self._kill(proc)
