"""Element-wise reductions of 16-bit floats carried as raw 16-bit words.

An engine that moves float16 or bfloat16 as 16-bit data (the MPI backend's
user-defined reduction) combines two segments with these kernels.  Each pair
is widened to float32, combined there, and rounded back to 16 bits to nearest
even, which is what Horovod's MPI float16 sum does.  A reduction over several
ranks therefore rounds once per step, not once at the end.

bfloat16 is the upper half of a float32, so its widening is a 16-bit shift
and its narrowing a rounding of the low half; NumPy needs no bfloat16 type
for either.  float16 is widened with integer shifts and one multiply, and
narrowed by NumPy's float16 cast (round to nearest even).

The kernels work on whole segments with scratch space that grows once and is
reused, so a call allocates nothing in the steady state.  They are not
thread-safe: one :class:`HalfReducer` serves one engine thread.
"""

from __future__ import annotations

import numpy as np

from hora.core.ops import ReduceOp

#: Half-precision dtype names the kernels handle.
HALF_DTYPES = ("float16", "bfloat16")

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def bf16_to_f32(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16 or int16) to float32, exactly."""
    if out is None:
        out = np.empty(words.shape, np.uint32)
    np.copyto(out, words.view(np.uint16), casting="unsafe")
    np.left_shift(out, 16, out=out)
    return out.view(np.float32)


def f16_to_f32(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen float16 bit patterns (any 16-bit dtype) to float32, exactly, NaN payloads included.

    Integer shifts put the sign at bit 31 and the exponent and mantissa 13
    bits up; one float32 multiply by 2**112 then rebiases the exponent and
    turns subnormals into normals.  About four times NumPy's own float16 cast,
    which is scalar code.  Infinities and NaNs are patched afterwards.
    """
    if out is None:
        out = np.empty(words.shape, np.uint32)
    w = words.view(np.uint16)
    np.copyto(out, w, casting="unsafe")
    np.left_shift(out, 16, out=out)
    signed = out.view(np.int32)
    np.right_shift(signed, 3, out=signed)  # arithmetic: the sign lands on bits 31..28
    np.bitwise_and(out, np.uint32(0x8FFFFFFF), out=out)  # keep bit 31 of those
    values = out.view(np.float32)
    np.multiply(values, np.float32(2.0**112), out=values)
    special = (w & 0x7C00) == 0x7C00
    if special.any():
        s = w[special].astype(np.uint32)
        out[special] = ((s & 0x8000) << 16) | 0x7F800000 | ((s & 0x3FF) << 13)
    return values


def f32_to_bf16(values: np.ndarray, out: np.ndarray, scratch: np.ndarray | None = None) -> None:
    """Round float32 ``values`` to bfloat16 bit patterns in ``out`` (16-bit words), to nearest even.

    ``values`` is overwritten (its bits are the working space); ``scratch``
    is a uint32 array of the same length, allocated when not given.  A NaN
    stays a NaN (quieted) instead of rounding into an infinity.
    """
    bits = values.view(np.uint32)
    if scratch is None:
        scratch = np.empty(bits.shape, np.uint32)
    nan = np.isnan(values)
    has_nan = bool(nan.any())
    if has_nan:
        nan_words = (bits[nan] >> 16) | np.uint32(0x0040)
    # Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop the low half.
    # Finite values cannot overflow 32 bits here; an overflow past the largest bfloat16 lands on infinity.
    np.right_shift(bits, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)
    np.add(bits, scratch, out=bits)
    np.add(bits, np.uint32(0x7FFF), out=bits)
    np.right_shift(bits, 16, out=bits)
    if has_nan:
        bits[nan] = nan_words
    np.copyto(out.view(np.uint16), bits, casting="unsafe")


class HalfReducer:
    """``inout = inout (op) in`` on 16-bit float segments, through float32, rounded to nearest even."""

    def __init__(self) -> None:
        self._a = np.empty(0, np.uint32)
        self._b = np.empty(0, np.uint32)

    def _scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self._a.size < n:
            self._a = np.empty(n, np.uint32)
            self._b = np.empty(n, np.uint32)
        return self._a[:n], self._b[:n]

    def reduce(self, dtype: str, op: ReduceOp, src: np.ndarray, inout: np.ndarray) -> None:
        """Combine ``src`` into ``inout``; both are flat 16-bit arrays (any 16-bit NumPy dtype) of ``dtype`` bits.

        Raises:
            KeyError: ``op`` is not Sum, Product, Min or Max.
            ValueError: ``dtype`` is not float16 or bfloat16.
        """
        ufunc = _UFUNCS[op]
        n = inout.size
        a, b = self._scratch(n)
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are results here, not mistakes
            self._reduce(dtype, ufunc, src, inout, a, b)

    @staticmethod
    def _reduce(dtype: str, ufunc: np.ufunc, src: np.ndarray, inout: np.ndarray, a: np.ndarray,
                b: np.ndarray) -> None:
        if dtype == "float16":
            fa = f16_to_f32(src, a)
            fb = f16_to_f32(inout, b)
            ufunc(fb, fa, out=fb)
            np.copyto(inout.view(np.float16), fb, casting="same_kind")
        elif dtype == "bfloat16":
            fa = bf16_to_f32(src, a)
            fb = bf16_to_f32(inout, b)
            ufunc(fb, fa, out=fb)
            f32_to_bf16(fb, inout, a)
        else:
            raise ValueError(f"no 16-bit float reduction for {dtype}")
