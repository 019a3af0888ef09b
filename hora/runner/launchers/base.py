"""What every launcher shares: the process plan, exit records, fail-fast supervision.

What a launcher is, and how launchers are found, is
:mod:`hora.runner.launchers.registry`.

A job's processes are :class:`Slot` s: the workers (ranks) and, with
parameter servers, one scheduler and the servers, each named by its key
(:mod:`hora.runner.keys`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from hora import envvars
from hora.placement import Placement
from hora.runner.keys import SERVER, WORKER, Key, process_key, process_name

_PR_SET_PDEATHSIG = 1  # prctl's option number (linux/prctl.h)

if TYPE_CHECKING:
    from hora.runner.output import OutputSink

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Slot(Placement):
    """One process of a job: its :class:`~hora.placement.Placement` and its role.

    For a worker the placement is its rank's.  For a server, ``rank`` is
    its index among the ``size`` servers; the scheduler has rank 0 of 1.
    """

    role: str = WORKER

    @classmethod
    def worker(cls, placement: Placement) -> Slot:
        """The worker process of a rank placed by :func:`hora.placement.place_ranks`."""
        return cls(**dataclasses.asdict(placement))

    @property
    def key(self) -> Key:
        """The rank for a worker, ``"server N"`` or ``"scheduler"`` otherwise (see :mod:`hora.runner.keys`)."""
        return process_key(self.role, self.rank)

    @property
    def name(self) -> str:
        """``"rank 3"``, ``"server 0"`` or ``"scheduler"``, for messages."""
        return process_name(self.role, self.rank)

    def env(self, *, host: bool = True) -> dict[str, str]:
        """The process-specific part of the environment.

        Workers get their placement's variables (:meth:`Placement.env`).
        Servers and the scheduler get their ``DMLC_ROLE`` and a server its
        launch index, ``HORA_PS_SERVER_INDEX`` (the shared ``DMLC_*``
        variables, with ``DMLC_ROLE=worker``, are in the job's environment,
        see :mod:`hora.runner.env`).
        """
        if self.role == WORKER:
            return Placement.env(self, host=host)
        env = {envvars.DMLC_ROLE: self.role}
        if self.role == SERVER:
            env[envvars.HORA_PS_SERVER_INDEX] = str(self.rank)  # so "[server i]" logs as server i
        return env


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Endpoints:
    """Where a job's processes meet.

    Attributes:
        addr: rank 0's host address: the rendezvous store and the PS scheduler listen there.
        port: the rendezvous port.
        ps_port: the scheduler's port (``DMLC_PS_ROOT_PORT``), with parameter servers.
        host_addrs: each host's own address, for multi-host jobs (``DMLC_NODE_HOST``).
    """

    addr: str
    port: int
    ps_port: int | None = None
    host_addrs: Mapping[str, str] = dataclasses.field(default_factory=dict)


def describe_returncode(returncode: int) -> str:
    """``"exited with code 3"`` or ``"was killed by signal SIGKILL (9)"`` (Popen convention)."""
    if returncode < 0:
        return f"was killed by signal {signal_name(-returncode)} ({-returncode})"
    return f"exited with code {returncode}"


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, ``signal 99`` for an unknown number."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_status(returncode: int) -> int:
    """The launcher's own exit code for a worker's Popen return code (128+N for signal N)."""
    if returncode < 0:
        return 128 + (-returncode)
    return returncode if 0 <= returncode < 256 else 1


def new_group_kwargs() -> dict[str, object]:
    """Popen arguments that start the child as the leader of a new process group."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"start_new_session": True}


def parent_death_signal(signum: int) -> Callable[[], None] | None:
    """A function that asks the kernel to send ``signum`` to the calling process when the thread that started
    it ends (Linux's ``PR_SET_PDEATHSIG``), so that a rank or daemon cannot outlive what launched it; call it in
    the process itself, or pass it as ``preexec_fn`` to run it in a child before exec.  None where Linux's
    prctl is not available.  The C library is loaded here, in the parent, not in the forked child.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)

    return arm


def signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to a process group; False if the group is already gone."""
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False
    except PermissionError as e:  # a reused group id we do not own: never ours
        logger.debug("not signalling group %d: %s", pgid, e)
        return False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankExit:
    """How one process (a rank, a server or the scheduler) ended.

    Attributes:
        rank: the rank (for a server, its index).
        host: where it ran.
        returncode: Popen convention: ``-N`` means killed by signal N.
        stopped: True when the launcher had already begun stopping the job,
            so this exit is a consequence, not a cause.
        stderr_tail: the last lines the process wrote to stderr.
        role: ``worker``, ``server`` or ``scheduler``.
        note: why the launcher lost track of it, when it did not see it exit
            (e.g. the ssh connection to its host broke).
    """

    rank: int
    host: str
    returncode: int
    stopped: bool = False
    stderr_tail: tuple[str, ...] = ()
    role: str = WORKER
    note: str = ""

    @property
    def failed(self) -> bool:
        """Whether the process ended with a non-zero code or a signal."""
        return self.returncode != 0

    @property
    def key(self) -> Key:
        """See :attr:`Slot.key`."""
        return process_key(self.role, self.rank)

    @property
    def name(self) -> str:
        """``"rank 1"``, ``"server 0"`` or ``"scheduler"``."""
        return process_name(self.role, self.rank)

    def describe(self) -> str:
        """``"rank 1 on host exited with code 3"`` (or killed by a signal, or lost with a note)."""
        text = f"{self.name} on {self.host} {describe_returncode(self.returncode)}"
        return f"{text} ({self.note})" if self.note else text


@dataclasses.dataclass(kw_only=True, slots=True)
class JobResult:
    """The outcome of a launch.

    Attributes:
        exit_code: what ``hora run`` exits with (0 on success).
        root_cause: the first process that failed on its own, if any.
        interrupted_by: the signal that stopped the launcher, if any.
        exits: every process exit the launcher observed, by key (rank for workers).
        message: a launcher-level failure with no rank to blame (e.g. mpirun
            itself failed), with ``details`` lines to show under it.
    """

    exit_code: int
    root_cause: RankExit | None = None
    interrupted_by: int | None = None
    exits: dict[Key, RankExit] = dataclasses.field(default_factory=dict)
    message: str | None = None
    details: tuple[str, ...] = ()


class Interrupt:
    """Signals received by the launcher, polled by the supervision loop.

    The signal handler only appends to a list: anything more (locks, queues)
    could deadlock when the handler runs while the main thread holds them.
    """

    def __init__(self) -> None:
        self._pending: list[int] = []
        self.received: list[int] = []

    def __call__(self, signum: int, frame: object = None) -> None:
        self._pending.append(signum)

    def pop(self) -> int | None:
        """The oldest unhandled signal, or None."""
        if not self._pending:
            return None
        signum = self._pending.pop(0)
        self.received.append(signum)
        return signum


#: How often supervision loops look at exits, signals and deadlines.
POLL_SECONDS = 0.05


class Supervisor:
    """Fail-fast supervision shared by the launchers that start processes themselves.

    It records exits, names the root cause (the first process that failed
    while nobody was stopping the job), stops everything on the first failure
    or on a signal (the signal, then SIGKILL after the grace period), and,
    when every worker has exited 0, gives servers and the scheduler
    ``server_grace`` seconds to exit on their own before stopping them;
    the job then succeeds.  Subclasses say how exits arrive (:meth:`wait`)
    and how processes are signalled (:meth:`deliver`).
    """

    def __init__(
        self,
        slots: Sequence[Slot],
        sink: OutputSink,
        interrupt: Interrupt,
        grace_period: float,
        server_grace: float,
    ) -> None:
        self.slots: dict[Key, Slot] = {s.key: s for s in slots}
        self.sink = sink
        self.interrupt = interrupt
        self.grace_period = grace_period
        self.server_grace = server_grace
        self.exits: dict[Key, RankExit] = {}
        self.root_cause: RankExit | None = None
        self.interrupted_by: int | None = None
        self.stopping_since: float | None = None
        self.killed_at: float | None = None
        self.workers_done_at: float | None = None
        self.message: str | None = None
        self.details: tuple[str, ...] = ()

    # -- what subclasses provide --

    def wait(self, timeout: float) -> list[tuple[Key, int, str]]:
        """Exits that happened, as ``(key, returncode, note)``, waiting up to ``timeout``."""
        raise NotImplementedError

    def deliver(self, keys: Sequence[Key], signum: int) -> None:
        """Send ``signum`` to the processes ``keys`` (and whatever they started)."""
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Called every poll; a subclass may give up on unresponsive processes here."""

    def finish(self) -> None:
        """Called once every process has ended (e.g. to kill leftovers of stopped groups)."""

    # -- the loop --

    def run(self) -> JobResult:
        """Supervise until every process has ended; return the outcome."""
        while len(self.exits) < len(self.slots):
            self._handle_signals()
            for key, returncode, note in self.wait(POLL_SECONDS):
                self.record(key, returncode, note)
            now = time.monotonic()
            self._check_deadlines(now)
            self.tick(now)
        self.finish()
        return JobResult(
            exit_code=self._exit_code(),
            root_cause=self.root_cause,
            interrupted_by=self.interrupted_by,
            exits=dict(sorted(self.exits.items(), key=lambda item: _key_order(item[0]))),
            message=self.message,
            details=self.details,
        )

    @property
    def stopping(self) -> bool:
        """Whether the launcher has begun stopping the job (failure, signal or workers done)."""
        return self.stopping_since is not None

    def running(self) -> list[Key]:
        """Keys of the processes that have not ended."""
        return [key for key in self.slots if key not in self.exits]

    def record(self, key: Key, returncode: int, note: str = "") -> None:
        """Take note that ``key`` ended; the first failure stops the job."""
        if key in self.exits or key not in self.slots:
            return
        slot = self.slots[key]
        exit_ = RankExit(
            rank=slot.rank, role=slot.role, host=slot.host, returncode=returncode, stopped=self.stopping,
            stderr_tail=tuple(self.sink.tail(key)), note=note,
        )
        self.exits[key] = exit_
        logger.debug("%s ended: returncode %d", slot.name, returncode)
        if exit_.failed and not self.stopping:
            self.root_cause = exit_
            self.stop(signal.SIGTERM)
        elif self.workers_done_at is None and not self.stopping and self._workers_succeeded():
            self.workers_done_at = time.monotonic()

    def stop(self, signum: int) -> None:
        """Begin stopping every process that still runs."""
        self.stopping_since = time.monotonic()
        running = self.running()
        if running:
            self.deliver(running, signum)

    def kill_all(self) -> None:
        """SIGKILL every process that still runs."""
        self.killed_at = time.monotonic()
        running = self.running()
        if running:
            self.deliver(running, signal.SIGKILL)

    def _handle_signals(self) -> None:
        signum = self.interrupt.pop()
        if signum is None:
            return
        if self.stopping:
            self.kill_all()  # a second signal while stopping: the user does not want to wait
            return
        self.interrupted_by = signum
        logger.info("received %s: forwarding it to all processes", signal_name(signum))
        self.stop(signum)

    def _check_deadlines(self, now: float) -> None:
        if self.stopping_since is not None:
            if self.killed_at is None and now - self.stopping_since >= self.grace_period:
                self.kill_all()
        elif self.workers_done_at is not None and now - self.workers_done_at >= self.server_grace:
            logger.info("all workers finished; stopping the servers and the scheduler")
            self.stop(signal.SIGTERM)

    def _workers_succeeded(self) -> bool:
        workers = [k for k, s in self.slots.items() if s.role == WORKER]
        return all(k in self.exits and not self.exits[k].failed for k in workers)

    def _exit_code(self) -> int:
        if self.root_cause is not None:
            return exit_status(self.root_cause.returncode)
        if self.interrupted_by is not None:
            return 128 + self.interrupted_by
        failed = [e for e in self.exits.values() if e.failed and (e.role == WORKER or not e.stopped)]
        if failed:
            return exit_status(failed[0].returncode)
        return 1 if self.message else 0


def _key_order(key: Key) -> tuple[int, int | str]:
    return (0, key) if isinstance(key, int) else (1, key)
