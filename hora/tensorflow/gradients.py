"""Reducing a list of gradients across ranks on TensorFlow: the one reduction of every optimizer and tape on it.

``DistributedGradientTape``, the ``tf.compat.v1`` ``DistributedOptimizer``,
and the Keras optimizers of ``hora.tensorflow.keras`` and of ``hora.keras`` on
Keras's TensorFlow backend all reduce their gradients with
:func:`reduce_gradients`, given a :class:`~hora.core.frontend.GradientReduction`
built (and checked) once from Horovod's options.  Dense gradients travel as one
grouped allreduce (one negotiation, one fused buffer and, inside a graph, one
``py_function`` call per step), or as ``groups`` of them; ``IndexedSlices``
are allgathered unless ``sparse_as_dense`` turns them into dense tensors first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hora.core.compression import is_stateful
from hora.core.frontend import GradientReduction
from hora.tensorflow import mpi_ops
from hora.tensorflow.compression import reduce_compressed


@tf.autograph.experimental.do_not_convert
def reduce_gradients(grads: Sequence[Any], variables: Sequence[Any] | None,
                     reduction: GradientReduction) -> list[Any]:
    """``grads`` reduced across the process set of ``reduction``, in their order; ``None`` gradients stay ``None``.

    The compressor of ``reduction`` is applied here, once per dense gradient
    (``IndexedSlices`` travel uncompressed, as in Horovod).  With a
    single-rank process set, or on a rank outside it, gradients are returned
    unchanged, as in Horovod.  ``variables`` are the gradients' variables,
    needed only when ``groups`` names variables.

    Raises:
        ValueError: ``groups`` names variables but ``variables`` is None.
    """
    grads = list(grads)
    if reduction.skips():
        return grads
    if is_stateful(reduction.compression):  # PowerSGD, error feedback: the whole step in one call
        return reduce_compressed(grads, variables, reduction)
    if reduction.sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    compression = reduction.compression
    out = list(grads)
    for idx in reduction.index_groups(grads, variables):
        group = [grads[i] for i in idx]
        ctxs = [None] * len(group)
        if compression is not None:
            for j, g in enumerate(group):
                if not isinstance(g, tf.IndexedSlices):
                    group[j], ctxs[j] = compression.compress(g)
        reduced = mpi_ops.allreduce_group(group, op=reduction.op, prescale_factor=reduction.prescale,
                                          postscale_factor=reduction.postscale, process_set=reduction.process_set)
        for i, r, g, ctx in zip(idx, reduced, group, ctxs, strict=True):
            out[i] = r if compression is None or isinstance(g, tf.IndexedSlices) else compression.decompress(r, ctx)
    return out


def scale_local(grad: Any, size: int) -> Any:
    """A local (not reduced) gradient divided by the set size, as Horovod does for registered local sources."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / float(size), grad.indices, grad.dense_shape)
    return grad / tf.cast(size, grad.dtype)


__all__ = ["reduce_gradients", "scale_local"]
