"""What the stores that hold their values in this process share (``local``, ``device``, ``dist_sync_allreduce``).

Each keeps a dict of stored values and applies an updater to them: the
optimizer set with :meth:`HeldKVStore.set_optimizer`, a custom updater, or
MXNet's default, plain assignment of the merged value.  Only where the
merged value comes from differs (a local sum, or an allreduce), so that part
stays in the subclasses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hora.errors import ConfigError
from hora.kvstore.arrays import Array, converted, device_of, shape_of
from hora.kvstore.base import KVStore
from hora.kvstore.compression import Compressor, create_compressor
from hora.kvstore.optimizer import Optimizer, Updater, updater_for


class HeldKVStore(KVStore):
    """A KVStore whose values live in this process; see the module docstring."""

    def __init__(self, kv_type: str) -> None:
        super().__init__(kv_type)
        self._store: dict[str, Array] = {}
        self._updater: Callable[[Any, Array, Array], None] | None = None
        self._compressor: Compressor | None = None

    # --- MXNet API ------------------------------------------------------------------------------
    def set_optimizer(self, optimizer: Optimizer | dict | str) -> None:
        """Run ``optimizer`` on every push (an Optimizer, its spec dict, or a name for ``optimizer.create``)."""
        self._settle_all()
        self._updater = updater_for(optimizer)

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress pushes, e.g. ``{'type': '2bit', 'threshold': 0.5}``."""
        self._settle_all()
        self._compressor = create_compressor(compression_params)

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Write every key's optimizer state to ``fname`` (with the optimizer's spec when asked)."""
        self._settle_all()
        data = self._optimizer_updater("save").get_states(dump_optimizer)
        with open(fname, "wb") as f:
            f.write(data)

    def load_optimizer_states(self, fname: str) -> None:
        """Restore optimizer state written by :meth:`save_optimizer_states`."""
        self._settle_all()
        updater = self._optimizer_updater("load")
        with open(fname, "rb") as f:
            updater.set_states(f.read())

    # --- for subclasses ---------------------------------------------------------------------------
    def _settle_all(self) -> None:
        """Finish pushes still in flight (a store with asynchronous pushes overrides this)."""
        return None

    def _apply(self, key: str, merged: Array, stored: Array) -> None:
        """Fold a key's merged push into its stored value: the updater, or assignment without one."""
        if device_of(merged) != device_of(stored):
            stored = self._store[key] = converted(stored, merged)  # the value follows the merge
        if self._updater is None:
            self._store[key] = merged
        elif isinstance(self._updater, Updater):
            self._updater(key, merged, stored)
        else:  # a custom updater sees the key as the user wrote it
            self._updater(self._user_key(key), merged, stored)

    def _user_key(self, key: str) -> Any:
        return int(key) if self._key_kind is int else key

    def _stored(self, key: str, what: str) -> Array:
        stored = self._store.get(key)
        if stored is None:
            raise ConfigError(f"cannot {what} key {self._user_key(key)!r}: it has not been initialised; "
                              "call init(key, value) first")
        return stored

    def _check_shapes(self, key: str, arrays: list[Array], stored: Array, what: str) -> None:
        for i, a in enumerate(arrays):
            if shape_of(a) != shape_of(stored):
                raise ConfigError(f"key {self._user_key(key)!r}: {what} array {i} has shape {shape_of(a)} but "
                                  f"the key was initialised with shape {shape_of(stored)}")

    def _optimizer_updater(self, what: str) -> Updater:
        if not isinstance(self._updater, Updater):
            raise ConfigError(f"cannot {what} optimizer states: no optimizer is set on this KVStore "
                              "(call set_optimizer() first)")
        return self._updater


__all__ = ["HeldKVStore"]
