"""Optimizer states of a parameter-server job: gathered from the servers, saved, split back.

A server's optimizer keeps per-key state for the keys (shards) it holds, as
flat arrays.  Saving gathers every server's part and joins the shards of a
split key back into arrays of the key's shape; loading cuts them again by the
current placement, so a file saved with S servers loads with any number.
A state whose shape differs from the key's (such as the ``num_update``
counter) is the same on every shard and is saved once.

The file is msgpack, never a pickle:
``{"format", "version", "optimizer": spec | None, "keys": {key: {state: {"dtype", "shape", "data"}}}}``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from hora.errors import ConfigError
from hora.kvstore.ps.placement import Shard
from hora.kvstore.ps.wire import DTYPES

FORMAT = "hora-kvstore-dist-states"
VERSION = 1
_REPLICATED = ("num_update",)


def _elementwise(name: str, array: np.ndarray, shape: tuple[int, ...]) -> bool:
    return name not in _REPLICATED and tuple(array.shape) == tuple(shape)


def join(shape: tuple[int, ...], shards: list[Shard], parts: Mapping[int, Mapping[str, np.ndarray]]
         ) -> dict[str, np.ndarray]:
    """One key's states from the per-server parts (``parts[server][state]``, flat per shard)."""
    out: dict[str, np.ndarray] = {}
    first = parts.get(shards[0].server, {})
    for name, value in first.items():
        pieces = [parts.get(s.server, {}).get(name) for s in shards]
        if name not in _REPLICATED and all(p is not None and p.ndim == 1 and p.size == s.size
                                           for p, s in zip(pieces, shards, strict=True)):
            out[name] = np.concatenate(pieces).reshape(shape)  # type: ignore[arg-type]
        else:
            out[name] = np.array(value, copy=True)
    return out


def split(shape: tuple[int, ...], shards: list[Shard], states: Mapping[str, np.ndarray]
          ) -> dict[int, dict[str, np.ndarray]]:
    """Cut one key's states into the flat per-shard pieces each server holds."""
    out: dict[int, dict[str, np.ndarray]] = {s.server: {} for s in shards}
    for name, value in states.items():
        for s in shards:
            if _elementwise(name, value, shape):
                out[s.server][name] = np.ascontiguousarray(value.reshape(-1)[s.lo:s.hi])
            else:
                out[s.server][name] = np.array(value, copy=True)
    return out


def write(fname: str, keys: Mapping[str, Mapping[str, np.ndarray]], optimizer: dict[str, Any] | None) -> None:
    """Write the states atomically (a temporary file renamed into place)."""
    doc = {"format": FORMAT, "version": VERSION, "optimizer": optimizer,
           "keys": {k: {n: {"dtype": a.dtype.name, "shape": list(a.shape), "data": np.ascontiguousarray(a).tobytes()}
                        for n, a in states.items()} for k, states in keys.items()}}
    tmp = f"{fname}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(doc, use_bin_type=True))
    os.replace(tmp, fname)


def read(fname: str) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any] | None]:
    """Read a file :func:`write` wrote: ``(keys, optimizer spec or None)``.

    Raises:
        ConfigError: the file is not a hora dist optimizer-state file, or is damaged.
    """
    try:
        with open(fname, "rb") as f:
            doc = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    except OSError as e:
        raise ConfigError(f"cannot read optimizer states from {fname!r}: {e}") from e
    except Exception as e:
        raise ConfigError(f"{fname!r} is not a hora optimizer-state file: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{fname!r} is not a hora dist optimizer-state file (saved by save_optimizer_states of a "
                          "dist KVStore)")
    if doc.get("version") != VERSION:
        raise ConfigError(f"{fname!r} has state version {doc.get('version')!r}; this hora reads {VERSION}")
    keys: dict[str, dict[str, np.ndarray]] = {}
    raw = doc.get("keys")
    if not isinstance(raw, dict):
        raise ConfigError(f"{fname!r}: malformed key table")
    for key, states in raw.items():
        if not isinstance(states, dict):
            raise ConfigError(f"{fname!r}: malformed states of key {key!r}")
        keys[str(key)] = {str(n): _array(rec, f"{fname}: {key}/{n}") for n, rec in states.items()}
    optimizer = doc.get("optimizer")
    if optimizer is not None and not isinstance(optimizer, dict):
        raise ConfigError(f"{fname!r}: malformed optimizer spec")
    return keys, optimizer


def _array(rec: Any, where: str) -> np.ndarray:
    if not (isinstance(rec, dict) and rec.get("dtype") in DTYPES and isinstance(rec.get("shape"), list)
            and all(isinstance(s, int) and s >= 0 for s in rec["shape"]) and isinstance(rec.get("data"), bytes)):
        raise ConfigError(f"{where}: malformed array record")
    dtype = DTYPES[rec["dtype"]]
    if len(rec["data"]) != dtype.itemsize * math.prod(rec["shape"]):
        raise ConfigError(f"{where}: {len(rec['data'])} bytes do not hold {rec['dtype']}{rec['shape']}")
    return np.frombuffer(rec["data"], dtype=dtype).reshape(tuple(rec["shape"])).copy()
