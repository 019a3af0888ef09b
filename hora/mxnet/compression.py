"""Gradient compression for the allreduce path (Horovod's ``hvd.Compression`` for MXNet)."""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np


class NDArrayCompressor:
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
    """The built-in compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
