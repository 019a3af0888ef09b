"""What every KVStore type shares: MXNet's call forms, normalised once.

MXNet accepts a key or a list of keys, and for each key a value or a list of
values (one per device, summed before the push).  :class:`KVStore` turns every
call form into ``(keys, values)`` lists so that a store type only implements
the ``_init`` / ``_push`` / ``_pull`` hooks on normalised input:

* ``keys``: ``list[str]``; int keys are turned into their decimal string
  (MXNet forbids mixing int and str keys in one store; so does hora).
* ``values``: ``list[list[Array]]``; one inner list per key, one array per
  device.  An ``Array`` is a CPU or CUDA ``torch.Tensor`` or a ``numpy.ndarray``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from hora.errors import ConfigError

Key = int | str
Array = Any  # torch.Tensor | numpy.ndarray; kept loose so that this module imports neither


def is_array(x: Any) -> bool:
    """True for a numpy array or a torch tensor (checked without importing either)."""
    mod = type(x).__module__
    return (mod == "numpy" and type(x).__name__ == "ndarray") or (mod.startswith("torch") and hasattr(x, "dim"))


class MixedKeysError(ConfigError):
    """A key of the other kind (int among str keys, or str among int keys): as in MXNet, a store takes one."""


class KVStore(abc.ABC):
    """The MXNet KVStore interface.  Create one with :func:`hora.kvstore.create`."""

    #: what a key of the other kind raises; a binding may put its framework's error type into the class
    #: (MXNet's stores raise an ``MXNetError``, as MXNet's own "Mixed key types are not allowed" is one)
    mixed_keys_error: type[ConfigError] = MixedKeysError

    def __init__(self, kv_type: str) -> None:
        self._type = kv_type
        self._key_kind: type | None = None  # int or str, fixed by the first key seen

    # --- identity ---------------------------------------------------------------------
    @property
    def type(self) -> str:
        """The store's type name, as passed to ``create``."""
        return self._type

    @property
    def rank(self) -> int:
        """This worker's rank among the workers (0 for a single-process store)."""
        return 0

    @property
    def num_workers(self) -> int:
        """Number of worker processes sharing the store."""
        return 1

    # --- data -------------------------------------------------------------------------
    def init(self, key: Key | Sequence[Key], value: Array | Sequence[Array]) -> None:
        """Initialise one key or a list of keys.  In a distributed store worker 0's
        value is the one stored, and the call returns once every worker may pull it."""
        keys, values = self._normalise(key, value, "value")
        self._init(keys, [v[0] for v in values])

    def push(self, key: Key | Sequence[Key], value: Array | Sequence[Array], priority: int = 0) -> None:
        """Push values (for example gradients).  Several values for one key are summed first."""
        keys, values = self._normalise(key, value, "value")
        self._push(keys, values, priority)

    def pull(self, key: Key | Sequence[Key], out: Array | Sequence[Array] | None = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Copy the stored values into ``out`` (one array per key, or a list per key to fill several)."""
        if out is None:
            raise ConfigError("pull() needs out=: the array(s) to copy the stored value into")
        keys, outs = self._normalise(key, out, "out")
        self._pull(keys, outs, priority)

    def pushpull(self, key: Key | Sequence[Key], value: Array | Sequence[Array],
                 out: Array | Sequence[Array] | None = None, priority: int = 0) -> None:
        """Push ``value`` then pull into ``out`` (into ``value`` itself when ``out`` is None)."""
        keys, values = self._normalise(key, value, "value")
        outs = values if out is None else self._normalise(key, out, "out")[1]
        self._pushpull(keys, values, outs, priority)

    # --- updaters, compression, control ------------------------------------------------
    @abc.abstractmethod
    def set_optimizer(self, optimizer: Any) -> None:
        """Run ``optimizer`` (a :class:`hora.kvstore.optimizer.Optimizer`) on each push."""

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress pushes, e.g. ``{'type': '2bit', 'threshold': 0.5}``."""
        raise ConfigError(f"gradient compression is not supported by the {self._type!r} KVStore")

    def barrier(self) -> None:
        """Wait until every worker reaches this point (a no-op for one process)."""
        return None

    @abc.abstractmethod
    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Write the optimizer state of every key to ``fname``."""

    @abc.abstractmethod
    def load_optimizer_states(self, fname: str) -> None:
        """Restore the optimizer state written by :meth:`save_optimizer_states`."""

    def close(self) -> None:
        """Release sockets and threads.  Idempotent."""
        return None

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- hooks a store type implements ------------------------------------------------------
    @abc.abstractmethod
    def _init(self, keys: list[str], values: list[Array]) -> None: ...

    @abc.abstractmethod
    def _push(self, keys: list[str], values: list[list[Array]], priority: int) -> None: ...

    @abc.abstractmethod
    def _pull(self, keys: list[str], outs: list[list[Array]], priority: int) -> None: ...

    def _pushpull(self, keys: list[str], values: list[list[Array]], outs: list[list[Array]], priority: int) -> None:
        self._push(keys, values, priority)
        self._pull(keys, outs, priority)

    # --- normalisation -------------------------------------------------------------------------
    def _key(self, key: Key) -> str:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise ConfigError(f"KVStore keys are int or str, got {type(key).__name__} {key!r}")
        kind = int if isinstance(key, int) else str
        if self._key_kind is None:
            self._key_kind = kind
        elif kind is not self._key_kind:
            raise self.mixed_keys_error(f"key {key!r} is {kind.__name__} but this store already uses "
                                        f"{self._key_kind.__name__} keys; do not mix int and str keys")
        return str(key)

    def _normalise(self, key: Key | Sequence[Key], value: Any, what: str) -> tuple[list[str], list[list[Array]]]:
        if isinstance(key, (int, str)):
            if is_array(value):
                return [self._key(key)], [[value]]
            values = list(value) if isinstance(value, (list, tuple)) else None
            if not values or not all(is_array(v) for v in values):
                raise ConfigError(f"{what} for key {key!r} must be an array or a non-empty list of arrays")
            return [self._key(key)], [values]
        keys = list(key)
        if not isinstance(value, (list, tuple)) or len(value) != len(keys):
            n = len(value) if isinstance(value, (list, tuple)) else 1
            raise ConfigError(f"{len(keys)} keys but {n} {what}s: pass one {what} (or list of {what}s) per key")
        out_keys: list[str] = []
        out_values: list[list[Array]] = []
        for k, v in zip(keys, value, strict=True):
            ks, vs = self._normalise(k, v, what)
            out_keys += ks
            out_values += vs
        if len(set(out_keys)) != len(out_keys):
            raise ConfigError(f"a key appears twice in one call: {out_keys}")
        return out_keys, out_values
