"""Gradient compression for Keras 3 on any backend (Horovod's ``hvd.Compression``), through ``keras.ops``.

The casts are ``keras.ops`` casts; the stateful compressors
(``Compression.fp16.with_error_feedback()``, ``Compression.powersgd(rank=...)``)
are the core's (:mod:`hora.core.compression`), which the Keras reduction
hands the whole step's gradients.
"""

from __future__ import annotations

from typing import Any

import keras

from hora.core.compression import Compression as _CoreCompression
from hora.core.compression import Compressor, NoneCompressor


class KerasCompressor(Compressor):
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``."""


class _CastCompressor(KerasCompressor):
    """Casts floating tensors to ``wire_dtype`` for the trip."""

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:  # type: ignore[override]
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if dtype in ("float16", "float32", "float64", "bfloat16") and dtype != cls.wire_dtype:
            return keras.ops.cast(tensor, cls.wire_dtype), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return keras.ops.cast(tensor, ctx) if ctx is not None else tensor


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16."""

    wire_dtype = "float16"


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16."""

    wire_dtype = "bfloat16"


class Compression:
    """The built-in compressors, by Horovod's names, plus ``bf16`` and ``powersgd``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = staticmethod(_CoreCompression.powersgd)


__all__ = ["BF16Compressor", "Compression", "FP16Compressor", "KerasCompressor", "NoneCompressor"]
