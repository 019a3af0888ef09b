"""Autograd through collectives, as Horovod provides it.

The backward of each collective is the collective that moves gradients back:
allreduce's is an allreduce with the same operator, allgather's keeps this
rank's slice of the averaged gradient, broadcast's sends the averaged
gradient to the root only, alltoall's is the reverse alltoall, and
reducescatter's is an allgather.  Grouped forms do the same per tensor.
"""

from __future__ import annotations

import torch

from hora.core.ops import ReduceOp
from hora.torch import async_ops as mpi_ops


def _ps_size_rank(process_set) -> tuple[int, int]:
    from hora.core import runtime

    eng = runtime.current().engine
    ranks = process_set.ranks if process_set is not None and process_set.ranks is not None else list(range(eng.size))
    return len(ranks), ranks.index(eng.rank)


class HoraAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return mpi_ops.run_now(
            mpi_ops.allreduce_async,
            tensor,
            name=name,
            op=op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=process_set,
        )

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        out = mpi_ops.run_now(
            mpi_ops.allreduce_async,
            grad.contiguous(),
            op=op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=process_set,
        )
        return out, None, None, None, None, None


class HoraGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(
            mpi_ops.run_now(
                mpi_ops.grouped_allreduce_async,
                list(tensors),
                name=name,
                op=op,
                prescale_factor=prescale,
                postscale_factor=postscale,
                process_set=process_set,
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        outs = mpi_ops.run_now(
            mpi_ops.grouped_allreduce_async,
            [g.contiguous() for g in grads],
            op=op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=process_set,
        )
        return (None, None, None, None, None, *outs)


class HoraAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return mpi_ops.run_now(mpi_ops.allgather_async, tensor, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        reduced = mpi_ops.run_now(
            mpi_ops.allreduce_async, grad.contiguous(), op=ReduceOp.AVERAGE, process_set=ctx.process_set
        )
        rows = mpi_ops.run_now(
            mpi_ops.allgather_async, torch.tensor([ctx.rows], dtype=torch.int64), process_set=ctx.process_set
        )
        _, me = _ps_size_rank(ctx.process_set)
        offset = int(rows[:me].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


class HoraBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root = root_rank
        ctx.process_set = process_set
        return mpi_ops.run_now(mpi_ops.broadcast_async, tensor, root_rank, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        from hora.core import runtime

        reduced = mpi_ops.run_now(
            mpi_ops.allreduce_async, grad.contiguous(), op=ReduceOp.AVERAGE, process_set=ctx.process_set
        )
        if runtime.current().engine.rank != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


class HoraAlltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = mpi_ops.run_now(mpi_ops.alltoall_async, tensor, splits, name=name, process_set=process_set)
        ctx.received = received
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _grad_splits):
        back, _ = mpi_ops.run_now(mpi_ops.alltoall_async, grad.contiguous(), ctx.received, process_set=ctx.process_set)
        return back, None, None, None


class HoraReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = (op, process_set, prescale, postscale)
        return mpi_ops.run_now(
            mpi_ops.reducescatter_async,
            tensor,
            name=name,
            op=op,
            process_set=process_set,
            prescale_factor=prescale,
            postscale_factor=postscale,
        )

    @staticmethod
    def backward(ctx, grad):
        op, process_set, prescale, postscale = ctx.args
        grad = _reducescatter_grad_scale(grad, op, process_set, prescale, postscale)
        gathered = mpi_ops.run_now(mpi_ops.allgather_async, grad.contiguous(), process_set=process_set)
        return gathered, None, None, None, None, None


class HoraGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(mpi_ops.run_now(mpi_ops.grouped_allgather_async, list(tensors), name=name,
                                  process_set=process_set))

    @staticmethod
    def backward(ctx, *grads):
        reduced = mpi_ops.run_now(
            mpi_ops.grouped_allreduce_async, [g.contiguous() for g in grads], op=ReduceOp.AVERAGE,
            process_set=ctx.process_set,
        )
        rows = torch.tensor(ctx.rows, dtype=torch.int64).view(1, -1)
        all_rows = mpi_ops.run_now(mpi_ops.allgather_async, rows, process_set=ctx.process_set)  # (size, n)
        _, me = _ps_size_rank(ctx.process_set)
        offsets = all_rows[:me].sum(0).tolist()
        outs = [g.narrow(0, int(off), n) for g, off, n in zip(reduced, offsets, ctx.rows, strict=True)]
        return (None, None, *outs)


class HoraGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.args = (op, process_set, prescale, postscale)
        return tuple(mpi_ops.run_now(
            mpi_ops.grouped_reducescatter_async, list(tensors), name=name, op=op, process_set=process_set,
            prescale_factor=prescale, postscale_factor=postscale,
        ))

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, prescale, postscale = ctx.args
        scaled = [_reducescatter_grad_scale(g, op, process_set, prescale, postscale).contiguous() for g in grads]
        gathered = mpi_ops.run_now(mpi_ops.grouped_allgather_async, scaled, process_set=process_set)
        return (None, None, None, None, None, *gathered)


def _reducescatter_grad_scale(grad, op, process_set, prescale, postscale):
    """Scale a reducescatter gradient before it is allgathered, as Horovod 0.28.1 does.

    ``Sum`` multiplies by the process-set size, ``Average`` does not divide,
    and the pre/postscale factors apply again.  Scripts ported from Horovod
    are tuned to this convention, so hora keeps it.
    """
    scale = float(prescale) * float(postscale)
    if ReduceOp(op) == ReduceOp.SUM:
        scale *= _ps_size_rank(process_set)[0]
    return grad * scale if scale != 1.0 else grad
