"""The engine's two optional hooks, as the engine sees them: a round recorder (the timeline) and a tuner (autotune).

:class:`hora.core.timeline.Timeline` and :class:`hora.core.autotune.Autotuner` are the implementations;
the engine and the executor only call what these protocols name, so tests can hand them small fakes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from hora.config import EngineConfig
    from hora.core.negotiation import NameCache, Ready
    from hora.core.ops import CollectiveType
    from hora.core.request import Request
    from hora.core.timeline import Bucket


class RoundRecorder(Protocol):
    """What the engine tells a recording, from whichever thread runs its round (never two at once).

    Every call must return at once: it runs on the engine's path.
    """

    mark_cycles: bool

    def cycle(self, at: float) -> None:
        """A round started at ``at`` (``time.monotonic()``)."""

    def observe_round(self, at: float, pending: Mapping[str, Request], cache: NameCache, totals: np.ndarray,
                      header: int, announcements: Sequence[Mapping[str, bytes]] | None,
                      members: Mapping[int, Sequence[int]], ready: Sequence[Ready]) -> None:
        """What one negotiation round showed (see :meth:`hora.core.timeline.Timeline.observe_round`)."""

    def buckets(self, done: list[Bucket]) -> None:
        """A round's allreduce buckets, in the order they ran."""

    def single(self, backend: str, kind: CollectiveType, name: str, start: float, done: float) -> None:
        """One collective other than an allreduce: when its backend call started and ended."""


class Tuner(Protocol):
    """Rank 0's autotuner, as the engine drives it in its negotiation rounds."""

    def proposal(self) -> dict[str, Any] | None:
        """Knobs every rank must switch to in this round (:meth:`hora.core.engine.Engine.retune`), or None."""

    def applied(self) -> None:
        """The round carrying :meth:`proposal` applied it on every rank."""

    def after_round(self, ready: Iterable[Ready]) -> None:
        """What a round executed."""

    def close(self) -> None:
        """The engine stops."""


class RecordedEngine(Protocol):
    """What :func:`hora.core.timeline.start` and ``stop`` need of an engine."""

    rank: int
    config: EngineConfig
    timeline: RoundRecorder | None

    def set_timeline(self, timeline: RoundRecorder | None) -> RoundRecorder | None:
        """Record into ``timeline`` from the next round on; returns the previous recorder."""
