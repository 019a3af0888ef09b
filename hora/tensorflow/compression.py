"""Gradient compression for TensorFlow allreduces (Horovod's ``hvd.Compression``).

``compress(tensor)`` returns ``(tensor, ctx)`` and ``decompress(tensor, ctx)``
restores it, with ``tf.cast`` so that they work in graphs.  The stateful
compressors (``Compression.fp16.with_error_feedback()``,
``Compression.powersgd(rank=...)``) are the core's
(:mod:`hora.core.compression`); :func:`make_compressed_grads_fn` hands them a
step's gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hora.core.compression import Compression as _CoreCompression
from hora.core.compression import Compressor, PowerSGD
from hora.core.frontend import resolve_op
from hora.core.ops import ReduceOp
from hora.core.runtime import ProcessSet, global_process_set

GradientsFn = Any


class TFCompressor(Compressor):
    """Interface: ``compress`` returns ``(tensor, ctx)``, ``decompress(tensor, ctx)`` restores the original."""


class NoneCompressor(TFCompressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class _CastCompressor(TFCompressor):
    """Casts floating tensors to ``wire_dtype`` for the trip."""

    @classmethod
    def compress(cls, tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:  # type: ignore[override]
        if tensor.dtype.is_floating and tensor.dtype.name != cls.wire_dtype:
            return tf.cast(tensor, cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tf.cast(tensor, ctx) if ctx is not None else tensor


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16, halving the bytes on the wire."""

    wire_dtype = "float16"


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16: float32's range with float16's size."""

    wire_dtype = "bfloat16"


class Compression:
    """The built-in compressors, by Horovod's names, plus ``bf16`` and ``powersgd``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = staticmethod(_CoreCompression.powersgd)


def make_compressed_grads_fn(compressor: Any, sparse_as_dense: bool = False, op: ReduceOp | int = ReduceOp.AVERAGE,
                             gradient_predivide_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GradientsFn:
    """A function ``(grads, variables) -> reduced grads`` that reduces through a stateful ``compressor``.

    Every gradient of the step goes in one call: ``None`` gradients of known
    variables become zeros (every rank must hand over the same list),
    ``IndexedSlices`` become dense.  The compressor's state is kept under the
    variables' names (positions when no variables are given).

    Raises:
        ConfigError: ``op`` other than Average or Sum.
        ValueError: ``gradient_predivide_factor`` with an op other than Average.
    """
    from hora.tensorflow import mpi_ops

    op = resolve_op(None, op)
    compressor.check_op(op)
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor is only valid with op=hvd.Average")
    prescale, postscale = 1.0 / gradient_predivide_factor, float(gradient_predivide_factor)
    del sparse_as_dense  # a stateful compressor reduces dense tensors only

    def allreduce_grads(grads: Sequence[Any], variables: Sequence[Any] | None = None) -> list[Any]:
        grads = list(grads)
        ranks = process_set.ranks
        if ranks is not None and (len(ranks) <= 1 or not process_set.included()):
            return grads
        idx, dense, names = [], [], []
        for i, g in enumerate(grads):
            v = variables[i] if variables is not None else None
            if g is None:
                if v is None:
                    continue
                g = tf.zeros_like(v)
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            idx.append(i)
            dense.append(g)
            names.append(f"{i}.{_variable_name(v)}" if v is not None else f"grad.{i}")
        if not dense:
            return grads
        out = list(grads)
        for i, r in zip(idx, mpi_ops.compressed_allreduce(dense, names, compressor, op, prescale, postscale,
                                                          process_set), strict=True):
            out[i] = r
        return out

    return allreduce_grads


def _variable_name(v: Any) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", "var"))


__all__ = ["BF16Compressor", "Compression", "FP16Compressor", "NoneCompressor", "PowerSGD", "TFCompressor",
           "make_compressed_grads_fn"]
