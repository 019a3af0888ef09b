"""The interface every collective backend implements.

A backend moves bytes; the engine decides what to move.  All calls come from
the engine's background thread, one at a time, on flat contiguous buffers of
an array family (:mod:`hora.core.buffers`): NumPy arrays or torch CPU
tensors for the CPU backends, CUDA tensors for NCCL.  ``group`` arguments are the backend's own handle
for a process set, made by :meth:`Backend.new_group`; ``None`` is the global
set.  Roots and counts are indexed by rank *within* the group.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora.core.buffers import ARITHMETIC_DTYPES, Array
from hora.core.ops import ReduceOp


class Backend(abc.ABC):
    """A collective engine (MPI, gloo, NCCL) bound to one set of processes."""

    name: str = "?"
    #: dtype names this backend can reduce without conversion.
    reduce_dtypes: frozenset[str] = ARITHMETIC_DTYPES
    #: tensors at least this many bytes are reduced in place rather than fused.
    direct_threshold_bytes: int = 1 << 20
    #: True when :meth:`allreduce_start` returns before the reduction is done,
    #: so that several allreduces of a round can be in flight together.
    concurrent: bool = False
    #: with ``concurrent``, fused buckets are cut at this size, so that packing
    #: one overlaps the reduction of the one before.
    bucket_bytes: int | None = None

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    # --- control plane (global group, negotiation) -----------------------------------
    @abc.abstractmethod
    def negotiate(self, vector: np.ndarray, poll: Callable[[float], None], spin_s: float = 200e-6) -> np.ndarray:
        """Sum an int64 vector over all ranks, calling ``poll(waited_s)`` while waiting.

        The wait spins for ``spin_s`` before it starts sleeping (see
        :func:`wait_with_backoff`).

        ``poll`` may raise to abandon the wait (stall deadline, shutdown);
        it is how a round that other ranks never join is reported instead of
        hanging.
        """

    @abc.abstractmethod
    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Gather one byte string from every rank, in rank order."""

    # --- data plane ------------------------------------------------------------------
    @abc.abstractmethod
    def allreduce_(self, buf: Array, op: ReduceOp, group: Any = None) -> None:
        """Reduce ``buf`` in place across the group (op is SUM, MIN, MAX or PRODUCT)."""

    def allreduce_start(
        self, buf: Array, op: ReduceOp, group: Any = None, fanout: int = 1
    ) -> Callable[[], None]:
        """Start reducing ``buf`` in place; returns the call that waits for the result.

        ``buf`` must not be touched until that call returns.  The default
        reduces at once (the returned wait does nothing); backends with
        ``concurrent`` set return as soon as the collective is queued.
        ``fanout`` is how many allreduces the round keeps in flight together
        (the same on every rank), for a backend that spreads them out.
        """
        self.allreduce_(buf, op, group)
        return nothing

    @abc.abstractmethod
    def allgatherv(self, send: Array, recv: Array, counts: Sequence[int], group: Any = None) -> None:
        """Concatenate every rank's ``send`` (``counts[r]`` elements) into ``recv``."""

    @abc.abstractmethod
    def broadcast_(self, buf: Array, root: int, group: Any = None) -> None:
        """Overwrite ``buf`` on every rank with the root's."""

    @abc.abstractmethod
    def alltoallv(
        self,
        send: Array,
        send_counts: Sequence[int],
        recv: Array,
        recv_counts: Sequence[int],
        group: Any = None,
    ) -> None:
        """Send ``send_counts[r]`` elements to rank r, receive ``recv_counts[r]`` from it."""

    @abc.abstractmethod
    def reduce_scatterv(
        self, send: Array, recv: Array, counts: Sequence[int], op: ReduceOp, group: Any = None
    ) -> None:
        """Reduce ``send`` across the group; rank r keeps block r (``counts[r]`` elements)."""

    # --- groups and lifetime ---------------------------------------------------------
    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int], group_id: int) -> Any:
        """Create the backend's communicator for a process set (collective over all ranks)."""

    def free_group(self, group: Any) -> None:  # noqa: B027 - optional hook
        """Release a process set's communicator."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the backend's resources; the process may init a new backend afterwards."""

    def supports_device(self, device_type: str) -> bool:
        """True when this backend moves buffers on devices of this type (``cpu``, ``cuda``)."""
        return device_type == "cpu"


def nothing() -> None:
    """The wait of a collective that finished when it was started."""
    pass


def wait_with_backoff(is_done: Callable[[], bool], poll: Callable[[float], None], spin_s: float = 200e-6) -> None:
    """Wait for ``is_done()``, spinning first and sleeping after.

    A round usually completes within microseconds when every rank is ready,
    and for MPI each ``is_done()`` call also drives progress, so the wait
    first spins for ``spin_s``.  A thread that sleeps gives its core away and
    may wait a scheduler tick to get it back, so a caller with nothing else
    to do (a synchronous collective) spins for longer; the engine thread,
    which shares the CPU with the training loop, spins briefly.  After the
    spin the wait sleeps in steps growing to 0.2 ms.  ``poll(waited_s)`` runs
    every 0.1 s and may raise to abandon the wait.
    """
    if is_done():
        return
    start = time.perf_counter()
    spin_until = start + spin_s
    next_poll = start + 0.1
    while True:
        now = time.perf_counter()
        if now >= spin_until:
            break
        if is_done():
            return
        if now >= next_poll:
            poll(now - start)
            next_poll = now + 0.1
    delay = 10e-6
    while not is_done():
        time.sleep(delay)
        delay = min(delay * 1.5, 200e-6)
        now = time.perf_counter()
        if now >= next_poll:
            poll(now - start)
            next_poll = now + 0.1
