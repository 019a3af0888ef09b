"""Negotiation: deciding, identically on every rank, which requests run now.

Each round every rank contributes one small integer vector, summed across
ranks by the controller backend:

====================  =========================================================
slot                  meaning
====================  =========================================================
``0``                 ranks that need the second phase (new names, join, stall)
``1``                 ranks that have called ``join()``
``2``                 ranks asking to shut down
``3 + id``            ranks whose request under cached ``id`` is ready
====================  =========================================================

Names seen before map to integer ids kept in an identical cache on every
rank, so a steady-state round is one tiny allreduce.  A name a rank has not
negotiated before (or whose shapes changed) is *announced* in a second
phase: an allgather of every rank's announcements.  From the summed vector and
the announcements, every rank derives the same ordered list of requests that
are ready on all their ranks, and checks that the ranks agree on shapes,
dtypes, operators and roots.  Nothing here talks to a backend; it is pure
bookkeeping, tested on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import msgpack
import numpy as np

from hora.core.ops import CollectiveType, ReduceOp
from hora.errors import HoraError, MismatchError, UnsupportedError

SLOT_PHASE2 = 0
SLOT_JOINED = 1
SLOT_SHUTDOWN = 2
HEADER = 3


@dataclasses.dataclass(frozen=True, slots=True)
class Signature:
    """What one rank submitted under a name; compared across ranks."""

    kind: CollectiveType
    tensors: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]  # (dtype, shape, splits)
    op: ReduceOp
    root: int
    prescale: float
    postscale: float
    process_set: int
    device: str

    def encode(self) -> bytes:
        return msgpack.packb(
            [int(self.kind), [list(t) for t in self.tensors], int(self.op), self.root,
             self.prescale, self.postscale, self.process_set, self.device]
        )

    @staticmethod
    def decode(raw: bytes) -> Signature:
        kind, tensors, op, root, pre, post, pset, device = msgpack.unpackb(raw)
        return Signature(
            CollectiveType(kind), tuple((d, tuple(s), tuple(sp)) for d, s, sp in tensors),
            ReduceOp(op), root, pre, post, pset, device,
        )


@dataclasses.dataclass(slots=True)
class CacheEntry:
    id: int
    name: str
    process_set: int
    signatures: list[bytes | None]  # per global rank; None for a rank that was joined
    ready: Ready | None = None  # the validated result, reused while no rank's signature changes


@dataclasses.dataclass(slots=True)
class Ready:
    """A request that every rank of its process set has submitted.

    ``signatures`` is indexed by global rank; ranks outside the process set
    and joined ranks hold ``None``.  ``error`` is set when the ranks disagree;
    every rank then fails the request with the same message.
    """

    name: str
    process_set: int
    signatures: list[Signature | None]
    error: HoraError | None = None
    _first: Signature | None = dataclasses.field(default=None, repr=False)
    #: the executor's :data:`~hora.core.executor.AllreducePlan` for this request, cached here so
    #: that it lives exactly as long as the validated Ready it was derived from
    plan: tuple | None = dataclasses.field(default=None, repr=False)

    def first(self) -> Signature:
        """The signature of the lowest rank that submitted (they agree when ``error`` is None)."""
        if self._first is None:
            self._first = next(s for s in self.signatures if s is not None)
        return self._first


class NameCache:
    """The name -> id table, updated identically on every rank."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.by_name: dict[str, CacheEntry] = {}
        self.by_id: list[CacheEntry] = []

    def __len__(self) -> int:
        return len(self.by_id)

    @staticmethod
    def cacheable(name: str) -> bool:
        """Auto-generated names are used once; caching them would only grow the table."""
        return ".noname." not in name

    def lookup(self, name: str, signature: bytes, rank: int) -> int | None:
        """The id to mark ready for this rank's request, or None to announce it."""
        entry = self.by_name.get(name)
        if entry is not None and entry.signatures[rank] == signature:
            return entry.id
        return None

    def remember(self, name: str, process_set: int, signatures: list[bytes | None], ready: Ready) -> None:
        entry = self.by_name.get(name)
        if entry is not None:
            entry.signatures = signatures
            entry.ready = ready
        elif self.cacheable(name) and len(self.by_id) < self.capacity:
            entry = CacheEntry(len(self.by_id), name, process_set, signatures, ready)
            self.by_name[name] = entry
            self.by_id.append(entry)


def resolve(
    cache: NameCache,
    totals: Sequence[int],
    announcements: Sequence[Mapping[str, bytes]] | None,
    joined: Iterable[int],
    members: Mapping[int, Sequence[int]],
    world_size: int,
) -> list[Ready]:
    """Compute the ordered list of requests that are ready on all their ranks.

    Args:
        cache: the name cache as it stood when the round's vector was built.
        totals: the summed negotiation vector.
        announcements: per global rank, name -> encoded signature announced
            this round (``None`` when no rank needed the second phase).
        joined: global ranks that are in ``join()``.
        members: process-set id -> its global ranks.
        world_size: number of ranks.

    Returns:
        Ready requests, cached ones in id order, then new names sorted.  The
        cache is updated for the ones that passed validation.
    """
    joined = set(joined)
    ann_by_name: dict[str, dict[int, bytes]] = {}
    for rank, ann in enumerate(announcements or ()):
        for name, sig in ann.items():
            ann_by_name.setdefault(name, {})[rank] = sig

    counts = totals[HEADER:]
    if len(counts) <= 64:  # a Python scan beats numpy's call overhead on short vectors
        candidates = [i for i, c in enumerate(counts.tolist() if hasattr(counts, "tolist") else counts) if c]
    else:
        candidates = np.flatnonzero(np.asarray(counts)).tolist()
    if ann_by_name:
        candidates = sorted(set(candidates).union(cache.by_name[n].id for n in ann_by_name if n in cache.by_name))
    ready: list[Ready] = []
    for entry in [cache.by_id[i] for i in candidates]:
        announced = ann_by_name.pop(entry.name, {})
        ranks = members.get(entry.process_set, ())
        count = int(totals[HEADER + entry.id]) + len(announced)
        if count != len(ranks) or not ranks:
            continue
        if joined and count == sum(1 for r in ranks if r in joined):
            continue  # only joined ranks "have" it: nobody actually submitted it
        if not announced and entry.ready is not None and not joined:
            ready.append(entry.ready)  # steady state: nothing changed since it was validated
            continue
        sigs: list[bytes | None] = [None] * world_size
        for r in ranks:
            if r in announced:
                sigs[r] = announced[r]
            elif r not in joined:
                sigs[r] = entry.signatures[r]
        stand_ins = [r for r in ranks if r in joined and r not in announced]
        ready.append(_check(entry.name, entry.process_set, sigs, cache, stand_ins))

    for name in sorted(ann_by_name):
        announced = ann_by_name[name]
        pset = Signature.decode(next(iter(announced.values()))).process_set
        ranks = members.get(pset, ())
        joined_members = [r for r in ranks if r in joined and r not in announced]
        if not ranks or len(announced) + len(joined_members) != len(ranks):
            continue
        sigs = [announced.get(r) for r in range(world_size)]
        ready.append(_check(name, pset, sigs, cache, joined_members))
    return ready


# Joined ranks stand in (with zeros) only for these; data collectives other than allreduce fail while a
# rank is joined, as in Horovod.
_JOINABLE = (CollectiveType.ALLREDUCE, CollectiveType.BARRIER, CollectiveType.ADD_PROCESS_SET,
             CollectiveType.REMOVE_PROCESS_SET)


def _check(name: str, pset: int, raw: list[bytes | None], cache: NameCache,
           joined_members: Sequence[int] = ()) -> Ready:
    sigs = [Signature.decode(s) if s is not None else None for s in raw]
    error: HoraError | None = validate(name, sigs)
    if error is None and joined_members:
        kind = next(s for s in sigs if s is not None).kind
        if kind not in _JOINABLE:
            error = UnsupportedError(
                f"{kind.label} of tensor {name!r} cannot run while rank(s) {sorted(joined_members)} have called "
                "join(): only allreduce supports join (a joined rank contributes zeros). Call this collective "
                "before join(), or use DistributedOptimizer(sparse_as_dense=True) for sparse gradients."
            )
    result = Ready(name, pset, sigs, error)
    if result.error is None:
        cache.remember(name, pset, raw, result)
    return result


def _describe(values: Mapping[int, object]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in sorted(values.items()))


def validate(name: str, sigs: Sequence[Signature | None]) -> MismatchError | None:
    """Check that every rank submitted a compatible request under ``name``.

    Returns:
        None when they agree, else a :class:`MismatchError` naming the tensor,
        the field and each rank's value.
    """
    present = {r: s for r, s in enumerate(sigs) if s is not None}
    if not present:
        return None

    def mismatch(field: str, values: Mapping[int, object], advice: str) -> MismatchError:
        kind = next(iter(present.values())).kind.label
        return MismatchError(
            f"{kind} of tensor {name!r}: mismatched {field} across ranks ({_describe(values)}). {advice}"
        )

    def differs(values: Mapping[int, object]) -> bool:
        return len(set(values.values())) > 1

    kinds = {r: s.kind.label for r, s in present.items()}
    if differs(kinds):
        return mismatch("operation", kinds, "Every rank must submit the same collective under one name.")
    psets = {r: s.process_set for r, s in present.items()}
    if differs(psets):
        return mismatch("process set", psets, "Every rank must use the same process set.")
    counts = {r: len(s.tensors) for r, s in present.items()}
    if differs(counts):
        return mismatch("number of tensors", counts, "Grouped collectives need the same tensor list on every rank.")
    devices = {r: s.device for r, s in present.items()}
    if differs(devices):
        return mismatch("device", devices, "Put the tensor on the same kind of device on every rank.")
    first = next(iter(present.values()))
    kind = first.kind
    for i in range(len(first.tensors)):
        label = "" if len(first.tensors) == 1 else f" of tensor #{i}"
        dtypes = {r: s.tensors[i][0] for r, s in present.items()}
        if differs(dtypes):
            return mismatch("dtype" + label, dtypes, "Cast the tensor to the same dtype on every rank.")
        shapes = {r: s.tensors[i][1] for r, s in present.items()}
        if kind in (CollectiveType.ALLREDUCE, CollectiveType.BROADCAST, CollectiveType.REDUCESCATTER):
            if differs(shapes):
                return mismatch("shape" + label, shapes, "Every rank must submit the same shape.")
        elif kind in (CollectiveType.ALLGATHER, CollectiveType.ALLTOALL):
            ranks_ = {r: len(sh) for r, sh in shapes.items()}
            if differs(ranks_):
                return mismatch("number of dimensions" + label, shapes, "Only the first dimension may differ.")
            trailing = {r: sh[1:] for r, sh in shapes.items()}
            if differs(trailing):
                return mismatch("shape" + label, shapes, "Only the first dimension may differ between ranks.")
    if kind in (CollectiveType.ALLREDUCE, CollectiveType.REDUCESCATTER):
        ops = {r: s.op.name for r, s in present.items()}
        if differs(ops):
            return mismatch("reduction op", ops, "Pass the same op on every rank.")
        scales = {r: (s.prescale, s.postscale) for r, s in present.items()}
        if differs(scales):
            return mismatch("(prescale, postscale) factors", scales, "Pass the same scale factors on every rank.")
    if kind == CollectiveType.BROADCAST:
        roots = {r: s.root for r, s in present.items()}
        if differs(roots):
            return mismatch("root rank", roots, "Pass the same root_rank on every rank.")
    return None
