"""The ``numpy`` array family: host buffers as NumPy arrays."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from hora.core.buffers import Array, ArrayOps


@functools.cache
def np_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a dtype name; ``bfloat16`` comes from ml_dtypes when it is installed."""
    try:
        return np.dtype(name)
    except TypeError:
        if name == "bfloat16":
            try:
                import ml_dtypes
            except ImportError as e:
                raise TypeError("bfloat16 NumPy arrays need the ml_dtypes package: pip install ml_dtypes") from e
            return np.dtype(ml_dtypes.bfloat16)
        raise


_NAMES: dict[np.dtype, str] = {}


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class NumpyOps(ArrayOps):
    """:class:`~hora.core.buffers.ArrayOps` on NumPy arrays (always on the host)."""

    family = "numpy"

    def dtype_name(self, a: Array) -> str:
        name = _NAMES.get(a.dtype)  # dtype.name is computed in Python, ~4 us a call
        if name is None:
            name = _NAMES[a.dtype] = a.dtype.name
        return name

    def shape(self, a: Array) -> tuple[int, ...]:
        return a.shape

    def device(self, a: Array) -> str:
        return "cpu"

    def device_type(self, a: Array) -> str:
        return "cpu"

    def numel(self, a: Array) -> int:
        return a.size

    def is_contiguous(self, a: Array) -> bool:
        return a.flags.c_contiguous

    def same_memory(self, a: Array, b: Array) -> bool:
        return _address(a) == _address(b)

    def empty(self, shape: Sequence[int], dtype: str, device: str) -> Array:
        return np.empty(tuple(shape), np_dtype(dtype))

    def zeros(self, shape: Sequence[int], dtype: str, device: str) -> Array:
        return np.zeros(tuple(shape), np_dtype(dtype))

    def empty_like(self, a: Array) -> Array:
        return np.empty(a.shape, a.dtype)

    def clone(self, a: Array) -> Array:
        return np.array(a, copy=True, order="C")

    def contiguous(self, a: Array) -> Array:
        return a if a.flags.c_contiguous else np.ascontiguousarray(a)

    def int32_vector(self, values: Sequence[int], device: str = "cpu") -> Array:
        return np.asarray(values, np.int32)

    def flat(self, a: Array) -> Array:
        return a.reshape(-1)

    def as_bytes(self, a: Array) -> Array:
        return a.reshape(-1).view(np.uint8)

    def reshape(self, a: Array, shape: Sequence[int]) -> Array:
        return a.reshape(tuple(shape))

    def astype(self, a: Array, dtype: str) -> Array:
        target = np_dtype(dtype)
        return a if a.dtype == target else a.astype(target)

    def copy_(self, dst: Array, src: Array) -> None:
        np.copyto(dst, src.reshape(dst.shape), casting="unsafe")

    def scale_(self, a: Array, factor: float) -> None:
        if factor == 1.0:
            return
        if a.dtype.itemsize < 4 and (a.dtype.kind == "f" or a.dtype.name == "bfloat16"):
            # NumPy would round the factor to half precision first; torch and Horovod multiply in float32.
            np.copyto(a, a.astype(np.float32) * np.float32(factor), casting="unsafe")
        elif a.dtype.kind == "f":
            np.multiply(a, factor, out=a, casting="unsafe")
        else:
            np.copyto(a, np.trunc(a.astype(np.float64) * factor), casting="unsafe")

    def scaled_copy_(self, dst: Array, src: Array, factor: float) -> None:
        if factor != 1.0 and dst.dtype.kind == "f" and dst.dtype.itemsize >= 4:
            np.multiply(src.reshape(dst.shape), factor, out=dst, casting="unsafe")
        else:
            self.copy_(dst, src)
            self.scale_(dst, factor)

    def pack(self, sources: Sequence[Array], out: Array) -> None:
        np.concatenate([s.reshape(-1) for s in sources], out=out, casting="unsafe")

    def unpack(self, buf: Array, outputs: Sequence[Array]) -> None:
        offset = 0
        for out in outputs:
            n = out.size
            np.copyto(out, buf[offset : offset + n].reshape(out.shape), casting="unsafe")
            offset += n

    def stack_(self, sources: Sequence[Array], out: Array, accumulate: bool = False) -> None:
        shape = out.shape[1:]
        for i, s in enumerate(sources):
            if accumulate:
                np.add(out[i], s.reshape(shape), out=out[i], casting="unsafe")
            else:
                np.copyto(out[i], s.reshape(shape), casting="unsafe")

    def unstack_(self, stack: Array, outputs: Sequence[Array], factor: float = 1.0) -> None:
        for piece, o in zip(stack, outputs, strict=True):
            if factor != 1.0:
                piece *= factor  # the stack is the compressor's scratch: scaling it in place saves a copy
            np.copyto(o, piece.reshape(o.shape), casting="unsafe")

    def matmul_(self, a: Array, b: Array, out: Array, transpose_a: bool = False, transpose_b: bool = False) -> None:
        np.matmul(np.swapaxes(a, -1, -2) if transpose_a else a, np.swapaxes(b, -1, -2) if transpose_b else b,
                  out=out)

    def orthonormalize_(self, a: Array) -> None:
        q, _ = np.linalg.qr(a, mode="reduced")
        np.copyto(a, q, casting="unsafe")

    def add_(self, dst: Array, src: Array, alpha: float = 1.0) -> None:
        src = src.reshape(dst.shape)
        if alpha == 1.0:
            np.add(dst, src, out=dst, casting="unsafe")
        elif alpha == -1.0:
            np.subtract(dst, src, out=dst, casting="unsafe")
        else:
            np.add(dst, alpha * src.astype(dst.dtype), out=dst, casting="unsafe")

    def random_normal(self, shape: Sequence[int], dtype: str, device: str, seed: int) -> Array:
        return np.random.default_rng(seed).standard_normal(tuple(shape)).astype(np_dtype(dtype))


NUMPY = NumpyOps()
