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
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora.core.backends.base import Backend
from hora.core.negotiation import Ready, Signature
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.process_sets import ProcessSetState
from hora.core.request import Request
from hora.errors import HoraError, InternalError, UnsupportedError

log = logging.getLogger(__name__)

_UPCAST = {
    torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.int16: torch.int32, torch.bool: torch.uint8,
}
# Logical semantics for bool: sum is "any", product is "all".
_BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN, ReduceOp.MIN: ReduceOp.MIN,
             ReduceOp.MAX: ReduceOp.MAX}


@functools.cache
def dtype_from_name(name: str) -> torch.dtype:
    return getattr(torch, name)


@functools.cache
def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (for collectives that only move data)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def scale_(buf: torch.Tensor, factor: float) -> None:
    """Multiply in place; integer tensors truncate toward zero, as Horovod does."""
    if factor == 1.0:
        return
    if buf.is_floating_point():
        buf.mul_(factor)
    else:
        buf.copy_(torch.trunc(buf.to(torch.float64) * factor))


@dataclasses.dataclass(slots=True)
class _Slot:
    """One tensor's place in an allreduce bucket."""

    request: Request | None
    index: int
    source: torch.Tensor  # what this rank contributes
    output: torch.Tensor  # where the result goes


@dataclasses.dataclass(slots=True)
class _Bucket:
    key: tuple
    compute_dtype: torch.dtype
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
        self._buffers: dict[tuple[torch.dtype, str], torch.Tensor] = {}
        # The exact device (cuda:1, not just cuda) of this rank's tensors, for a joined rank's zeros.
        self._devices: dict[str, torch.device] = {}

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

    def _device(self, kind: str, request: Request | None) -> torch.device:
        """Where this rank's tensors of device type ``kind`` live (remembered for rounds it joins)."""
        if request is not None and request.entries:
            device = request.entries[0].input.device
            self._devices[kind] = device
            return device
        return self._devices.get(kind, torch.device(kind))

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
        plan = ready.plan
        if plan is None:
            plan = ready.plan = self._plan_allreduce(ready, sig)
        device = self._device(sig.device, request)
        backend = self._backend_for(sig.device)
        limit = self.fusion_threshold
        if backend.concurrent and backend.bucket_bytes:
            limit = min(limit, backend.bucket_bytes)
        for i, (dtype, shape, compute, op, post, key, nbytes, solo) in enumerate(plan):
            if request is not None:
                entry = request.entries[i]
                slot = _Slot(request, i, entry.input, entry.output)
            else:  # joined: contribute zeros of the agreed shape
                zeros = torch.zeros(shape, dtype=dtype, device=device)
                slot = _Slot(None, i, zeros, zeros)
            pset = self._psets[ready.process_set]
            if solo:
                order.append(_Bucket(key, compute, op, sig.prescale, post, pset, [slot], nbytes))
                continue
            bucket = buckets.get(key)
            if bucket is None or bucket.nbytes + nbytes > limit:
                bucket = _Bucket(key, compute, op, sig.prescale, post, pset)
                buckets[key] = bucket
                order.append(bucket)
            bucket.slots.append(slot)
            bucket.nbytes += nbytes

    def _plan_allreduce(self, ready: Ready, sig: Signature) -> list[tuple]:
        """Per tensor: dtype, shape, compute dtype, backend op, postscale, bucket key, bytes, reduce alone?

        Derived from the signatures only, so it is computed once per cached
        request and reused every step.
        """
        pset = self._psets[ready.process_set]
        backend = self._backend_for(sig.device)
        if sig.op == ReduceOp.ADASUM:
            raise UnsupportedError("op=Adasum is not supported by hora yet; use op=Average or op=Sum")
        plan = []
        for dtype_name, shape, _ in sig.tensors:
            dtype = dtype_from_name(dtype_name)
            compute = dtype if dtype in backend.reduce_dtypes else _UPCAST.get(dtype, dtype)
            op, post = sig.op, sig.postscale
            if op == ReduceOp.AVERAGE:
                op, post = ReduceOp.SUM, post / pset.size
            if dtype == torch.bool:
                op = _BOOL_OPS[op]
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * itemsize(compute)
            solo = nbytes >= self._direct_threshold(backend) or nbytes >= self.fusion_threshold
            key = (compute, int(op), sig.prescale, post, pset.id, sig.device)
            plan.append((dtype, tuple(shape), compute, op, post, key, nbytes, solo))
        return plan

    def _reduce(self, order: Sequence[_Bucket]) -> None:
        """Reduce every bucket of the round, in the same order on every rank.

        On a backend that runs collectives concurrently (gloo) every bucket is
        started before any is waited for: one collective's latency hides
        behind the others' transfers, and packing a fused bucket overlaps the
        reduction of the ones before it.  Each fused bucket in flight needs a
        region of the fusion buffer of its own; when the buffer (the fusion
        threshold) is full, what is in flight is finished first.  Elsewhere
        each bucket is finished before the next starts.
        """
        in_flight: list[Callable[[], None]] = []
        claimed: dict[tuple[torch.dtype, str], int] = {}  # fusion-buffer elements held by buckets in flight
        for bucket in order:
            device = bucket.slots[0].source.device
            backend = self._backend_for(device.type)
            group = self._group(bucket.pset, backend)
            if len(bucket.slots) == 1:
                finish = self._start_direct(bucket, bucket.slots[0], backend, group, len(order))
            else:
                numel = sum(s.source.numel() for s in bucket.slots)
                key = (bucket.compute_dtype, str(device))
                offset = claimed.get(key, 0)
                if offset and offset + numel > self.fusion_threshold // itemsize(bucket.compute_dtype):
                    for f in in_flight:
                        f()
                    in_flight.clear()
                    claimed.clear()
                    offset = 0
                buf = self._fusion_buffer(bucket.compute_dtype, device, offset + numel)[offset : offset + numel]
                claimed[key] = offset + numel
                finish = self._start_fused(bucket, buf, backend, group, len(order))
            if backend.concurrent:
                in_flight.append(finish)
            else:
                finish()
                claimed.clear()
        for finish in in_flight:
            finish()

    def _start_fused(
        self, bucket: _Bucket, buf: torch.Tensor, backend: Backend, group: Any, fanout: int
    ) -> Callable[[], None]:
        """Pack the bucket into ``buf`` and start its allreduce; returns what finishes it.

        Packing and unpacking are one torch call each (``cat``, ``_foreach_copy_``):
        a slice-and-copy per tensor costs ~25 us of Python, 4 ms for ResNet-50's
        150 small tensors.
        """
        slots = bucket.slots
        torch.cat([s.source.reshape(-1) for s in slots], out=buf)
        scale_(buf, bucket.prescale)
        wait = backend.allreduce_start(buf, bucket.op, group, fanout)

        def finish() -> None:
            wait()
            scale_(buf, bucket.postscale)
            pieces = torch.split_with_sizes(buf, [s.source.numel() for s in slots])
            if all(s.output.is_contiguous() for s in slots):
                torch._foreach_copy_([s.output.view(-1) for s in slots], pieces)
            else:
                for s, piece in zip(slots, pieces, strict=True):
                    s.output.copy_(piece.view(s.output.shape))

        return finish

    def _start_direct(
        self, bucket: _Bucket, slot: _Slot, backend: Backend, group: Any, fanout: int
    ) -> Callable[[], None]:
        """Start the allreduce of one tensor in its own memory where possible; returns what finishes it."""
        src, out = slot.source, slot.output
        if src.dtype == bucket.compute_dtype and out.is_contiguous():
            if out is not src:
                if bucket.prescale != 1.0 and src.is_floating_point():
                    torch.mul(src, bucket.prescale, out=out)
                else:
                    out.copy_(src)
                    scale_(out, bucket.prescale)
            else:
                scale_(out, bucket.prescale)
            work = out  # backends take any contiguous tensor; a flat view would cost a dispatch
        else:
            work = src.to(bucket.compute_dtype).contiguous().view(-1)
            if work.data_ptr() == src.data_ptr():
                work = work.clone()
            scale_(work, bucket.prescale)
        wait = backend.allreduce_start(work, bucket.op, group, fanout)

        def finish() -> None:
            wait()
            scale_(work, bucket.postscale)
            if work.data_ptr() != out.data_ptr():
                out.copy_(work.view(out.shape))

        return finish

    def _fusion_buffer(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        key = (dtype, str(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            cap = max(numel, min(self.fusion_threshold // itemsize(dtype), 2 * numel))
            buf = torch.empty(cap, dtype=dtype, device=device)
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
        device = self._device(sig.device, request)
        results: list[Any] = []
        for i, (dtype_name, shape, _) in enumerate(sig.tensors):
            dtype = dtype_from_name(dtype_name)
            entry = request.entries[i] if request is not None else None
            if sig.kind == CollectiveType.ALLGATHER:
                results.append(self._allgather(ready, i, dtype, shape, entry, members, backend, group, device))
            elif sig.kind == CollectiveType.BROADCAST:
                results.append(self._broadcast(entry, pset.index_of(sig.root), backend, group))
            elif sig.kind == CollectiveType.ALLTOALL:
                results.append(self._alltoall(ready, i, shape, entry, members, backend, group))
            elif sig.kind == CollectiveType.REDUCESCATTER:
                results.append(self._reducescatter(sig, i, shape, entry, pset, backend, group))
            else:  # pragma: no cover - control requests are handled by the engine
                raise AssertionError(f"unexpected collective {sig.kind}")
        if request is not None:
            request.handle.set_result(results)

    def _allgather(self, ready, i, dtype, shape, entry, members, backend, group, device) -> torch.Tensor:
        rows = [ready.signatures[r].tensors[i][1][0] if ready.signatures[r] is not None else 0 for r in members]
        row_numel = 1
        for d in shape[1:]:
            row_numel *= d
        out = torch.empty((sum(rows), *shape[1:]), dtype=dtype, device=device)
        itemsize = out.element_size()
        send = entry.input.contiguous() if entry is not None else out[:0]
        if out.numel():
            backend.allgatherv(_as_bytes(send), _as_bytes(out), [n * row_numel * itemsize for n in rows], group)
        return out

    def _broadcast(self, entry, root_index, backend, group) -> torch.Tensor:
        out = entry.output
        work = out if out.is_contiguous() else out.contiguous()
        backend.broadcast_(_as_bytes(work), root_index, group)
        if work.data_ptr() != out.data_ptr():
            out.copy_(work)
        return out

    def _alltoall(self, ready, i, shape, entry, members, backend, group):
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
        src = entry.input.contiguous()
        out = torch.empty((sum(recv_rows), *shape[1:]), dtype=src.dtype, device=src.device)
        item = src.element_size() * row_numel
        backend.alltoallv(_as_bytes(src), [r * item for r in send_rows], _as_bytes(out), [r * item for r in recv_rows],
                          group)
        return out, torch.tensor(recv_rows, dtype=torch.int32)

    def _reducescatter(self, sig, i, shape, entry, pset, backend, group) -> torch.Tensor:
        n = pset.size
        rows = reducescatter_rows(shape[0] if shape else 0, n)
        row_numel = 1
        for d in shape[1:]:
            row_numel *= d
        src = entry.input
        dtype = src.dtype
        compute = dtype if dtype in backend.reduce_dtypes else _UPCAST.get(dtype, dtype)
        op, post = sig.op, sig.postscale
        if op == ReduceOp.AVERAGE:
            op, post = ReduceOp.SUM, post / n
        if dtype == torch.bool:
            op = _BOOL_OPS[op]
        send = src.to(compute).contiguous().reshape(-1)
        if send.data_ptr() == src.data_ptr() and sig.prescale != 1.0:
            send = send.clone()
        scale_(send, sig.prescale)
        me = pset.index_of(self.rank)
        recv = torch.empty(rows[me] * row_numel, dtype=compute, device=src.device)
        backend.reduce_scatterv(send, recv, [r * row_numel for r in rows], op, group)
        scale_(recv, post)
        return recv.to(dtype).view((rows[me], *shape[1:]))


def reducescatter_rows(first_dim: int, n: int) -> list[int]:
    """Rows each rank keeps: an even split, the first ``first_dim % n`` ranks one more."""
    q, rem = divmod(first_dim, n)
    return [q + (1 if r < rem else 0) for r in range(n)]
