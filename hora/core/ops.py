"""Collective kinds and reduction operators shared by every layer."""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """Reduction operator of an allreduce or reducescatter.

    ``AVERAGE`` is carried out as ``SUM`` followed by a division by the
    number of ranks in the process set.  ``ADASUM`` is part of the API for
    Horovod compatibility and is refused with a clear error.
    """

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


class CollectiveType(enum.IntEnum):
    """What a request asks the engine to do."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_PROCESS_SET = 7
    REMOVE_PROCESS_SET = 8

    @property
    def label(self) -> str:
        return self.name.lower()
