"""Array families: the few operations the engine needs, for each kind of buffer it accepts.

The engine moves data between buffers without knowing which framework made
them.  Each *family* of buffers gets one :class:`ArrayOps` object that knows
how to allocate, cast, scale, pack and view that family's arrays:

* ``numpy``: host memory as NumPy arrays.  Anything else on the host that
  exposes DLPack or the buffer protocol is viewed as a NumPy array first
  (:func:`as_buffer`), so a binding for TensorFlow or MXNet hands the engine
  NumPy arrays and gets NumPy arrays back.
* ``torch``: torch tensors on the CPU or a GPU, reduced in their own memory
  (zero-copy) and, on CUDA, through NCCL.  Its module imports torch, so it is
  loaded only when a torch tensor is actually submitted.

Dtypes travel between ranks and layers as short names (``float32``,
``bfloat16``, ``bool``), never as framework objects.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np

Array = Any  # an array of one family: numpy.ndarray, torch.Tensor

#: bytes per element of every dtype the engine carries.
ITEMSIZE: dict[str, int] = {
    "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "bool": 1,
}
#: dtypes every backend can reduce without conversion.
ARITHMETIC_DTYPES = frozenset({"uint8", "int8", "int32", "int64", "float32", "float64"})
#: where a dtype goes when a backend cannot reduce it natively.
UPCAST = {"float16": "float32", "bfloat16": "float32", "int16": "int32", "bool": "uint8"}


class ArrayOps(abc.ABC):
    """What the engine does to buffers of one family.

    Every method works on arrays of this family only.  ``dtype`` arguments
    are names from :data:`ITEMSIZE`; ``device`` arguments are what
    :meth:`device` returns for the family (hashable: ``"cpu"`` for NumPy, a
    ``torch.device`` for torch).
    """

    family: str = "?"

    # --- what an array is --------------------------------------------------------------------
    @abc.abstractmethod
    def dtype_name(self, a: Array) -> str:
        """The array's dtype as a name (``float32``)."""

    @abc.abstractmethod
    def shape(self, a: Array) -> tuple[int, ...]:
        """The shape as a tuple of ints."""

    @abc.abstractmethod
    def device(self, a: Array) -> Any:
        """Where the array lives, as the family's own hashable placement (``cpu``, ``cuda:0`` ...)."""

    @abc.abstractmethod
    def device_type(self, a: Array) -> str:
        """``cpu`` or ``cuda``: the kind of backend that must move the array."""

    @abc.abstractmethod
    def numel(self, a: Array) -> int:
        """Number of elements."""

    @abc.abstractmethod
    def is_contiguous(self, a: Array) -> bool:
        """True when the array is one dense row-major block."""

    @abc.abstractmethod
    def same_memory(self, a: Array, b: Array) -> bool:
        """True when both arrays start at the same address."""

    # --- making arrays -------------------------------------------------------------------------
    @abc.abstractmethod
    def empty(self, shape: Sequence[int], dtype: str, device: Any) -> Array:
        """A new uninitialised contiguous array."""

    @abc.abstractmethod
    def zeros(self, shape: Sequence[int], dtype: str, device: Any) -> Array:
        """A new array of zeros."""

    def empty_like(self, a: Array) -> Array:
        """A new contiguous array of ``a``'s shape, dtype and device."""
        return self.empty(self.shape(a), self.dtype_name(a), self.device(a))

    @abc.abstractmethod
    def clone(self, a: Array) -> Array:
        """A contiguous copy."""

    @abc.abstractmethod
    def contiguous(self, a: Array) -> Array:
        """``a`` itself when contiguous, else a contiguous copy."""

    @abc.abstractmethod
    def int32_vector(self, values: Sequence[int], device: str = "cpu") -> Array:
        """A 1-D int32 array (alltoall's received splits)."""

    # --- views and conversions -----------------------------------------------------------------
    @abc.abstractmethod
    def flat(self, a: Array) -> Array:
        """A 1-D view of a contiguous array."""

    @abc.abstractmethod
    def as_bytes(self, a: Array) -> Array:
        """A flat uint8 view of a contiguous array (for collectives that only move data)."""

    @abc.abstractmethod
    def reshape(self, a: Array, shape: Sequence[int]) -> Array:
        """A view (or copy) of ``a`` with ``shape``."""

    @abc.abstractmethod
    def astype(self, a: Array, dtype: str) -> Array:
        """``a`` converted to ``dtype`` (``a`` itself when it already has it)."""

    def cast_flat(self, a: Array, dtype: str, copy: bool = False) -> Array:
        """A contiguous 1-D array of ``dtype`` holding ``a``'s values.

        With ``copy`` the result never shares memory with ``a``.
        """
        work = self.flat(self.contiguous(self.astype(a, dtype)))
        if copy and self.same_memory(work, a):
            work = self.clone(work)
        return work

    # --- arithmetic and data movement ----------------------------------------------------------
    @abc.abstractmethod
    def copy_(self, dst: Array, src: Array) -> None:
        """``dst[...] = src`` (same number of elements; ``src`` is reshaped, its dtype converted)."""

    @abc.abstractmethod
    def scale_(self, a: Array, factor: float) -> None:
        """Multiply in place; integer arrays truncate toward zero, as Horovod does."""

    def scaled_copy_(self, dst: Array, src: Array, factor: float) -> None:
        """``dst[...] = src * factor`` (same dtype and shape)."""
        self.copy_(dst, src)
        self.scale_(dst, factor)

    @abc.abstractmethod
    def pack(self, sources: Sequence[Array], out: Array) -> None:
        """Write the flattened ``sources`` one after another into the 1-D ``out``."""

    @abc.abstractmethod
    def unpack(self, buf: Array, outputs: Sequence[Array]) -> None:
        """Split the 1-D ``buf`` into consecutive pieces and copy each into its output."""


    # --- linear algebra (the compressors of hora.core.compression) -------------------------------
    # Batched: a "stack" is one array of shape (B, n, m) holding B matrices of one shape, so a
    # compressor makes a few calls per shape, not a few per tensor.
    @abc.abstractmethod
    def stack_(self, sources: Sequence[Array], out: Array, accumulate: bool = False) -> None:
        """``out[i] = sources[i]`` (``+=`` with ``accumulate``), each source reshaped to ``out[i]``'s shape."""

    @abc.abstractmethod
    def unstack_(self, stack: Array, outputs: Sequence[Array], factor: float = 1.0) -> None:
        """``outputs[i][...] = stack[i] * factor``, each reshaped to its output's shape and cast to its dtype."""

    @abc.abstractmethod
    def matmul_(self, a: Array, b: Array, out: Array, transpose_a: bool = False, transpose_b: bool = False) -> None:
        """``out = a @ b`` over stacks (the last two axes), ``a``/``b`` transposed in those axes where asked."""

    @abc.abstractmethod
    def orthonormalize_(self, a: Array) -> None:
        """Replace the columns of every matrix of the stack ``a`` by an orthonormal basis of their span."""

    @abc.abstractmethod
    def add_(self, dst: Array, src: Array, alpha: float = 1.0) -> None:
        """``dst += alpha * src`` (same number of elements; ``src`` converted to ``dst``'s dtype)."""

    @abc.abstractmethod
    def random_normal(self, shape: Sequence[int], dtype: str, device: Any, seed: int) -> Array:
        """Standard normal values, the same for the same ``seed`` on every rank."""


_FAMILIES: dict[type, ArrayOps] = {}


def ops_for(a: Array) -> ArrayOps:
    """The operations for ``a``'s family (looked up once per Python type).

    Raises:
        TypeError: ``a`` is of no family the engine knows; the message says
            which types are accepted.
    """
    ops = _FAMILIES.get(type(a))
    if ops is None:
        ops = _FAMILIES[type(a)] = _family_of(a)
    return ops


def _family_of(a: Array) -> ArrayOps:
    if isinstance(a, np.ndarray):
        from hora.core.buffers.numpy_ops import NUMPY

        return NUMPY
    if type(a).__module__.split(".", 1)[0] == "torch":
        from hora.core.buffers.torch_ops import TORCH

        return TORCH
    raise TypeError(
        f"hora's engine takes NumPy arrays or torch tensors, not {type(a).__module__}.{type(a).__name__}; "
        "convert with hora.core.buffers.as_buffer(), or use the binding for your framework "
        "(hora.torch, hora.tensorflow, hora.keras, hora.mxnet)"
    )


def as_buffer(x: Any) -> Array:
    """A buffer the engine takes, viewing ``x``'s memory where possible.

    NumPy arrays and torch tensors are returned as they are.  Objects that
    expose DLPack (``__dlpack__``) on the host or the buffer protocol become
    NumPy arrays sharing their memory; anything array-like is copied into one.
    """
    if isinstance(x, np.ndarray) or type(x).__module__.split(".", 1)[0] == "torch":
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError):
            pass  # on a device, or read-only: fall through to a copy
    return np.asarray(x)


__all__ = ["ARITHMETIC_DTYPES", "Array", "ArrayOps", "ITEMSIZE", "UPCAST", "as_buffer", "ops_for"]
