"""The one way in for framework bindings: build a collective, check its name, hand it to the engine.

A binding (``hora.torch``, ``hora.tensorflow``, ``hora.mxnet``, the
allreduce KVStore) calls :func:`submit` with engine buffers (NumPy arrays or
torch tensors, see :mod:`hora.core.buffers`) and gets a
:class:`~hora.core.request.Handle` back at once.  Everything between the call
and the backend lives here and below, once: generated names, the
duplicate-name check, request construction, output allocation, negotiation,
fusion and errors.  What differs per framework comes in as an
:class:`Adapter`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from hora.core import runtime
from hora.core.buffers import Array, as_buffer, ops_for
from hora.core.buffers.numpy_ops import NUMPY
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.request import Entry, Handle, Request
from hora.core.runtime import ProcessSet, global_process_set
from hora.errors import ConfigError

_CONTROL_KINDS = (CollectiveType.BARRIER, CollectiveType.JOIN)


@dataclasses.dataclass(frozen=True, slots=True)
class Adapter:
    """What a binding supplies so that the engine can work on its framework's tensors.

    Attributes:
        to_buffer: a framework tensor as an engine buffer (a NumPy array or a
            torch tensor), sharing memory where the framework allows; ``None``
            when the tensors are engine buffers already.
        from_buffer: an engine result back as a framework tensor; applied by
            ``Handle.wait()`` to every array in the result.  ``None`` keeps
            the engine's arrays.
        sync: waits until the device has finished writing the inputs (a CUDA
            stream synchronisation) before the engine's thread reads them.
    """

    to_buffer: Callable[[Any], Array] | None = as_buffer
    from_buffer: Callable[[Array], Any] | None = None
    sync: Callable[[Sequence[Array]], None] | None = None


#: NumPy arrays (and objects viewable as them) in, NumPy arrays out.
NUMPY_ADAPTER = Adapter()


def process_set_id(process_set: ProcessSet | int | None) -> int:
    """The engine's id for a process set (``None`` is the global set).

    Raises:
        ConfigError: the set was never registered with ``add_process_set``.
    """
    if isinstance(process_set, int):
        return process_set
    ps = global_process_set if process_set is None else process_set
    if ps.process_set_id is None:
        raise ConfigError(f"{ps} is not registered: call hvd.add_process_set() on every rank first")
    return ps.process_set_id


def submit(
    kind: CollectiveType,
    tensors: Sequence[Any],
    *,
    name: str | None = None,
    op: ReduceOp = ReduceOp.SUM,
    prescale: float = 1.0,
    postscale: float = 1.0,
    process_set: ProcessSet | int | None = None,
    root: int = -1,
    splits: Sequence[Sequence[int] | None] | None = None,
    inplace: bool = False,
    outputs: Sequence[Array] | None = None,
    adapter: Adapter = NUMPY_ADAPTER,
    wake: bool = True,
) -> Handle:
    """Submit one collective over ``tensors`` (more than one: a grouped collective) and return its handle.

    Args:
        kind: what to do (allreduce, allgather, broadcast, alltoall, reducescatter, barrier, join).
        tensors: the inputs, as the binding's framework tensors; ``adapter.to_buffer`` views each.
        name: the name negotiated across ranks; generated when omitted.  A
            name may not be reused until the program has waited for the
            collective that last used it.
        op: the reduction (allreduce, reducescatter).
        prescale: factor applied to the inputs before the reduction.
        postscale: factor applied to the result.
        process_set: a registered :class:`~hora.core.runtime.ProcessSet`, its id, or None for all ranks.
        root: the broadcast root, as a global rank.
        splits: alltoall only: rows sent to each rank, per tensor (None: an even split).
        inplace: allreduce and broadcast write their result into the inputs.
        outputs: allreduce and broadcast: where the results go, instead of new arrays.
        adapter: the binding's conversions and device synchronisation.
        wake: False when the caller is about to wait on the handle: its own
            thread then runs the negotiation round, saving two thread hand-offs.

    Returns:
        The handle; ``wait()`` returns a list with one result per tensor
        (``(output, received_splits)`` pairs for alltoall; an empty list for
        a barrier; the last rank to join for join).

    Raises:
        DuplicateNameError: ``name`` is still held by a collective not yet waited for.
        ShutdownError: the engine has stopped; the message says why.
        NotInitializedError: ``init()`` was not called.
    """
    rt = runtime.current()
    pset = process_set_id(process_set)
    convert = adapter.to_buffer
    buffers = list(tensors) if convert is None else [convert(t) for t in tensors]
    ops = ops_for(buffers[0]) if buffers else NUMPY
    entries = _entries(kind, buffers, ops, splits, inplace, outputs)
    if kind in _CONTROL_KINDS:
        name = rt.auto_name(kind.label, pset)
    request = Request(
        name or rt.auto_name(kind.label, pset), kind, entries, process_set_id=pset, op=op, root=root,
        prescale=float(prescale), postscale=float(postscale), ops=ops,
    )
    handle = request.handle
    named = name is not None and kind not in _CONTROL_KINDS
    if named:
        rt.claim_name(request, handle)
    if adapter.from_buffer is not None:
        convert = adapter.from_buffer
        handle.wrap = lambda result: _map_arrays(result, convert)
    try:
        if adapter.sync is not None and buffers:
            adapter.sync(buffers)
        return rt.engine.submit(request, wake)
    except BaseException:
        handle.observed = True  # never queued: free the name
        raise


def _entries(
    kind: CollectiveType, buffers: list[Array], ops: Any, splits: Sequence[Sequence[int] | None] | None,
    inplace: bool, outputs: Sequence[Array] | None,
) -> list[Entry]:
    if outputs is not None and len(outputs) != len(buffers):
        raise ValueError(f"{len(outputs)} outputs given for {len(buffers)} tensors")
    if splits is not None and len(splits) != len(buffers):
        raise ValueError(f"{len(splits)} split lists given for {len(buffers)} tensors")
    entries = []
    for i, buf in enumerate(buffers):
        if i and ops_for(buf) is not ops:
            raise TypeError("the tensors of one grouped collective must all be of one kind (NumPy or torch)")
        if kind == CollectiveType.ALLREDUCE:
            out = buf if inplace else outputs[i] if outputs is not None else ops.empty_like(buf)
        elif kind == CollectiveType.BROADCAST:
            if inplace:
                out = buf
            elif outputs is not None:
                out = outputs[i]
                ops.copy_(out, buf)
            else:
                out = ops.clone(buf)
        else:
            out = None
        entries.append(Entry(buf, out, list(splits[i]) if splits is not None and splits[i] is not None else None))
    return entries


def _map_arrays(result: Any, convert: Callable[[Array], Any]) -> Any:
    """Apply ``convert`` to every array in a result (lists and tuples are walked)."""
    if isinstance(result, list):
        return [_map_arrays(r, convert) for r in result]
    if isinstance(result, tuple):
        return tuple(_map_arrays(r, convert) for r in result)
    if isinstance(result, int | float | bool | type(None)):
        return result
    return convert(result)


__all__ = ["Adapter", "NUMPY_ADAPTER", "process_set_id", "submit"]
