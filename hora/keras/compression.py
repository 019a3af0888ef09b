"""Gradient compression for Keras 3 on any backend (Horovod's ``hvd.Compression``), through ``keras.ops``."""

from __future__ import annotations

from typing import Any

import keras


class KerasCompressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(KerasCompressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(KerasCompressor):
    """Sends floating-point tensors as float16."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if dtype in ("float32", "float64", "bfloat16"):
            return keras.ops.cast(tensor, "float16"), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return keras.ops.cast(tensor, ctx) if ctx is not None else tensor


class Compression:
    """The built-in compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
