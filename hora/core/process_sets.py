"""Process sets: subsets of ranks that run collectives among themselves."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hora.errors import ConfigError


@dataclasses.dataclass(slots=True)
class ProcessSetState:
    """The engine's record of one registered process set."""

    id: int
    ranks: tuple[int, ...]  # global ranks, ascending
    groups: dict[str, Any] = dataclasses.field(default_factory=dict)  # backend name -> communicator

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index_of(self, global_rank: int) -> int:
        """This global rank's position inside the set."""
        return self.ranks.index(global_rank)

    def __contains__(self, global_rank: int) -> bool:
        return global_rank in self.ranks


def normalize_ranks(ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    """Validate and sort a user-given rank list.

    Raises:
        ConfigError: empty, duplicated or out-of-range ranks, with the offending values.
    """
    out = tuple(sorted(int(r) for r in ranks))
    if not out:
        raise ConfigError("a process set needs at least one rank")
    if len(set(out)) != len(out):
        raise ConfigError(f"process set ranks {list(ranks)} contain duplicates")
    bad = [r for r in out if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"process set ranks {bad} are outside [0, size={world_size})")
    return out
