"""The gradient reduction of each Keras 3 backend: TensorFlow's is :mod:`hora.tensorflow.gradients`, torch's is here.

A distributed Keras optimizer calls one function with the signature
``reduce(grads, variables, reduction) -> grads``; :func:`backend_reduce`
picks it from the backend Keras runs on.  On TensorFlow the step is a graph,
so the reduction is hora.tensorflow's (its collectives are graph ops); on
torch the tensors go to the core as they are.  JAX is refused: its train step
is compiled by ``jax.jit``, where hora's collectives cannot run.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from hora._keras.compression_state import state_name
from hora._keras.optimizer import ReduceFn
from hora.core import collectives
from hora.core.collectives import Adapter
from hora.core.compression import is_stateful
from hora.core.frontend import GradientReduction
from hora.core.ops import CollectiveType
from hora.errors import UnsupportedError

JAX_MESSAGE = ("hora.keras does not support the JAX backend: its train step is compiled by jax.jit, where hora's "
               "collectives cannot run; use KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch")

@functools.cache
def _torch_adapter() -> Adapter:
    from hora.core.buffers.torch_ops import wait_for_stream

    return Adapter(to_buffer=lambda t: t.detach().contiguous(), sync=wait_for_stream)


def reduce_torch_gradients(grads: Sequence[Any], variables: Sequence[Any] | None,
                           reduction: GradientReduction) -> list[Any]:
    """Torch gradients (Keras's torch backend) reduced across the process set of ``reduction``, in their order.

    The compressor is applied here, once per gradient; each of ``groups`` is
    one grouped allreduce, all submitted before the first is waited for.
    ``None`` gradients stay ``None``; on a single-rank set, or a rank outside
    it, gradients come back unchanged.

    Raises:
        ValueError: ``groups`` names variables but ``variables`` is None.
    """
    grads = list(grads)
    if reduction.skips():
        return grads
    compression = reduction.compression
    if is_stateful(compression):  # PowerSGD, error feedback: the whole step in one call
        return _reduce_compressed(grads, variables, reduction)
    index_groups = reduction.index_groups(grads, variables)
    pending = []
    for n, idx in enumerate(index_groups):
        group = [grads[i] for i in idx]
        ctxs: list[Any] = [None] * len(group)
        if compression is not None:
            for j, g in enumerate(group):
                group[j], ctxs[j] = compression.compress(g)
        # the last submission is waited for at once: this thread runs the round (see collectives.submit)
        handle = collectives.submit(CollectiveType.ALLREDUCE, group, op=reduction.op, prescale=reduction.prescale,
                                    postscale=reduction.postscale, process_set=reduction.process_set,
                                    adapter=_torch_adapter(), wake=n < len(index_groups) - 1)
        pending.append((idx, ctxs, handle))
    out = list(grads)
    for idx, ctxs, handle in pending:
        for i, r, ctx in zip(idx, handle.wait(), ctxs, strict=True):
            out[i] = r if compression is None else compression.decompress(r, ctx)
    return out


def _reduce_compressed(grads: list[Any], variables: Sequence[Any] | None, reduction: GradientReduction) -> list[Any]:
    """Torch gradients through a stateful compressor, which reduces copies of them in place, state kept by name."""
    import keras

    idx, buffers, names = [], [], []
    for i, g in enumerate(grads):
        v = variables[i] if variables is not None else None
        if g is None:
            if v is None:
                continue
            g = keras.ops.zeros_like(v)  # every rank hands over the same list
        idx.append(i)
        buffers.append(g.detach().clone().contiguous())
        names.append(state_name(i, v))
    reduction.compression.reduce(buffers, names, op=reduction.op, prescale=reduction.prescale,
                                 postscale=reduction.postscale, process_set=reduction.process_set)
    out = list(grads)
    for i, b in zip(idx, buffers, strict=True):
        out[i] = b
    return out


def backend_reduce(backend: str) -> ReduceFn:
    """The gradient reduction of Keras backend ``backend`` (``keras.backend.backend()``).

    Raises:
        UnsupportedError: the JAX backend, or one hora does not know.
    """
    if backend == "tensorflow":
        from hora.tensorflow.gradients import reduce_gradients

        return reduce_gradients
    if backend == "torch":
        return reduce_torch_gradients
    if backend == "jax":
        raise UnsupportedError(JAX_MESSAGE)
    raise UnsupportedError(f"hora.keras does not know Keras's {backend!r} backend; use tensorflow or torch")


__all__ = ["JAX_MESSAGE", "backend_reduce", "reduce_torch_gradients"]
