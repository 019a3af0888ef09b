"""Gradient compression for KVStore pushes: MXNet's 2-bit quantisation with error feedback.

``set_gradient_compression({'type': '2bit', 'threshold': t})`` makes a
worker quantise every gradient it pushes.  For each key the worker keeps a
*residual*, the part of past gradients not yet sent:

1. ``residual += grad``
2. where ``residual >= t``: send ``+t`` and ``residual -= t``;
   where ``residual <= -t``: send ``-t`` and ``residual += t``; elsewhere send 0.

Each value costs 2 bits; 16 values fill one 32-bit word.  The bit layout is
MXNet's (``quantize_2bit`` in ``src/kvstore/gradient_compression-inl.h``),
defined on the word's bytes in memory order: value ``j`` of a 16-value block
lives in byte ``j // 4`` of the word, in the bit pair selected by ``j % 4``
counting from the most significant end (masks ``0xC0, 0x30, 0x0C, 0x03``);
``11`` means ``+t``, ``10`` means ``-t``, anything else 0.  Reading the word as
a little-endian ``uint32``, value ``j`` therefore occupies bits
``8 * (j // 4) + 6 - 2 * (j % 4)`` and the one above it.  A key of ``n`` values
packs into ``ceil(n / 16)`` words; the unused pairs of the last word are 0.

The receiving side (a server, or every rank for ``dist_sync_allreduce``)
needs only the threshold to decode: :func:`decompressor_from_spec` builds a
decoder from :meth:`Compressor.spec`.  All of it is vectorised NumPy; values
are quantised in float32, as MXNet does.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from hora.errors import ConfigError

TYPES = ("none", "2bit")

# Shift of value j's bit pair inside its byte (j % 4 = 0 is the most significant pair).
_SHIFTS = np.array([6, 4, 2, 0], dtype=np.uint8)
_POS, _NEG = 3, 2  # bit pairs 11 and 10


class Compressor(abc.ABC):
    """A stateful gradient compressor: per-key error-feedback memory lives in the object."""

    @abc.abstractmethod
    def compress(self, key: str, grad: np.ndarray) -> np.ndarray:
        """Encode ``grad`` for ``key``, folding in and updating the key's residual."""

    @abc.abstractmethod
    def decompress(self, packed: np.ndarray, size: int) -> np.ndarray:
        """Decode ``size`` values from ``packed`` (stateless)."""

    @abc.abstractmethod
    def compressed_size(self, size: int) -> int:
        """Number of elements of the encoded form of ``size`` values."""

    @abc.abstractmethod
    def spec(self) -> dict[str, Any]:
        """The parameters as plain data; :func:`create_compressor` and :func:`decompressor_from_spec` take it."""

    def residual(self, key: str) -> np.ndarray | None:
        """The key's residual (None before its first compress)."""
        return None

    def reset(self, key: str | None = None) -> None:  # noqa: B027 - stateless compressors keep nothing
        """Forget the residual of ``key`` (of every key when None)."""


class TwoBitCompressor(Compressor):
    """MXNet's 2-bit quantisation: each value becomes ``+threshold``, ``-threshold`` or 0.

    Args:
        threshold: the quantisation step, > 0.
    """

    def __init__(self, threshold: float = 0.5) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
                math.isfinite(threshold) and threshold > 0):
            raise ConfigError(f"2bit compression needs a finite threshold > 0, got {threshold!r}")
        self.threshold = float(threshold)
        self._t = np.float32(threshold)
        self._residuals: dict[str, np.ndarray] = {}

    def compressed_size(self, size: int) -> int:
        return (int(size) + 15) // 16

    def spec(self) -> dict[str, Any]:
        return {"type": "2bit", "threshold": self.threshold}

    def residual(self, key: str) -> np.ndarray | None:
        return self._residuals.get(str(key))

    def reset(self, key: str | None = None) -> None:
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(str(key), None)

    def compress(self, key: str, grad: np.ndarray) -> np.ndarray:
        """Quantise ``grad`` (any shape, any float dtype) into ``ceil(n / 16)`` uint32 words.

        Raises:
            ConfigError: ``grad`` has a different number of values than the
                key's earlier gradients.
        """
        key = str(key)
        flat = np.asarray(grad).reshape(-1)
        n = flat.size
        residual = self._residuals.get(key)
        if residual is None:
            residual = self._residuals[key] = np.zeros(n, dtype=np.float32)
        elif residual.size != n:
            raise ConfigError(f"key {key!r}: 2bit compression saw {residual.size} values before and {n} now; "
                              "a key's size must not change")
        residual += flat.astype(np.float32, copy=False)
        pos = residual >= self._t
        neg = residual <= -self._t
        residual[pos] -= self._t
        residual[neg] += self._t
        words = self.compressed_size(n)
        codes = np.zeros(words * 16, dtype=np.uint8)
        codes[:n][pos] = _POS
        codes[:n][neg] = _NEG
        # (word, byte, pair) -> one byte per (word, byte), most significant pair first
        packed_bytes = np.bitwise_or.reduce(codes.reshape(words, 4, 4) << _SHIFTS, axis=2)
        return packed_bytes.reshape(-1).view("<u4").astype(np.uint32, copy=False)

    def decompress(self, packed: np.ndarray, size: int) -> np.ndarray:
        """Decode ``size`` float32 values from the words :meth:`compress` produced.

        Raises:
            ConfigError: ``packed`` holds fewer words than ``size`` values need.
        """
        words = np.ascontiguousarray(packed).reshape(-1)
        size = int(size)
        need = self.compressed_size(size)
        if words.size < need:
            raise ConfigError(f"2bit decompress: {size} values need {need} words, got {words.size}")
        if words.dtype.itemsize != 4:
            raise ConfigError(f"2bit decompress expects 32-bit words, got dtype {words.dtype}")
        raw = words[:need].astype("<u4", copy=False).view(np.uint8).reshape(need, 4, 1)
        codes = ((raw >> _SHIFTS) & 3).reshape(-1)[:size]
        out = np.zeros(size, dtype=np.float32)
        out[codes == _POS] = self._t
        out[codes == _NEG] = -self._t
        return out


def create_compressor(params: Mapping[str, Any] | None) -> Compressor | None:
    """The compressor for MXNet-style compression params (None for ``{'type': 'none'}``).

    ``{'type': '2bit', 'threshold': t}``; ``threshold`` defaults to 0.5 as in MXNet.

    Raises:
        ConfigError: not a dict, an unknown type, an unknown field, or a
            threshold that is not > 0.
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise ConfigError(f"compression params must be a dict like {{'type': '2bit', 'threshold': 0.5}}, "
                          f"got {type(params).__name__}")
    kind = params.get("type")
    if kind not in TYPES:
        raise ConfigError(f"unknown gradient compression type {kind!r}; valid types are: {', '.join(TYPES)}")
    fields = {"type"} if kind == "none" else {"type", "threshold"}
    unknown = sorted(map(str, set(params) - fields))
    if unknown:
        raise ConfigError(f"gradient compression {kind!r} has no field(s) {unknown}; valid fields: {sorted(fields)}")
    if kind == "none":
        return None
    return TwoBitCompressor(params.get("threshold", 0.5))


def decompressor_from_spec(spec: Mapping[str, Any] | None) -> Compressor | None:
    """A decoder for pushes compressed under ``spec`` (:meth:`Compressor.spec`); None for no compression."""
    return create_compressor(spec)


__all__ = ["Compressor", "TwoBitCompressor", "TYPES", "create_compressor", "decompressor_from_spec"]
