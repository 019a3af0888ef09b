"""Which server holds which part of a key.

As in MXNet: a key with fewer elements than the big-array bound lives whole on
one server, chosen by a stable hash of the key (every worker computes the same
server without talking to anyone); a key with at least ``bound`` elements is
split into contiguous, nearly equal ranges of its flattened elements, one per
server, so the servers share both the bytes and the work of a big tensor.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

#: Default largest payload of one message (``HORA_PS_PART_BYTES``).  A push or pull of a bigger shard
#: travels as several messages, so that they pipeline (one part is hashed while another is on the wire) and
#: a server holds only a few parts per worker beyond its keys.
PART_BYTES = 4 * 1024 * 1024


class Shard(NamedTuple):
    """Elements ``[lo, hi)`` of a key's flattened value, held by server ``server``."""

    server: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


def server_of(key: str, num_servers: int) -> int:
    """The server of a small key: integer keys round-robin, other keys by a stable hash."""
    if key.isdigit():
        return int(key) % num_servers
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_servers


def place(key: str, numel: int, num_servers: int, bound: int, unit: int = 1) -> list[Shard]:
    """The shards of a key of ``numel`` elements (one shard unless it is big and there are several servers).

    With ``unit`` > 1 (the row width of a row_sparse key) every cut falls on a multiple of ``unit``, so each
    row lives whole on one server and a row's server follows from its id.
    """
    if numel < bound or num_servers == 1:
        return [Shard(server_of(key, num_servers), 0, numel)]
    units = numel // unit
    cuts = [units * s // num_servers * unit for s in range(num_servers)] + [numel]
    return [Shard(s, cuts[s], cuts[s + 1]) for s in range(num_servers) if cuts[s + 1] > cuts[s]]


def parts(size: int, itemsize: int, part_bytes: int = PART_BYTES) -> list[tuple[int, int]]:
    """``(offset, length)`` of the messages a shard of ``size`` elements travels in (one for an empty shard)."""
    step = max(1, part_bytes // max(1, itemsize))
    return [(off, min(step, size - off)) for off in range(0, size, step)] or [(0, 0)]
