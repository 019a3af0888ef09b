"""Averaging a list of gradients across ranks: what the tapes and optimizers of hora.tensorflow share.

Dense gradients travel as one grouped allreduce (one negotiation, one fused
buffer and, inside a graph, one ``py_function`` call per step), or as
``groups`` of them; ``IndexedSlices`` are allgathered unless
``sparse_as_dense`` turns them into dense tensors first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hora.core.frontend import resolve_op
from hora.core.ops import ReduceOp
from hora.core.runtime import ProcessSet, global_process_set
from hora.tensorflow import mpi_ops
from hora.tensorflow.compression import Compression

GradientsFn = Callable[[Sequence[Any], Sequence[Any] | None], list[Any]]


def _split(items: list[Any], n: int) -> list[list[Any]]:
    size = -(-len(items) // n)
    return [items[i: i + size] for i in range(0, len(items), size)]


def make_allreduce_grads_fn(compression: Any = Compression.none, sparse_as_dense: bool = False,
                            op: ReduceOp | int = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                            groups: int | Sequence[Sequence[tf.Variable]] | None = None,
                            process_set: ProcessSet = global_process_set) -> GradientsFn:
    """A function ``(grads, variables) -> reduced grads`` with Horovod's DistributedOptimizer options.

    ``None`` gradients stay ``None``.  With a single-rank process set, or on a
    rank outside it, gradients are returned unchanged, as in Horovod.

    Raises:
        ValueError: ``gradient_predivide_factor`` with an op other than Average.
    """
    op = resolve_op(None, op)
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor is only valid with op=hvd.Average")
    prescale, postscale = 1.0 / gradient_predivide_factor, float(gradient_predivide_factor)
    compression = compression or Compression.none

    def reduce_group(grads: list[Any]) -> list[Any]:
        return mpi_ops.grouped_allreduce(grads, compression=compression, op=op, prescale_factor=prescale,
                                         postscale_factor=postscale, process_set=process_set)

    def allreduce_grads(grads: Sequence[Any], variables: Sequence[Any] | None = None) -> list[Any]:
        grads = list(grads)
        ranks = process_set.ranks
        if ranks is not None and (len(ranks) <= 1 or not process_set.included()):
            return grads
        if sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        if isinstance(groups, int) and groups > 0:
            index_groups = _split(present, groups)
        elif groups is not None and not isinstance(groups, int):
            if variables is None:
                raise ValueError("groups given as lists of variables need the variables of the gradients")
            where = {id(v): i for i, v in enumerate(variables)}
            index_groups, taken = [], set()
            for group in groups:
                idx = [where[id(v)] for v in group if id(v) in where and grads[where[id(v)]] is not None]
                taken.update(idx)
                if idx:
                    index_groups.append(idx)
            index_groups += [[i] for i in present if i not in taken]
        else:
            index_groups = [present]
        out = list(grads)
        for idx in index_groups:
            for i, r in zip(idx, reduce_group([grads[i] for i in idx]), strict=True):
                out[i] = r
        return out

    return allreduce_grads


def scale_local(grad: Any, size: int) -> Any:
    """A local (not reduced) gradient divided by the set size, as Horovod does for registered local sources."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / float(size), grad.indices, grad.dense_shape)
    return grad / tf.cast(size, grad.dtype)


__all__ = ["make_allreduce_grads_fn", "scale_local"]
