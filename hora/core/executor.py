"""Execution of negotiated requests on a backend: fusion, dtype handling, scaling.

The executor turns the ready list of one round into backend calls.  The plan
is derived only from the signatures every rank holds, so all ranks issue the
same collectives in the same order, including a rank that has joined and
contributes zeros in place of tensors it never submitted.

Allreduces with the same dtype, operator, scale factors and process set are
packed into a persistent fusion buffer (one backend call for many small
tensors).  Tensors at least ``direct_threshold_bytes`` large are reduced in
their own memory instead: for them the copy into a buffer costs more than the
per-call latency it saves.

The executor never touches a framework: every array operation goes through
the request's array family (:mod:`hora.core.buffers`), so NumPy arrays and
torch tensors take the same path.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from hora.core.backends.base import Backend
from hora.core.buffers import ITEMSIZE, UPCAST, Array, ArrayOps
from hora.core.buffers.numpy_ops import NUMPY
from hora.core.hooks import RoundRecorder
from hora.core.negotiation import Ready, Signature
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.process_sets import ProcessSetState
from hora.core.request import Request
from hora.core.timeline import Bucket as TimelineBucket
from hora.errors import HoraError, InternalError, UnsupportedError

log = logging.getLogger(__name__)

# Logical semantics for bool: sum is "any", product is "all".
_BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN, ReduceOp.MIN: ReduceOp.MIN,
             ReduceOp.MAX: ReduceOp.MAX}


def compute_dtype(dtype: str, backend: Backend) -> str:
    """The dtype ``backend`` reduces ``dtype`` in: itself when native, else the upcast of :data:`UPCAST`."""
    return dtype if dtype in backend.reduce_dtypes else UPCAST.get(dtype, dtype)


def backend_op(op: ReduceOp, postscale: float, dtype: str, ranks: int) -> tuple[ReduceOp, float]:
    """The operator a backend runs and the postscale after it: Average is Sum then a division."""
    if op == ReduceOp.AVERAGE:
        op, postscale = ReduceOp.SUM, postscale / ranks
    if dtype == "bool":
        op = _BOOL_OPS[op]
    return op, postscale


@dataclasses.dataclass(frozen=True, slots=True)
class TensorPlan:
    """How one tensor of an allreduce is reduced, derived from the agreed signature alone.

    Attributes:
        dtype: the tensor's dtype name.
        shape: its shape (a joined rank contributes zeros of this shape).
        compute: the dtype the backend reduces in.
        op: the backend's operator (Average became Sum).
        postscale: the factor after the reduction (Average's division included).
        bucket: tensors with equal keys may share a fusion bucket.
        nbytes: bytes in the compute dtype.
        direct: reduced alone, in its own memory, instead of fused.
    """

    dtype: str
    shape: tuple[int, ...]
    compute: str
    op: ReduceOp
    postscale: float
    bucket: tuple
    nbytes: int
    direct: bool


#: An allreduce request's plan: one :class:`TensorPlan` per tensor.  Computed once per cached
#: :class:`~hora.core.negotiation.Ready` and reused every step.
AllreducePlan = tuple[TensorPlan, ...]


@dataclasses.dataclass(slots=True)
class _Slot:
    """One tensor's place in an allreduce bucket."""

    request: Request | None
    index: int
    source: Array  # what this rank contributes
    output: Array  # where the result goes


@dataclasses.dataclass(slots=True)
class _Bucket:
    key: tuple
    device_type: str
    ops: ArrayOps
    compute_dtype: str
    op: ReduceOp
    prescale: float
    postscale: float
    pset: ProcessSetState
    slots: list[_Slot] = dataclasses.field(default_factory=list)
    nbytes: int = 0


class Executor:
    """Runs ready requests on a backend; owned by the engine's thread."""

    def __init__(
        self,
        rank: int,
        backend_for: Callable[[str], Backend],
        process_sets: dict[int, ProcessSetState],
        fusion_threshold_bytes: int,
        direct_threshold_bytes: int | None,
    ) -> None:
        self.rank = rank
        self._backend_for = backend_for
        self._psets = process_sets
        self.fusion_threshold = fusion_threshold_bytes
        self._direct_override = direct_threshold_bytes
        self._buffers: dict[tuple[str, str, Any], Array] = {}  # (family, dtype, device) -> fusion buffer
        # The family and exact device (cuda:1, not just cuda) of this rank's tensors, for a joined rank's zeros.
        self._devices: dict[str, tuple[ArrayOps, Any]] = {}
        #: the :class:`~hora.core.timeline.Timeline` recording this rank, or None (the engine sets it)
        self.timeline: RoundRecorder | None = None

    # ------------------------------------------------------------------ driver
    def run(self, items: Sequence[tuple[Ready, Request | None]]) -> None:
        """Execute one round's ready list (already validated, errors set aside).

        A failure inside a backend (a torch or NCCL exception) is raised as
        :class:`~hora.errors.InternalError`, so that the engine fails the
        requests of this round too instead of leaving their callers waiting.
        """
        try:
            self._run(items)
        except HoraError:
            raise
        except Exception as e:
            raise InternalError(
                f"hora engine failed on rank {self.rank}: {type(e).__name__}: {e}. This usually means another "
                "rank exited or crashed; look for the first error in the other ranks' output") from e

    def set_thresholds(self, fusion_threshold_bytes: int, direct_threshold_bytes: int | None) -> None:
        """Plan with new thresholds from now on (the engine drops the cached plans; see ``Engine.retune``)."""
        self.fusion_threshold = fusion_threshold_bytes
        self._direct_override = direct_threshold_bytes

    def _device(self, kind: str, request: Request | None) -> tuple[ArrayOps, Any]:
        """The family and device of this rank's tensors of device type ``kind`` (remembered for rounds it joins)."""
        if request is not None and request.entries:
            ops = request.ops
            placed = (ops, ops.device(request.entries[0].input))
            self._devices[kind] = placed
            return placed
        return self._devices.get(kind, (NUMPY, kind))

    def _run(self, items: Sequence[tuple[Ready, Request | None]]) -> None:
        buckets: dict[tuple, _Bucket] = {}
        order: list[_Bucket] = []
        for ready, request in items:
            sig = ready.first()
            if sig.kind == CollectiveType.ALLREDUCE:
                self._add_allreduce(ready, sig, request, buckets, order)
            else:
                self._run_one(ready, sig, request)
        self._reduce(order)
        for ready, request in items:
            if request is not None and ready.first().kind == CollectiveType.ALLREDUCE:
                outputs = [e.output for e in request.entries]
                request.handle.set_result(outputs)

    def _group(self, pset: ProcessSetState, backend: Backend) -> Any:
        return pset.groups.get(backend.name) if pset.id != 0 else None

    def _direct_threshold(self, backend: Backend) -> int:
        return backend.direct_threshold_bytes if self._direct_override is None else self._direct_override

    # --------------------------------------------------------------- allreduce
    def _add_allreduce(
        self, ready: Ready, sig: Signature, request: Request | None, buckets: dict, order: list
    ) -> None:
        plan: AllreducePlan | None = ready.plan
        if plan is None:
            plan = ready.plan = self._plan_allreduce(ready, sig)
        ops, device = self._device(sig.device, request)
        backend = self._backend_for(sig.device)
        limit = self.fusion_threshold
        if backend.concurrent and backend.bucket_bytes:
            limit = min(limit, backend.bucket_bytes)
        pset = self._psets[ready.process_set]
        for i, t in enumerate(plan):
            if request is not None:
                entry = request.entries[i]
                slot = _Slot(request, i, entry.input, entry.output)
            else:  # joined: contribute zeros of the agreed shape
                zeros = ops.zeros(t.shape, t.dtype, device)
                slot = _Slot(None, i, zeros, zeros)
            if t.direct:
                order.append(_Bucket(t.bucket, sig.device, ops, t.compute, t.op, sig.prescale, t.postscale, pset,
                                     [slot], t.nbytes))
                continue
            key = (t.bucket, ops.family)  # NumPy arrays and torch tensors never share a buffer
            bucket = buckets.get(key)
            if bucket is None or bucket.nbytes + t.nbytes > limit:
                bucket = _Bucket(t.bucket, sig.device, ops, t.compute, t.op, sig.prescale, t.postscale, pset)
                buckets[key] = bucket
                order.append(bucket)
            bucket.slots.append(slot)
            bucket.nbytes += t.nbytes

    def _plan_allreduce(self, ready: Ready, sig: Signature) -> AllreducePlan:
        """The plan of an allreduce, from the signatures only (the same on every rank)."""
        pset = self._psets[ready.process_set]
        backend = self._backend_for(sig.device)
        if sig.op == ReduceOp.ADASUM:
            raise UnsupportedError("op=Adasum is not supported by hora yet; use op=Average or op=Sum")
        plan = []
        for dtype, shape, _ in sig.tensors:
            compute = compute_dtype(dtype, backend)
            op, post = backend_op(sig.op, sig.postscale, dtype, pset.size)
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * ITEMSIZE[compute]
            direct = nbytes >= self._direct_threshold(backend) or nbytes >= self.fusion_threshold
            key = (compute, int(op), sig.prescale, post, pset.id, sig.device)
            plan.append(TensorPlan(dtype, tuple(shape), compute, op, post, key, nbytes, direct))
        return tuple(plan)

    def _reduce(self, order: Sequence[_Bucket]) -> None:
        """Reduce every bucket of the round; when it is recorded, its buckets go to the timeline as one record."""
        tl = self.timeline
        # the round's finished buckets, for the timeline: handed over at once, even when one fails
        traced: list[TimelineBucket] | None = [] if tl is not None and order else None
        try:
            self._reduce_buckets(order, traced)
        finally:
            if traced:
                tl.buckets(traced)

    def _reduce_buckets(self, order: Sequence[_Bucket], traced: list[TimelineBucket] | None) -> None:
        """Reduce the buckets in the same order on every rank; append each finished one to ``traced``.

        On a backend that runs collectives concurrently (gloo) every bucket is
        started before any is waited for: one collective's latency hides
        behind the others' transfers, and packing a fused bucket overlaps the
        reduction of the ones before it.  Each fused bucket in flight needs a
        region of the fusion buffer of its own; when the buffer (the fusion
        threshold) is full, what is in flight is finished first.  Elsewhere
        each bucket is finished before the next starts.
        """
        in_flight: list[Callable[[], None]] = []
        claimed: dict[tuple[str, str, Any], int] = {}  # fusion-buffer elements held by buckets in flight
        for bucket in order:
            ops = bucket.ops
            backend = self._backend_for(bucket.device_type)
            group = self._group(bucket.pset, backend)
            if len(bucket.slots) == 1:
                finish = self._start_direct(bucket, bucket.slots[0], backend, group, len(order), traced)
            else:
                numel = sum(ops.numel(s.source) for s in bucket.slots)
                device = ops.device(bucket.slots[0].source)
                key = (ops.family, bucket.compute_dtype, device)
                offset = claimed.get(key, 0)
                if offset and offset + numel > self.fusion_threshold // ITEMSIZE[bucket.compute_dtype]:
                    for f in in_flight:
                        f()
                    in_flight.clear()
                    claimed.clear()
                    offset = 0
                buf = self._fusion_buffer(ops, bucket.compute_dtype, device, offset + numel)[offset : offset + numel]
                claimed[key] = offset + numel
                finish = self._start_fused(bucket, buf, backend, group, len(order), traced)
            if backend.concurrent:
                in_flight.append(finish)
            else:
                finish()
                claimed.clear()
        for finish in in_flight:
            finish()

    def _start_fused(
        self, bucket: _Bucket, buf: Array, backend: Backend, group: Any, fanout: int,
        traced: list[TimelineBucket] | None,
    ) -> Callable[[], None]:
        """Pack the bucket into ``buf`` and start its allreduce; returns what finishes it.

        Packing and unpacking are one call each for the whole bucket (see the
        families' ``pack``/``unpack``), not a slice-and-copy per tensor.
        """
        ops, slots = bucket.ops, bucket.slots
        start = time.monotonic()
        ops.pack([s.source for s in slots], buf)
        ops.scale_(buf, bucket.prescale)
        packed = time.monotonic()
        wait = backend.allreduce_start(buf, bucket.op, group, fanout)

        def finish() -> None:
            wait()
            reduced = time.monotonic()
            ops.scale_(buf, bucket.postscale)
            ops.unpack(buf, [s.output for s in slots])
            if traced is not None:
                traced.append(TimelineBucket(backend.name, True, [_key(s) for s in slots], start, packed, reduced,
                                             time.monotonic()))

        return finish

    def _start_direct(
        self, bucket: _Bucket, slot: _Slot, backend: Backend, group: Any, fanout: int,
        traced: list[TimelineBucket] | None,
    ) -> Callable[[], None]:
        """Start the allreduce of one tensor in its own memory where possible; returns what finishes it."""
        ops, src, out = bucket.ops, slot.source, slot.output
        start = time.monotonic()
        if ops.dtype_name(src) == bucket.compute_dtype and ops.is_contiguous(out):
            if out is not src:
                ops.scaled_copy_(out, src, bucket.prescale)
            else:
                ops.scale_(out, bucket.prescale)
            work = out  # backends take any contiguous array; a flat view would cost a dispatch
        else:
            work = ops.cast_flat(src, bucket.compute_dtype, copy=True)
            ops.scale_(work, bucket.prescale)
        wait = backend.allreduce_start(work, bucket.op, group, fanout)

        def finish() -> None:
            wait()
            reduced = time.monotonic()
            ops.scale_(work, bucket.postscale)
            if work is not out:
                ops.copy_(out, work)
            if traced is not None:
                traced.append(TimelineBucket(backend.name, False, [_key(slot)], start, start, reduced,
                                             time.monotonic()))

        return finish

    def _fusion_buffer(self, ops: ArrayOps, dtype: str, device: Any, numel: int) -> Array:
        key = (ops.family, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or ops.numel(buf) < numel:
            cap = max(numel, min(self.fusion_threshold // ITEMSIZE[dtype], 2 * numel))
            buf = ops.empty((cap,), dtype, device)
            self._buffers[key] = buf
        return buf[:numel]

    # ------------------------------------------------------ other collectives
    def _run_one(self, ready: Ready, sig: Signature, request: Request | None) -> None:
        pset = self._psets[ready.process_set]
        if sig.kind == CollectiveType.BARRIER:
            if request is not None:
                request.handle.set_result([])
            return
        if request is None:
            # A joined rank only takes part in allreduce and allgather.
            if sig.kind != CollectiveType.ALLGATHER:
                return
        backend = self._backend_for(sig.device)
        group = self._group(pset, backend)
        members = pset.ranks
        ops, device = self._device(sig.device, request)
        results: list[Any] = []
        started = time.monotonic() if self.timeline is not None else 0.0
        for i, (dtype, shape, _) in enumerate(sig.tensors):
            entry = request.entries[i] if request is not None else None
            if sig.kind == CollectiveType.ALLGATHER:
                results.append(self._allgather(ops, ready, i, dtype, shape, entry, members, backend, group, device))
            elif sig.kind == CollectiveType.BROADCAST:
                results.append(self._broadcast(ops, entry, pset.index_of(sig.root), backend, group))
            elif sig.kind == CollectiveType.ALLTOALL:
                results.append(self._alltoall(ops, ready, i, shape, entry, members, backend, group))
            elif sig.kind == CollectiveType.REDUCESCATTER:
                results.append(self._reducescatter(ops, sig, i, dtype, shape, entry, pset, backend, group))
            else:  # pragma: no cover - control requests are handled by the engine
                raise AssertionError(f"unexpected collective {sig.kind}")
        if self.timeline is not None:
            self.timeline.single(backend.name, sig.kind, ready.name, started, time.monotonic())
        if request is not None:
            request.handle.set_result(results)

    def _allgather(self, ops, ready, i, dtype, shape, entry, members, backend, group, device) -> Array:
        rows = [ready.signatures[r].tensors[i][1][0] if ready.signatures[r] is not None else 0 for r in members]
        row_numel = 1
        for d in shape[1:]:
            row_numel *= d
        out = ops.empty((sum(rows), *shape[1:]), dtype, device)
        size = ITEMSIZE[dtype]
        send = ops.contiguous(entry.input) if entry is not None else out[:0]
        if ops.numel(out):
            backend.allgatherv(ops.as_bytes(send), ops.as_bytes(out), [n * row_numel * size for n in rows], group)
        return out

    def _broadcast(self, ops, entry, root_index, backend, group) -> Array:
        out = entry.output
        work = ops.contiguous(out)
        backend.broadcast_(ops.as_bytes(work), root_index, group)
        if work is not out:
            ops.copy_(out, work)
        return out

    def _alltoall(self, ops, ready, i, shape, entry, members, backend, group):
        n = len(members)
        me = members.index(self.rank)

        def splits_of(sig: Signature) -> list[int]:
            dims = sig.tensors[i][1]
            given = sig.tensors[i][2]
            return list(given) if given else [dims[0] // n] * n

        send_rows = splits_of(ready.signatures[self.rank])
        recv_rows = [splits_of(ready.signatures[r])[me] for r in members]
        row_numel = 1
        for d in shape[1:]:
            row_numel *= d
        src = ops.contiguous(entry.input)
        dtype = ops.dtype_name(src)
        out = ops.empty((sum(recv_rows), *shape[1:]), dtype, ops.device(src))
        item = ITEMSIZE[dtype] * row_numel
        backend.alltoallv(ops.as_bytes(src), [r * item for r in send_rows], ops.as_bytes(out),
                          [r * item for r in recv_rows], group)
        return out, ops.int32_vector(recv_rows)

    def _reducescatter(self, ops, sig, i, dtype, shape, entry, pset, backend, group) -> Array:
        n = pset.size
        rows = reducescatter_rows(shape[0] if shape else 0, n)
        row_numel = 1
        for d in shape[1:]:
            row_numel *= d
        src = entry.input
        compute = compute_dtype(dtype, backend)
        op, post = backend_op(sig.op, sig.postscale, dtype, n)
        send = ops.cast_flat(src, compute, copy=sig.prescale != 1.0)
        ops.scale_(send, sig.prescale)
        me = pset.index_of(self.rank)
        recv = ops.empty((rows[me] * row_numel,), compute, ops.device(src))
        backend.reduce_scatterv(send, recv, [r * row_numel for r in rows], op, group)
        ops.scale_(recv, post)
        return ops.reshape(ops.astype(recv, dtype), (rows[me], *shape[1:]))


def _key(slot: _Slot) -> str | None:
    """The negotiated name of a slot's request, for the timeline (None: a joined rank's zeros)."""
    return slot.request.key if slot.request is not None else None


def reducescatter_rows(first_dim: int, n: int) -> list[int]:
    """Rows each rank keeps: an even split, the first ``first_dim % n`` ranks one more."""
    q, rem = divmod(first_dim, n)
    return [q + (1 if r < rem else 0) for r in range(n)]
