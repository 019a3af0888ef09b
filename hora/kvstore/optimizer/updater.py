"""The updater: applies an optimizer to stored values, keeping each key's state, and saves that state.

State travels and is saved as msgpack (raw array bytes with dtype and shape,
plain numbers for the optimizer's shared scalars), never as a pickle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import numpy as np

from hora.errors import ConfigError
from hora.kvstore.arrays import converted as _astype
from hora.kvstore.arrays import copy_into as _copy_into
from hora.kvstore.arrays import is_numpy as _is_numpy
from hora.kvstore.arrays import numpy_of as to_numpy
from hora.kvstore.lr_scheduler import _number
from hora.kvstore.optimizer.base import Array, Optimizer
from hora.kvstore.optimizer.base import is_float as _is_float
from hora.kvstore.optimizer.registry import create, optimizer_from_spec

_STATE_FORMAT = "hora-kvstore-updater"
_STATE_VERSION = 2
_ARRAY_KINDS = "fiub"
#: key-state names of the optimizer's shared scalars (saved once per key, the same on every shard)
SHARED_PREFIX = "shared."


def _pack_array(x: Array) -> dict[str, Any]:
    a = np.array(to_numpy(x), order="C", copy=True)  # ascontiguousarray would make a 0-d counter 1-d
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def _unpack_array(d: Any, where: str) -> np.ndarray:
    if not isinstance(d, Mapping) or set(d) != {"dtype", "shape", "data"}:
        raise ConfigError(f"optimizer state {where}: expected an array record with dtype, shape and data")
    try:
        dtype = np.dtype(d["dtype"])
    except TypeError as e:
        raise ConfigError(f"optimizer state {where}: bad dtype {d['dtype']!r}") from e
    shape = d["shape"]
    if dtype.kind not in _ARRAY_KINDS or not isinstance(shape, list) or not all(
            isinstance(s, int) and s >= 0 for s in shape) or not isinstance(d["data"], bytes):
        raise ConfigError(f"optimizer state {where}: bad array record (dtype {dtype}, shape {shape!r})")
    if len(d["data"]) != dtype.itemsize * math.prod(shape):
        raise ConfigError(f"optimizer state {where}: {len(d['data'])} bytes do not hold a {dtype} array of "
                          f"shape {tuple(shape)}")
    return np.frombuffer(d["data"], dtype=dtype).reshape(tuple(shape)).copy()


class Updater:
    """Applies an optimizer to stored values, keeping each key's state (MXNet's ``get_updater``).

    ``updater(key, grad, weight)`` updates ``weight`` in place.  Arrays may be
    NumPy arrays or torch tensors; a key's state lives beside its weight.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise ConfigError(f"Updater needs a hora.kvstore.optimizer.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.states: dict[str, dict[str, Array]] = {}
        self._restored: set[str] = set()  # keys whose state came from bytes and awaits its weight

    def __call__(self, key: str, grad: Array, weight: Array) -> None:
        """Apply one update for ``key``: ``weight`` changes in place, the key's state advances."""
        self._run(key, grad, weight, rows=False)

    def update_rows(self, key: str, grad: Array, weight: Array) -> None:
        """The lazy update of a row_sparse push: ``weight``, ``grad`` and the key's current state hold only
        the pushed rows (see :meth:`Optimizer.update_rows`)."""
        self._run(key, grad, weight, rows=True)

    def _run(self, key: str, grad: Array, weight: Array, rows: bool) -> None:
        key = str(key)
        if tuple(grad.shape) != tuple(weight.shape):
            raise ConfigError(f"key {key!r}: gradient shape {tuple(grad.shape)} does not match the weight's "
                              f"{tuple(weight.shape)}")
        if not _is_float(weight):
            raise ConfigError(f"key {key!r}: optimizers update floating-point values, but this key holds "
                              f"{weight.dtype}; store it as a float or push it without an optimizer")
        tensor = None
        if self.optimizer.numpy_only and not _is_numpy(weight):
            # A NumPy rule on a tensor: update a host view (a copy for device tensors), then copy it back;
            # the key's state lives on the host.
            tensor, weight, grad = weight, to_numpy(weight), to_numpy(grad)
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = self.optimizer.create_state_multi_precision(key, weight)
        elif key in self._restored or _misplaced(state, weight):
            self._conform(key, state, weight)
            self._restored.discard(key)
        rule = self.optimizer.update_rows if rows else self.optimizer.update_multi_precision
        rule(key, weight, _astype(grad, weight), state)
        if tensor is not None and tensor.data_ptr() != weight.__array_interface__["data"][0]:
            _copy_into(tensor, weight)

    def _conform(self, key: str, state: dict[str, Array], weight: Array) -> None:
        # Restored states are NumPy arrays in the saved dtype: move them beside the weight, in the
        # dtype the update runs in (float32 under a multi-precision master copy).
        wide = "weight32" in state
        for name, value in state.items():
            if _is_numpy(weight) and to_numpy(value).dtype.kind in "iu":
                state[name] = np.array(to_numpy(value), copy=True)  # counters keep their integer dtype
            elif _is_numpy(weight):
                dtype = np.dtype(np.float32) if wide else weight.dtype
                state[name] = np.array(to_numpy(value), dtype=dtype, copy=True)
            else:
                tensor = weight.new_tensor(to_numpy(value))
                state[name] = tensor.float() if wide else tensor.to(weight.dtype)

    # --- per-key state --------------------------------------------------------------------------
    def key_states(self, key: str) -> dict[str, np.ndarray]:
        """The key's state arrays as NumPy arrays, plus ``num_update``: its update count (0-d int64)."""
        key = str(key)
        out = {name: to_numpy(v).copy() for name, v in self.states.get(key, {}).items()}
        out["num_update"] = np.array(self.optimizer._index_update_count.get(key, 0), dtype=np.int64)
        for name, value in self.optimizer.shared_state().items():
            if value is not None:
                out[SHARED_PREFIX + name] = np.array(value, dtype=np.float64)
        return out

    def set_key_states(self, key: str, states: Mapping[str, np.ndarray]) -> None:
        """Replace the key's state with ``states`` (as :meth:`key_states` returns them)."""
        key = str(key)
        states = dict(states)
        count = states.pop("num_update", None)
        shared = {n.removeprefix(SHARED_PREFIX): float(np.asarray(states.pop(n))) for n in list(states)
                  if n.startswith(SHARED_PREFIX)}
        self.optimizer.set_shared_state(shared)
        if count is not None:
            self.optimizer._index_update_count[key] = int(np.asarray(count))
            self.optimizer.num_update = max(self.optimizer.num_update, int(np.asarray(count)))
        self.states[key] = {name: to_numpy(v).copy() for name, v in states.items()}
        self._restored.add(key)

    # --- whole state ----------------------------------------------------------------------------
    def get_states(self, dump_optimizer: bool = False) -> bytes:
        """Every key's state and update count as bytes (msgpack; the optimizer's spec when asked)."""
        opt = self.optimizer
        doc = {
            "format": _STATE_FORMAT, "version": _STATE_VERSION,
            "optimizer": opt.spec() if dump_optimizer else None,
            "num_update": opt.num_update,
            "counts": dict(opt._index_update_count),
            "shared": opt.shared_state(),
            "states": {k: {n: _pack_array(v) for n, v in s.items()} for k, s in self.states.items()},
        }
        return msgpack.packb(doc, use_bin_type=True)

    def set_states(self, data: bytes) -> None:
        """Restore what :meth:`get_states` wrote; an included optimizer spec replaces the optimizer.

        Raises:
            ConfigError: the bytes are not an updater state (truncated,
                another format, or a malformed record).
        """
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types
            raise ConfigError(f"not a hora optimizer-state file: {e}") from e
        if not isinstance(doc, Mapping) or doc.get("format") != _STATE_FORMAT:
            raise ConfigError("not a hora optimizer-state file (missing its format marker)")
        if doc.get("version") not in (1, _STATE_VERSION):
            raise ConfigError(f"optimizer-state version {doc.get('version')!r} is not supported "
                              f"(this hora reads version {_STATE_VERSION})")
        counts, states = doc.get("counts"), doc.get("states")
        if not isinstance(counts, Mapping) or not isinstance(states, Mapping):
            raise ConfigError("optimizer-state file is malformed: counts/states are not maps")
        new_states = {}
        for key, arrays in states.items():
            if not isinstance(arrays, Mapping):
                raise ConfigError(f"optimizer state of key {key!r} is malformed")
            new_states[str(key)] = {str(n): _unpack_array(a, f"{key}/{n}") for n, a in arrays.items()}
        new_counts = {str(k): _number(f"update count of key {k!r}", v, minimum=0, integer=True)
                      for k, v in counts.items()}
        num_update = _number("num_update", doc.get("num_update", 0), minimum=0, integer=True)
        if doc.get("optimizer") is not None:
            self.optimizer = optimizer_from_spec(doc["optimizer"])
        shared = doc.get("shared") or {}
        if not isinstance(shared, Mapping) or not all(v is None or isinstance(v, (int, float))
                                                       for v in shared.values()):
            raise ConfigError("optimizer-state file is malformed: shared values are not numbers")
        self.optimizer.set_shared_state(shared)
        self.optimizer._index_update_count = new_counts
        self.optimizer.num_update = max(num_update, self.optimizer.begin_num_update)
        self.states = new_states
        self._restored = set(new_states)


def _misplaced(state: dict[str, Array], weight: Array) -> bool:
    """True when the state lives elsewhere than the weight (the weight moved to another device)."""
    if not state or _is_numpy(weight):
        return False
    first = next(iter(state.values()))
    return _is_numpy(first) or first.device != weight.device


def create_updater(spec: Mapping[str, Any] | Optimizer) -> Updater:
    """An :class:`Updater` for an optimizer spec (or an :class:`Optimizer`).

    Raises:
        ConfigError: the spec is invalid; the message names the bad type or field.
    """
    optimizer = spec if isinstance(spec, Optimizer) else optimizer_from_spec(spec)
    return Updater(optimizer)


def updater_for(optimizer: Optimizer | Mapping[str, Any] | str) -> Updater:
    """An :class:`Updater` for what ``set_optimizer`` accepts: an Optimizer, its spec dict, or a name.

    Raises:
        ConfigError: anything else, or an invalid spec or name.
    """
    if isinstance(optimizer, Optimizer):
        return Updater(optimizer)
    if isinstance(optimizer, Mapping):
        return create_updater(optimizer)
    if isinstance(optimizer, str):
        return Updater(create(optimizer))
    raise ConfigError(f"set_optimizer takes an Optimizer, its spec dict or a name, got {type(optimizer).__name__}")


def get_updater(optimizer: Optimizer) -> Callable[[str, Array, Array], None]:
    """MXNet's ``mx.optimizer.get_updater``: an :class:`Updater` around ``optimizer``."""
    return Updater(optimizer)


__all__ = ["Updater", "create_updater", "get_updater", "updater_for", "SHARED_PREFIX"]
