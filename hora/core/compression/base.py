"""The two kinds of compressor: Horovod's stateless casts, and stateful compressors that own per-tensor state.

A *stateless* compressor is Horovod's API: ``compress(tensor) -> (tensor,
ctx)`` before the allreduce and ``decompress(tensor, ctx)`` after it, static
methods with nothing kept between steps.  Scripts written that way keep
working in every binding.

A *stateful* compressor (:class:`StatefulCompressor`) takes a whole step's
gradients at once and reduces them itself, in place: it may send something
other than the gradients (PowerSGD's factors), in fused collectives that it
submits through :func:`hora.core.collectives.submit`, and it keeps what must
survive between steps (error-feedback residuals, PowerSGD's warm-start
factors) per tensor name, in ``state_dict()``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

from hora.core.buffers import Array, ops_for
from hora.core.ops import ReduceOp
from hora.errors import ConfigError

#: the floating dtypes a lossy compressor works on; other dtypes travel unchanged.
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


class Compressor:
    """Horovod's interface: ``compress`` returns ``(tensor, ctx)``, ``decompress(tensor, ctx)`` restores it.

    The built-in subclasses work on engine buffers (NumPy arrays, torch
    tensors); a binding whose tensors are not engine buffers (TensorFlow,
    MXNet) subclasses them with its own casts and keeps ``wire_dtype``, which
    is all the stateful wrappers need.
    """

    #: the dtype floating tensors travel in (None: unchanged).
    wire_dtype: ClassVar[str | None] = None

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """The tensor to send and what ``decompress`` needs to restore it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """The received tensor restored with ``ctx``."""
        raise NotImplementedError

    @classmethod
    def with_error_feedback(cls) -> StatefulCompressor:
        """This cast with error feedback: what the cast loses on a step is added to the next step's gradient.

        Returns a new :class:`~hora.core.compression.feedback.ErrorFeedback`
        object (one per optimizer: it holds that optimizer's residuals).
        """
        from hora.core.compression.feedback import ErrorFeedback

        return ErrorFeedback(cls.wire_dtype, label=cls.__name__)


class _CastCompressor(Compressor):
    """Casts floating tensors to ``wire_dtype`` for the trip and back afterwards."""

    @classmethod
    def compress(cls, tensor: Array) -> tuple[Array, Any]:  # type: ignore[override]
        ops = ops_for(tensor)
        dtype = ops.dtype_name(tensor)
        if dtype in FLOAT_DTYPES and dtype != cls.wire_dtype:
            return ops.astype(tensor, cls.wire_dtype), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Array, ctx: Any) -> Array:
        return tensor if ctx is None else ops_for(tensor).astype(tensor, ctx)


def is_builtin_cast(compression: Any) -> bool:
    """True for ``Compression.fp16`` / ``bf16`` (or a subclass that keeps their casts): wire buffers may be reused."""
    return (isinstance(compression, type) and issubclass(compression, _CastCompressor)
            and getattr(compression.compress, "__func__", None) is _CastCompressor.compress.__func__
            and compression.decompress is _CastCompressor.decompress)


class WireBuffers:
    """The wire copies of a binding's gradients under a built-in cast, kept from one step to the next.

    ``compress`` casts into the buffer kept for the gradient's key (its
    parameter), and ``decompress_into`` casts the reduced result straight
    into the gradient.  Horovod's ``compress``/``decompress`` allocate both
    a wire tensor and a full-precision one every step, which for VGG16's
    528 MiB of gradients cost 2.4-5x the CPU of the casts themselves
    (fresh pages, then a copy; docs/benchmarks.md).  Other compressors go
    through their own ``compress``/``decompress`` unchanged.  A buffer is
    reused only after the binding has waited for the collective that read
    it, as an optimizer does before its next step.
    """

    def __init__(self) -> None:
        self._buffers: dict[Any, Array] = {}

    def compress(self, compression: Any, tensor: Array, key: Any) -> tuple[Array, Any]:
        """``compression.compress(tensor)``, into the buffer kept under ``key`` when it is a built-in cast."""
        if not is_builtin_cast(compression):
            return compression.compress(tensor)
        ops = ops_for(tensor)
        dtype = ops.dtype_name(tensor)
        if dtype not in FLOAT_DTYPES or dtype == compression.wire_dtype:
            return tensor, None
        buf = self._buffers.get(key)
        shape, device = tuple(ops.shape(tensor)), ops.device(tensor)
        if (buf is None or tuple(ops.shape(buf)) != shape or ops.device(buf) != device
                or ops.dtype_name(buf) != compression.wire_dtype):
            buf = self._buffers[key] = ops.empty(shape, compression.wire_dtype, device)
        ops.copy_(buf, tensor)  # the cast
        return buf, dtype

    @staticmethod
    def decompress_into(compression: Any, tensor: Array, ctx: Any, out: Array) -> None:
        """Write ``compression.decompress(tensor, ctx)`` into ``out`` (a built-in cast: one cast, no temporary)."""
        ops = ops_for(out)
        ops.copy_(out, tensor if is_builtin_cast(compression) else compression.decompress(tensor, ctx))

    def clear(self) -> None:
        """Drop the kept buffers (their memory goes back)."""
        self._buffers.clear()


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16, halving the bytes on the wire."""

    wire_dtype = "float16"


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16: float32's range with float16's size."""

    wire_dtype = "bfloat16"


class StatefulCompressor(abc.ABC):
    """A compressor that reduces a whole step's gradients itself and keeps per-tensor state between steps.

    To write one, subclass and implement :meth:`reduce`, :meth:`settings`,
    :meth:`state_dict` and :meth:`load_state_dict`.  ``reduce`` receives the
    step's gradients as engine buffers and must leave the reduced values in
    them, on every rank; the collectives it needs go through
    :func:`hora.core.compression.exchange.allreduce_flat` (one entry point,
    named, fused up to the fusion threshold).  ``settings`` is what must be
    equal on every rank: each ``reduce`` of the built-in ones compares a
    digest of it, the step counter and the tensor list across ranks first (see
    :func:`hora.core.compression.exchange.check_in_step`) and fails on every
    rank, naming the tensor and the setting, where they differ.

    One object belongs to one optimizer: its state is that optimizer's.
    """

    #: Horovod-compatible: the bindings' plain paths test ``compression is Compression.none``.
    stateful: ClassVar[bool] = True

    @abc.abstractmethod
    def reduce(self, tensors: Sequence[Array], names: Sequence[str], *, op: ReduceOp = ReduceOp.AVERAGE,
               prescale: float = 1.0, postscale: float = 1.0, process_set: Any = None) -> None:
        """Reduce ``tensors`` across the process set in place (``op``: Average or Sum), updating the state."""

    @abc.abstractmethod
    def settings(self) -> dict[str, Any]:
        """The options that every rank must share, as plain values."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state to save with the optimizer (arrays of the gradients' family, plain values)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a :meth:`state_dict`; applied to each tensor at its next step."""

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Refused: a stateful compressor reduces a whole step at once, not one tensor on its own.

        Raises:
            ConfigError: says where it can be used.
        """
        raise ConfigError(f"{self!r} is a stateful compressor: pass it as compression= to DistributedOptimizer "
                          "(or DistributedGradientTape / DistributedTrainer), or call its reduce(tensors, names); "
                          "a single collective takes Compression.none, fp16 or bf16")

    def decompress(self, tensor: Any, ctx: Any = None) -> Any:
        """Refused, as :meth:`compress`."""
        return self.compress(tensor)

    def check_op(self, op: ReduceOp, kind: str = "allreduce") -> None:
        """Refuse what a compressor cannot serve: anything but an Average or Sum allreduce.

        Raises:
            ConfigError: names the compressor, the op or collective, and what to use instead.
        """
        if kind != "allreduce":
            raise ConfigError(f"{self!r} compresses allreduces only, not {kind}; pass compression=None "
                              "(or Compression.fp16) to this call")
        if ReduceOp(op) not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ConfigError(f"{self!r} approximates sums of gradients: op={ReduceOp(op).name} cannot be "
                              "compressed; use op=hvd.Average or hvd.Sum, or compression=Compression.none")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items() if k != "kind")
        return f"{self.settings().get('kind', type(self).__name__)}({args})"


def gradient_name(index: int, variable: Any = None) -> str:
    """The name a stateful compressor keeps a gradient's state under: its position and its variable's name.

    Keras variables give their ``path`` (stable across processes), TensorFlow
    variables their ``name``; without a variable the position alone.
    """
    if variable is None:
        return f"grad.{index}"
    return f"{index}.{getattr(variable, 'path', None) or getattr(variable, 'name', 'var')}"


def is_stateful(compression: Any) -> bool:
    """True for a :class:`StatefulCompressor` (or anything that declares ``stateful = True`` and ``reduce``)."""
    return bool(getattr(compression, "stateful", False)) and hasattr(compression, "reduce")


__all__ = ["BF16Compressor", "Compressor", "FLOAT_DTYPES", "FP16Compressor", "NoneCompressor",
           "StatefulCompressor", "WireBuffers", "gradient_name", "is_builtin_cast", "is_stateful"]
