"""Gradient compression for TensorFlow allreduces (Horovod's ``hvd.Compression``).

``compress(tensor)`` returns ``(tensor, ctx)`` and ``decompress(tensor, ctx)``
restores it, with ``tf.cast`` so that they work in graphs.  The stateful
compressors (``Compression.fp16.with_error_feedback()``,
``Compression.powersgd(rank=...)``) are the core's
(:mod:`hora.core.compression`); :func:`reduce_compressed` hands them a
step's gradients.  :class:`CompressionState` puts a stateful compressor's
state in a ``tf.train.Checkpoint``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hora._keras.compression_state import state_from_bytes, state_name, state_to_bytes
from hora.core.compression import Compression as _CoreCompression
from hora.core.compression import Compressor, PowerSGD, is_stateful


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


class CompressionState(tf.train.experimental.PythonState):
    """A stateful compressor's state (step, residuals, PowerSGD's factors) as part of a ``tf.train.Checkpoint``.

    ::

        compression = hvd.Compression.powersgd(rank=2)
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt, compression=hvd.CompressionState(compression))
        ...
        with tf.GradientTape() as tape:
            loss = ...
        tape = hvd.DistributedGradientTape(tape, compression=compression)

    Residuals are each rank's own: every rank saves its own checkpoint to
    resume exactly (a rank that restores another rank's, or one saved at
    another world size, starts its residuals from zero).  The distributed
    Keras optimizers on TensorFlow carry one already, as their attribute
    ``hora_compression``, so ``tf.train.Checkpoint(optimizer=opt)`` saves it.

    Args:
        compressor: the stateful compressor, or a function returning it (or
            None while there is none: a restored state then waits for it).
    """

    def __init__(self, compressor: Any | Callable[[], Any]) -> None:
        self._find = compressor if callable(compressor) and not is_stateful(compressor) else (lambda: compressor)
        self._pending: dict[str, Any] | None = None

    def serialize(self) -> bytes:
        """The compressor's state as bytes (an empty state where there is no compressor yet)."""
        compressor = self._find()
        if compressor is None:
            return state_to_bytes(self._pending or {"step": 0, "tensors": {}})
        return state_to_bytes(compressor.state_dict())

    def deserialize(self, string_value: bytes) -> None:
        """Load a state :meth:`serialize` wrote into the compressor (applied at its next step)."""
        state = state_from_bytes(string_value)
        compressor = self._find()
        if compressor is None:
            self._pending = state
        else:
            compressor.load_state_dict(state)


def track_optimizer_compression(optimizer: Any) -> Any:
    """Give a distributed Keras optimizer on TensorFlow a :class:`CompressionState` that checkpoints track.

    Set as its attribute ``hora_compression``, a trackable child: a
    ``tf.train.Checkpoint`` holding the optimizer saves and restores the
    compressor's state with the optimizer's variables.  Returns ``optimizer``.
    """
    from hora._keras.optimizer import compressor_of

    if isinstance(optimizer, tf.__internal__.tracking.Trackable) and getattr(optimizer, "hora_compression",
                                                                            None) is None:
        optimizer.hora_compression = CompressionState(lambda: compressor_of(optimizer))
    return optimizer


def reduce_compressed(grads: Sequence[Any], variables: Sequence[Any] | None, reduction: Any) -> list[Any]:
    """``grads`` reduced through the stateful compressor of ``reduction`` (a ``GradientReduction``), in one call.

    What :func:`hora.tensorflow.gradients.reduce_gradients` does when the
    compressor is stateful.  ``None`` gradients of known variables become
    zeros (every rank must hand over the same list); ``IndexedSlices`` become
    dense.  The compressor keeps its state under the variables' names
    (positions when no variables are given); ``groups`` change nothing.
    """
    from hora.tensorflow import mpi_ops

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
        names.append(state_name(i, v))
    out = list(grads)
    if not dense:
        return out
    reduced = mpi_ops.compressed_allreduce(dense, names, reduction.compression, reduction.op, reduction.prescale,
                                           reduction.postscale, reduction.process_set)
    for i, r in zip(idx, reduced, strict=True):
        out[i] = r
    return out


__all__ = ["BF16Compressor", "Compression", "CompressionState", "FP16Compressor", "NoneCompressor", "PowerSGD",
           "TFCompressor", "reduce_compressed", "track_optimizer_compression"]
