"""A sequential float32 sum of non-negative values, bit for bit, without a per-element loop.

MXNet's CPU ``multi_sum_sq`` adds squares one after another into a float32
(``sum += x[j] * x[j]``); NumPy's only ordered float32 sum is ``cumsum``, whose
scalar loop costs several nanoseconds an element.  This module gets the same
bits from vector operations, using what rounding does while the running sum
``s`` stays in one binade ``[2^e, 2^(e+1))``: every float32 there is a multiple
of ``u = 2^(e-23)``, so ``fl(s + y)`` is ``s + k*u`` with ``k`` the integer
nearest to ``y/u``.  That ``k`` does not depend on ``s``, except at a tie
(``y/u`` exactly halfway), where round-half-to-even looks at ``s``'s last bit.
The values are non-negative, so the sum only grows: a block's ``k`` add up (in
any order: they are integers below ``2^24``, and a float32 sum of them that
reaches ``2^24`` cannot round below it) to tell whether the block stays in the
binade.  Where it leaves the binade, meets a tie, a NaN or an infinity, that
element is added alone, in float32, and the walk goes on from there; a block
where that happens early is summed by ``cumsum`` instead, so adversarial data
(many ties, such as a constant array) costs no more than the plain loop.
"""

from __future__ import annotations

import numpy as np

_F = np.float32
_TOP = _F(2 ** 24)  # S = s/u stays below this while s is in its binade
_MIN_EXP = -103  # below this binade 1/u overflows float32: such tiny sums go through cumsum
EARLY = 8  # an event in the first 1/EARLY of a block sends that block through cumsum


def _cumsum_add(s: np.float32, y: np.ndarray, scratch: np.ndarray) -> np.float32:
    """``s + y[0] + y[1] + ...`` in float32, in order (NumPy's scalar accumulate loop)."""
    buf = scratch[:y.size]
    np.copyto(buf, y)
    buf[0] += s  # (s + y0): the first addition of the chain
    np.cumsum(buf, out=buf)
    return buf[-1]


def ordered_add(s: np.float32, y: np.ndarray, scratch: np.ndarray, scratch2: np.ndarray) -> np.float32:
    """``s + y[0] + y[1] + ...`` added in order in float32, for float32 ``s >= 0`` and ``y >= 0`` (or NaN).

    ``y`` is a flat float32 array; ``scratch`` and ``scratch2`` are float32
    buffers of one block (any length).  The result has the bits of the
    sequential loop.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN take the element-alone path
        return _walk(_F(s), y, scratch, scratch2)


def _walk(s: np.float32, y: np.ndarray, scratch: np.ndarray, scratch2: np.ndarray) -> np.float32:
    n, size = y.size, scratch.size
    pos = 0
    slow = False  # add the next block by cumsum (after an early event, or while the sum is tiny)
    while pos < n:
        if not np.isfinite(s):  # inf + y is inf unless y is NaN; NaN stays NaN
            return _F(np.nan) if np.isnan(s) or np.isnan(y[pos:]).any() else s
        if s == 0:  # 0 + y = y: skip the zeros, start from the first non-zero
            rest = y[pos:]
            first = int(np.argmax(rest != 0))
            if rest[first] == 0:
                return s
            s, pos = _F(rest[first]), pos + first + 1
            continue
        e = int(np.frexp(s)[1]) - 1
        if slow or e < _MIN_EXP:
            end = min(n, pos + size)
            s, pos, slow = _cumsum_add(s, y[pos:end], scratch), end, False
            continue
        block = y[pos:pos + size]
        m = block.size
        u = _F(np.ldexp(1.0, e - 23))
        q = np.multiply(block, _F(np.ldexp(1.0, 23 - e)), out=scratch[:m])  # y/u, exact (a power of two)
        r = np.rint(q, out=scratch2[:m])  # the nearest k, halves to even
        base = s / u  # S, an integer in [2^23, 2^24)
        # The first tie (|q - k| == 1/2): its k depends on S's parity, so it ends the vector part.
        np.subtract(q, r, out=q)
        np.abs(q, out=q)
        ties = q == _F(0.5)
        stop = int(np.argmax(ties)) if ties.any() else m
        total = np.add.reduce(r[:stop])
        if base + total < _TOP:  # no binade change (nor NaN/inf) before ``stop``
            s, pos = _F((base + total) * u), pos + stop
            if stop < m:  # the tie, alone
                s, pos, slow = _F(s + y[pos]), pos + 1, stop < size // EARLY
            continue
        # The binade changes (or a NaN/inf arrives) before ``stop``: find that element, add it alone.
        c = np.cumsum(r[:stop], out=r[:stop])
        j = int(np.argmax(~(base + c < _TOP)))
        if j:
            s = _F((base + c[j - 1]) * u)
        s, pos, slow = _F(s + y[pos + j]), pos + j + 1, j < size // EARLY
    return s


__all__ = ["ordered_add"]
