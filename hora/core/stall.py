"""Stall detection: naming the ranks that have not submitted what the others wait for.

A collective that some ranks submitted and others did not never becomes
ready; the engine would wait forever.  The :class:`StallMonitor` decides when
a round should also exchange how long each pending request has waited (the
engine adds that to the round's second phase), turns those ages into a
warning that names the missing ranks, and past
``HORA_STALL_SHUTDOWN_TIME_SECONDS`` gives up with a :class:`StallError` on
every rank instead of hanging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora import envvars
from hora.config import EngineConfig
from hora.errors import HoraError, ShutdownError, StallError

log = logging.getLogger(__name__)

#: how long a shutdown waits for the other ranks to join the final round.
SHUTDOWN_GRACE_S = 10.0


class Abandon(Exception):
    """Raised from inside a negotiation wait to give up on the round; ``args[0]`` is the error to report."""

    def __init__(self, error: HoraError) -> None:
        super().__init__(error)
        self.error = error


class StallMonitor:
    """Stall warnings and the stall deadline for one engine.

    Args:
        config: the engine's knobs (``stall_check_seconds``, ``stall_shutdown_seconds``).
        rank: this process's rank, for messages.
    """

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.check_s = config.stall_check_seconds
        self.deadline_s = config.stall_shutdown_seconds
        self.rank = rank
        self._warned_at = 0.0
        self._next_scan = 0.0

    def due(self, now: float, submitted_at: Sequence[float]) -> bool:
        """True when this round should gather every rank's pending ages (the oldest is past the check time)."""
        limit = self.check_s
        if not limit or not submitted_at or now < self._next_scan:
            return False
        self._next_scan = now + min(1.0, limit / 4)
        if now - min(submitted_at) < limit or now - self._warned_at < limit:
            return False
        self._warned_at = now
        return True

    def report(
        self, ages_by_rank: Sequence[Mapping[str, float] | None], joined: set[int],
        members_of: Callable[[str], Sequence[int]],
    ) -> None:
        """Warn about requests that some members have not submitted; raise :class:`Abandon` past the deadline.

        Args:
            ages_by_rank: per rank, how long each of its pending requests has waited (None: nothing sent).
            joined: ranks that have called join() and so submit nothing.
            members_of: the ranks of a request's process set.
        """
        waiting: dict[str, tuple[set[int], float]] = {}
        for r, ages in enumerate(ages_by_rank):
            for name, age in (ages or {}).items():
                ranks, oldest = waiting.get(name, (set(), 0.0))
                ranks.add(r)
                waiting[name] = (ranks, max(oldest, age))
        lines = []
        worst = 0.0
        for name, (ranks, age) in sorted(waiting.items()):
            missing = sorted(set(members_of(name)) - ranks - joined)
            if missing:
                worst = max(worst, age)
                lines.append(f"  {name!r}: submitted by ranks {sorted(ranks)}, missing ranks {missing} "
                             f"(waiting {age:.0f} s)")
        if not lines:
            return
        if self.rank == 0 or any(self.rank in ranks for ranks, _ in waiting.values()):
            log.warning(
                "hora: one or more collectives were submitted by some ranks but not others for more than "
                "%.0f s; the missing ranks are probably on a different code path:\n%s",
                self.check_s, "\n".join(lines),
            )
        if self.deadline_s and worst >= self.deadline_s:
            raise Abandon(StallError(
                f"collectives stalled for more than the stall deadline ({self.deadline_s:.0f} s, "
                f"{envvars.HORA_STALL_SHUTDOWN_TIME_SECONDS}):\n" + "\n".join(lines)))

    def while_waiting(self, waited: float, pending: Sequence[str], shutting_down: bool) -> None:
        """Called while a negotiation round waits for the other ranks; raises :class:`Abandon` to give up."""
        if shutting_down and waited > SHUTDOWN_GRACE_S:
            raise Abandon(ShutdownError(
                f"shutdown() gave up after {waited:.0f} s: other ranks did not join the final round"))
        if self.deadline_s and waited > self.deadline_s:
            raise Abandon(StallError(
                f"rank {self.rank} waited {waited:.0f} s for the other ranks to negotiate {sorted(pending)[:8]}; "
                "they never answered (a rank may have died or be stuck outside hora). Deadline: "
                f"{envvars.HORA_STALL_SHUTDOWN_TIME_SECONDS}"))
        if self.check_s and waited > self.check_s and time.monotonic() - self._warned_at > self.check_s:
            self._warned_at = time.monotonic()
            log.warning("hora: rank %d has waited %.0f s for other ranks to negotiate %s", self.rank, waited,
                        sorted(pending)[:8])


def ages(pending: Mapping[str, Any], now: float) -> dict[str, float]:
    """How long each pending request has waited (``submitted_at`` of each value)."""
    return {name: now - req.submitted_at for name, req in pending.items()}
