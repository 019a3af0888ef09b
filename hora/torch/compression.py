"""Gradient compression for the allreduce path (Horovod's ``hvd.Compression``), from :mod:`hora.core.compression`.

torch tensors are engine buffers, so the core's compressors serve them as
they are: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor,
ctx)`` for the stateless casts (``none``, ``fp16``, ``bf16``), and the
stateful ones (``Compression.fp16.with_error_feedback()``,
``Compression.powersgd(rank=...)``) for :func:`hora.torch.DistributedOptimizer`.
"""

from __future__ import annotations

from hora.core.compression import (
    BF16Compressor,
    Compression,
    Compressor,
    ErrorFeedback,
    FP16Compressor,
    NoneCompressor,
    PowerSGD,
    StatefulCompressor,
)

__all__ = ["BF16Compressor", "Compression", "Compressor", "ErrorFeedback", "FP16Compressor", "NoneCompressor",
           "PowerSGD", "StatefulCompressor"]
