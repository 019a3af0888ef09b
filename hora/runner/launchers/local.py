"""The local launcher: every process is a child of ``hora run`` on this machine.

Each process runs in its own process group, so a signal meant for a worker
also reaches whatever the worker started (a shell script's children, data
loader processes), and a Ctrl-C in the terminal reaches only the launcher,
which decides what to forward.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

from hora.errors import LaunchError
from hora.runner.env import Endpoints, local_endpoints
from hora.runner.keys import Key
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import Interrupt, JobResult, Slot, Supervisor, new_group_kwargs, signal_group
from hora.runner.launchers.registry import (
    MPI_ARGS_NEED_MPIRUN,
    MPI_NEEDS_MPIRUN,
    SYNC_NEEDS_SSH,
    Capabilities,
    Launcher,
    Request,
)
from hora.runner.output import STREAMS, OutputSink, pump
from hora.runner.plan import slot_command

logger = logging.getLogger(__name__)

#: How long to wait for a finished process's last output before reporting on it.
OUTPUT_DRAIN_SECONDS = 2.0


@dataclasses.dataclass(slots=True)
class _Process:
    slot: Slot
    proc: subprocess.Popen
    pumps: list[threading.Thread]

    def signal(self, signum: int) -> None:
        # The process leads its own group (pgid == pid); signal the whole group.
        signal_group(self.proc.pid, signum)

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.pumps:
            thread.join(max(0.0, deadline - time.monotonic()))


class LocalLauncher(Launcher):
    """Runs every process as a child of the launcher, on this machine (see :class:`Launcher`)."""

    name = "local"
    summary = "children of hora run on this machine"
    detects = "otherwise"
    priority = 100  # the fallback: every job can run here
    capabilities = Capabilities(servers=True, elastic=True, remote_hosts=False)
    refusals = {
        "controller": MPI_NEEDS_MPIRUN,
        "remote_hosts": ("--launcher local only starts processes on this machine, but the hosts include {remote!r}; "
                         "use --launcher ssh"),
        "sync_dst_dir": SYNC_NEEDS_SSH,
        "mpi_args": MPI_ARGS_NEED_MPIRUN,
    }

    @classmethod
    def detect(cls, request: Request) -> bool:
        """Always: a job that no other launcher claims runs here."""
        return True

    def prepare(self, config: LaunchConfig, slots: Sequence[Slot]) -> Endpoints:
        """Rank 0 listens on loopback (or the chosen interface); every host is this machine (checked by the config)."""
        return local_endpoints(config)

    def run(
        self,
        config: LaunchConfig,
        slots: Sequence[Slot],
        env: Mapping[str, str],
        sink: OutputSink,
        interrupt: Interrupt,
    ) -> JobResult:
        """Start one process per slot and supervise them until all have ended."""
        exited: queue.Queue[tuple[Key, int]] = queue.Queue()
        processes: list[_Process] = []
        try:
            for slot in slots:
                processes.append(self._start(slot_command(config, slot), slot, env, sink, exited))
        except BaseException:
            for process in processes:
                process.signal(signal.SIGKILL)
            raise
        return _LocalSupervisor(processes, exited, sink, interrupt, config).run()

    def close(self) -> None:
        """Nothing to release: every child has ended when :meth:`run` returns."""

    @staticmethod
    def _start(
        command: Sequence[str],
        slot: Slot,
        env: Mapping[str, str],
        sink: OutputSink,
        exited: queue.Queue[tuple[Key, int]],
    ) -> _Process:
        process_env = dict(env)
        process_env.update(slot.env())
        try:
            proc = subprocess.Popen(
                list(command),
                env=process_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                close_fds=True,
                **new_group_kwargs(),
            )
        except OSError as e:
            raise LaunchError(f"cannot start {command[0]!r} for {slot.name}: {e.strerror or e}") from e
        logger.debug("%s started as pid %d", slot.name, proc.pid)
        key = slot.key
        pumps = [pump(getattr(proc, stream), lambda line, s=stream: sink.emit(key, s, line)) for stream in STREAMS]

        def wait() -> None:
            exited.put((key, proc.wait()))

        threading.Thread(target=wait, name=f"hora-wait-{key}", daemon=True).start()
        return _Process(slot, proc, pumps)


class _LocalSupervisor(Supervisor):
    """Exits arrive from one waiter thread per child; signals go to the children's groups."""

    def __init__(
        self,
        processes: list[_Process],
        exited: queue.Queue[tuple[Key, int]],
        sink: OutputSink,
        interrupt: Interrupt,
        config: LaunchConfig,
    ) -> None:
        super().__init__(
            [p.slot for p in processes], sink, interrupt, config.grace_period, config.server_grace
        )
        self.processes = {p.slot.key: p for p in processes}
        self.exited = exited

    def wait(self, timeout: float) -> list[tuple[Key, int, str]]:
        try:
            key, returncode = self.exited.get(timeout=timeout)
        except queue.Empty:
            return []
        self.processes[key].drain(OUTPUT_DRAIN_SECONDS)
        return [(key, returncode, "")]

    def deliver(self, keys: Sequence[Key], signum: int) -> None:
        for key in keys:
            self.processes[key].signal(signum)

    def finish(self) -> None:
        if self.stopping:
            for process in self.processes.values():  # leftovers in the processes' groups
                process.signal(signal.SIGKILL)

