"""Horovod's torch collectives (``horovod.torch.mpi_ops``) on hora's engine.

The synchronous forms here are differentiable (:mod:`hora.torch.autograd`);
the asynchronous and in-place forms, with :func:`poll` and
:func:`synchronize`, live in :mod:`hora.torch.async_ops` and are re-exported
here, so ``from horovod.torch.mpi_ops import ...`` has a hora equivalent.
"""

from __future__ import annotations

import torch

from hora.core.runtime import global_process_set
from hora.torch.async_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    resolve_op,
    run_now,
    sparse_allreduce_async,
    synchronize,
)
from hora.torch.autograd import (
    HoraAllgather,
    HoraAllreduce,
    HoraAlltoall,
    HoraBroadcast,
    HoraGroupedAllgather,
    HoraGroupedAllreduce,
    HoraGroupedReducescatter,
    HoraReducescatter,
)
from hora.torch.compression import Compression


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks of the process set and return the result.

    Differentiable: the gradient is reduced with the same operator.
    """
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    op = resolve_op(average, op)
    if torch.is_grad_enabled() and compressed.requires_grad:
        out = HoraAllreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    else:  # nothing to differentiate: skip the autograd node, which costs as much as a small collective
        out = run_now(allreduce_async, compressed, name=name, op=op, prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, process_set=process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> list[torch.Tensor]:
    """Synchronous, differentiable :func:`grouped_allreduce_async`."""

    compression = compression or Compression.none
    pairs = [compression.compress(t) for t in tensors]
    op = resolve_op(average, op)
    outs = HoraGroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                      *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs, strict=True)]


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0; differentiable."""

    return HoraAllgather.apply(tensor, name, process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list[torch.Tensor]:
    """Synchronous, differentiable :func:`grouped_allgather_async`."""

    return list(HoraGroupedAllgather.apply(name, process_set, *tensors))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """The root's ``tensor`` on every rank; differentiable."""

    return HoraBroadcast.apply(tensor, root_rank, name, process_set)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatter rows of ``tensor`` to all ranks and gather theirs; differentiable.

    Returns:
        The gathered output when ``splits`` is None (equal split), else
        ``(output, received_splits)``, as Horovod does.
    """

    output, received = HoraAlltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def reducescatter(tensor, name=None, compression=None, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and return this rank's block of rows; differentiable."""

    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    out = HoraReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=None, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0) -> list[torch.Tensor]:
    """Synchronous, differentiable :func:`grouped_reducescatter_async`."""

    compression = compression or Compression.none
    pairs = [compression.compress(t) for t in tensors]
    outs = HoraGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                          *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs, strict=True)]


__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]
