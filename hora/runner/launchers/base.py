"""What every launcher shares: the rank plan, exit records and the launcher protocol."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hora.runner.config import HostSlots, LaunchConfig
    from hora.runner.output import OutputSink

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Slot:
    """Where one rank runs and its place in the job (the ``HORA_*`` rank variables)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: str

    def env(self) -> dict[str, str]:
        """The rank-specific part of a worker's environment.

        The ``HOROVOD_*`` copies are what horovodrun exports; scripts and test
        suites written for Horovod read them.
        """
        values = {
            "RANK": str(self.rank),
            "SIZE": str(self.size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_SIZE": str(self.local_size),
            "CROSS_RANK": str(self.cross_rank),
            "CROSS_SIZE": str(self.cross_size),
            "HOSTNAME": self.host,
        }
        env = {f"HORA_{k}": v for k, v in values.items()}
        env.update({f"HOROVOD_{k}": v for k, v in values.items()})
        return env


def assign_ranks(hosts: Sequence[HostSlots], num_proc: int) -> list[Slot]:
    """Fill hosts in order, each up to its slots, until ``num_proc`` ranks are placed."""
    placed: list[tuple[str, int]] = []  # (host, local count)
    left = num_proc
    for h in hosts:
        if left == 0:
            break
        take = min(h.slots, left)
        placed.append((h.host, take))
        left -= take
    slots: list[Slot] = []
    for cross_rank, (host, count) in enumerate(placed):
        for local_rank in range(count):
            slots.append(
                Slot(
                    rank=len(slots), size=num_proc, local_rank=local_rank, local_size=count,
                    cross_rank=cross_rank, cross_size=len(placed), host=host,
                )
            )
    return slots


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
    """How one rank ended.

    Attributes:
        rank: the rank.
        host: where it ran.
        returncode: Popen convention: ``-N`` means killed by signal N.
        stopped: True when the launcher had already begun stopping the job,
            so this exit is a consequence, not a cause.
        stderr_tail: the last lines the rank wrote to stderr.
    """

    rank: int
    host: str
    returncode: int
    stopped: bool = False
    stderr_tail: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        """Whether the rank ended with a non-zero code or a signal."""
        return self.returncode != 0

    def describe(self) -> str:
        """``"rank 1 on host exited with code 3"`` (or killed by a signal)."""
        return f"rank {self.rank} on {self.host} {describe_returncode(self.returncode)}"


@dataclasses.dataclass(kw_only=True, slots=True)
class JobResult:
    """The outcome of a launch.

    Attributes:
        exit_code: what ``hora run`` exits with (0 on success).
        root_cause: the first rank that failed on its own, if any.
        interrupted_by: the signal that stopped the launcher, if any.
        exits: every rank exit the launcher observed, by rank.
        message: a launcher-level failure with no rank to blame (e.g. mpirun
            itself failed), with ``details`` lines to show under it.
    """

    exit_code: int
    root_cause: RankExit | None = None
    interrupted_by: int | None = None
    exits: dict[int, RankExit] = dataclasses.field(default_factory=dict)
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


class Launcher(Protocol):
    """Starts the workers of a job, supervises them and reports how they ended.

    A launcher must: start ``len(slots)`` workers running ``config.command``
    with ``env`` plus the rank variables; print their output through ``sink``;
    stop every worker soon after the first one fails or after a signal is
    polled from ``interrupt`` (SIGTERM/SIGINT, then SIGKILL after
    ``config.grace_period``); and return a :class:`JobResult` whose
    ``root_cause`` is the first rank that failed on its own.
    """

    name: str

    def run(
        self,
        config: LaunchConfig,
        slots: Sequence[Slot],
        env: Mapping[str, str],
        sink: OutputSink,
        interrupt: Interrupt,
    ) -> JobResult: ...
