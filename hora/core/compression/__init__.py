"""Gradient compression, once for every binding: Horovod's stateless casts and stateful compressors.

* :class:`Compression` names the built-ins: ``none``, ``fp16``, ``bf16``
  (stateless, Horovod's ``compress``/``decompress``), ``fp16.with_error_feedback()``
  and ``powersgd(rank=...)`` (stateful: one object per optimizer, holding
  that optimizer's per-tensor state).
* :class:`CastExchange`: how a binding sends a step's gradients under
  ``fp16``/``bf16``: cast straight into one flat wire buffer, chunk by chunk.
* The math runs here on engine buffers (NumPy arrays, torch tensors) through
  :mod:`hora.core.buffers`; a binding hands over a step's gradients and
  names, and :meth:`StatefulCompressor.reduce` leaves the reduced values in
  them.
"""

from __future__ import annotations

from hora.core.compression.base import (
    BF16Compressor,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    StatefulCompressor,
    WireBuffers,
    gradient_name,
    is_builtin_cast,
    is_stateful,
)
from hora.core.compression.cast import CastExchange
from hora.core.compression.feedback import ErrorFeedback
from hora.core.compression.powersgd import PowerSGD
from hora.core.compression.state import TensorStateCompressor


class Compression:
    """The built-in compressors, by Horovod's names, plus ``bf16`` and ``powersgd``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def powersgd(rank: int = 1, start_step: int = 0, min_compression_rate: float = 2.0, warm_start: bool = True,
                 error_feedback: bool = True, seed: int = 0) -> PowerSGD:
        """A new :class:`PowerSGD` compressor (one per optimizer); see its arguments there."""
        return PowerSGD(rank, start_step, min_compression_rate, warm_start, error_feedback, seed)


def parse_spec(spec: str) -> Compressor | StatefulCompressor | type:
    """A compressor from a command-line spelling: ``none``, ``fp16``, ``bf16``, ``fp16+ef``, ``powersgd:4``.

    Raises:
        ValueError: an unknown name or a bad rank; the message lists the spellings.
    """
    name, _, arg = spec.strip().lower().partition(":")
    if name in ("none", "fp16", "bf16") and not arg:
        return getattr(Compression, name)
    if name in ("fp16+ef", "bf16+ef") and not arg:
        return getattr(Compression, name[:4]).with_error_feedback()
    if name == "powersgd":
        try:
            rank = int(arg or 1)
        except ValueError:
            raise ValueError(f"powersgd rank {arg!r} is not an integer (e.g. powersgd:4)") from None
        return Compression.powersgd(rank=rank)
    raise ValueError(f"unknown compression {spec!r}: use none, fp16, bf16, fp16+ef, bf16+ef or powersgd:RANK")


__all__ = ["BF16Compressor", "CastExchange", "Compression", "Compressor", "ErrorFeedback", "FP16Compressor",
           "NoneCompressor", "PowerSGD", "StatefulCompressor", "TensorStateCompressor", "WireBuffers", "gradient_name",
           "is_builtin_cast", "is_stateful", "parse_spec"]
