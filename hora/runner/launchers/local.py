"""The local launcher: every rank is a child process of ``hora run`` on this machine.

Each worker runs in its own process group, so a signal meant for a worker
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
from hora.runner.config import LaunchConfig
from hora.runner.launchers.base import (
    Interrupt,
    JobResult,
    RankExit,
    Slot,
    exit_status,
    new_group_kwargs,
    signal_group,
    signal_name,
)
from hora.runner.output import STREAMS, OutputSink, pump

logger = logging.getLogger(__name__)

#: How long to wait for a finished worker's last output before reporting on it.
OUTPUT_DRAIN_SECONDS = 2.0
POLL_SECONDS = 0.05


@dataclasses.dataclass(slots=True)
class _Worker:
    slot: Slot
    proc: subprocess.Popen
    pumps: list[threading.Thread]

    def signal(self, signum: int) -> None:
        # The worker leads its own group (pgid == pid); signal the whole group.
        signal_group(self.proc.pid, signum)

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.pumps:
            thread.join(max(0.0, deadline - time.monotonic()))


class LocalLauncher:
    """Runs every rank as a child process of the launcher (see :class:`Launcher`)."""

    name = "local"

    def run(
        self,
        config: LaunchConfig,
        slots: Sequence[Slot],
        env: Mapping[str, str],
        sink: OutputSink,
        interrupt: Interrupt,
    ) -> JobResult:
        """Start one process per slot and supervise them until all have ended."""
        exited: queue.Queue[tuple[int, int]] = queue.Queue()
        workers: list[_Worker] = []
        try:
            for slot in slots:
                workers.append(self._start(config.command, slot, env, sink, exited))
        except BaseException:
            for worker in workers:
                worker.signal(signal.SIGKILL)
            raise
        return _Supervisor(workers, exited, sink, interrupt, config.grace_period).run()

    @staticmethod
    def _start(
        command: Sequence[str],
        slot: Slot,
        env: Mapping[str, str],
        sink: OutputSink,
        exited: queue.Queue[tuple[int, int]],
    ) -> _Worker:
        worker_env = dict(env)
        worker_env.update(slot.env())
        try:
            proc = subprocess.Popen(
                list(command),
                env=worker_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                close_fds=True,
                **new_group_kwargs(),
            )
        except OSError as e:
            raise LaunchError(f"cannot start {command[0]!r} for rank {slot.rank}: {e.strerror or e}") from e
        logger.debug("rank %d started as pid %d", slot.rank, proc.pid)
        pumps = [
            pump(getattr(proc, stream), lambda line, s=stream: sink.emit(slot.rank, s, line)) for stream in STREAMS
        ]

        def wait() -> None:
            exited.put((slot.rank, proc.wait()))

        threading.Thread(target=wait, name=f"hora-wait-{slot.rank}", daemon=True).start()
        return _Worker(slot, proc, pumps)


class _Supervisor:
    """Waits for the workers; on the first failure or a signal, stops the rest."""

    def __init__(
        self,
        workers: list[_Worker],
        exited: queue.Queue[tuple[int, int]],
        sink: OutputSink,
        interrupt: Interrupt,
        grace_period: float,
    ) -> None:
        self.workers = {w.slot.rank: w for w in workers}
        self.exited = exited
        self.sink = sink
        self.interrupt = interrupt
        self.grace_period = grace_period
        self.exits: dict[int, RankExit] = {}
        self.root_cause: RankExit | None = None
        self.interrupted_by: int | None = None
        self.stopping_since: float | None = None
        self.killed = False

    def run(self) -> JobResult:
        while len(self.exits) < len(self.workers):
            self._handle_signals()
            try:
                rank, returncode = self.exited.get(timeout=POLL_SECONDS)
            except queue.Empty:
                pass
            else:
                self._record(rank, returncode)
            if self.stopping_since is not None and not self.killed:
                if time.monotonic() - self.stopping_since >= self.grace_period:
                    self._kill_all()
        if self.stopping_since is not None:
            for worker in self.workers.values():  # leftovers in the workers' groups
                worker.signal(signal.SIGKILL)
        return JobResult(
            exit_code=self._exit_code(),
            root_cause=self.root_cause,
            interrupted_by=self.interrupted_by,
            exits=dict(sorted(self.exits.items())),
        )

    def _handle_signals(self) -> None:
        signum = self.interrupt.pop()
        if signum is None:
            return
        if self.stopping_since is not None:
            # A second signal while stopping: the user does not want to wait.
            self._kill_all()
            return
        self.interrupted_by = signum
        logger.info("received %s: forwarding it to all workers", signal_name(signum))
        self._stop(signum)

    def _record(self, rank: int, returncode: int) -> None:
        worker = self.workers[rank]
        worker.drain(OUTPUT_DRAIN_SECONDS)
        record = RankExit(
            rank=rank,
            host=worker.slot.host,
            returncode=returncode,
            stopped=self.stopping_since is not None,
            stderr_tail=tuple(self.sink.tail(rank)),
        )
        self.exits[rank] = record
        logger.debug("rank %d ended: returncode %d", rank, returncode)
        if record.failed and self.stopping_since is None:
            self.root_cause = record
            self._stop(signal.SIGTERM)

    def _stop(self, signum: int) -> None:
        self.stopping_since = time.monotonic()
        for rank, worker in self.workers.items():
            if rank not in self.exits:
                worker.signal(signum)

    def _kill_all(self) -> None:
        self.killed = True
        for rank, worker in self.workers.items():
            if rank not in self.exits:
                worker.signal(signal.SIGKILL)

    def _exit_code(self) -> int:
        if self.root_cause is not None:
            return exit_status(self.root_cause.returncode)
        if self.interrupted_by is not None:
            return 128 + self.interrupted_by
        failed = [e for e in self.exits.values() if e.failed]
        return exit_status(failed[0].returncode) if failed else 0
