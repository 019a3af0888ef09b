"""Gradient compression for the allreduce path (Horovod's ``hvd.Compression`` for MXNet).

The casts are NDArray casts; the stateful compressors
(``Compression.fp16.with_error_feedback()``, ``Compression.powersgd(rank=...)``)
are the core's (:mod:`hora.core.compression`), which ``DistributedTrainer``
hands the whole step's gradients as NumPy arrays.
"""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np

from hora.core.compression import Compression as _CoreCompression
from hora.core.compression import Compressor


class NDArrayCompressor(Compressor):
    """Interface: ``compress`` returns ``(array, ctx)``, ``decompress(array, ctx)`` restores the original."""

    @staticmethod
    def compress(tensor: mx.nd.NDArray) -> tuple[mx.nd.NDArray, Any]:
        """The array to send and what ``decompress`` needs to restore it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
        """The received array back in its original form."""
        raise NotImplementedError


class NoneCompressor(NDArrayCompressor):
    """Sends arrays as they are."""

    @staticmethod
    def compress(tensor: mx.nd.NDArray) -> tuple[mx.nd.NDArray, Any]:
        """The array to send and what ``decompress`` needs to restore it."""
        return tensor, None

    @staticmethod
    def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
        """The received array back in its original form."""
        return tensor


class FP16Compressor(NDArrayCompressor):
    """Sends floating-point arrays as float16, halving the bytes on the wire; other dtypes travel as they are."""

    wire_dtype = "float16"

    @staticmethod
    def compress(tensor: mx.nd.NDArray) -> tuple[mx.nd.NDArray, Any]:
        """The array to send and what ``decompress`` needs to restore it."""
        dtype = np.dtype(tensor.dtype)
        if dtype.kind == "f" and dtype != np.float16:
            return tensor.astype("float16", copy=False), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
        """The received array back in its original form."""
        return tensor.astype(ctx, copy=False) if ctx is not None else tensor


class Compression:
    """The built-in compressors, by Horovod's names, plus ``powersgd`` (MXNet 1.9 has no bfloat16 arrays)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    powersgd = staticmethod(_CoreCompression.powersgd)
