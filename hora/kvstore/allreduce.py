"""``dist_sync_allreduce``: the KVStore API carried by hora's allreduce engine, with no servers.

This is the store the MPI-allreduce proposal asked MXNet for (``dist_sync_mpi``):

* ``init`` broadcasts rank 0's value to every rank.
* ``push(key, [v0, v1, ...])`` sums the per-device values locally (on the
  first value's device), then submits an asynchronous allreduce (SUM) of the
  sum to the engine and returns.  Pushes of many keys are in flight together
  and the engine fuses them into few backend calls.
* The first ``pull`` (or the next ``push``) of a key waits for its
  allreduce, then applies the updater: the optimizer set with
  :meth:`AllreduceKVStore.set_optimizer`, run identically on every rank, or
  plain assignment of the sum.  ``pull`` copies the stored value out.
* With 2-bit compression each rank quantises its local sum (with a per-key
  residual), the packed words are allgathered, and every rank decodes and sums
  all ranks' contributions in rank order (what a server does under
  ``dist_sync``).

Rank and size come from the engine; the engine is started on first use when
``hora.init()`` has not been called, and left running by :meth:`close` (other
bindings in the process may share it).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

import numpy as np

from hora.core import collectives, runtime
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.request import Handle
from hora.errors import ConfigError, HoraError
from hora.kvstore.arrays import Array, converted, copy_into, copy_of, device_of, dtype_name, numpy_of, shape_of
from hora.kvstore.held import HeldKVStore

log = logging.getLogger(__name__)

_SUPPORTED = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool")
_store_ids = itertools.count()


@dataclasses.dataclass(slots=True)
class _Pending:
    """A push whose collective is in flight."""

    handle: Handle
    merged: Array  # the local sum (reduced in place unless compressed)
    compressed: bool


class AllreduceKVStore(HeldKVStore):
    """The ``dist_sync_allreduce`` store.  Create it with ``hora.kvstore.create('dist_sync_allreduce')``.

    Every rank must create its stores in the same order and call ``init``,
    ``push`` and ``barrier`` for the same keys (in any order within a step).
    """

    def __init__(self, kv_type: str = "dist_sync_allreduce") -> None:
        if kv_type != "dist_sync_allreduce":
            raise ConfigError(f"AllreduceKVStore serves 'dist_sync_allreduce', not {kv_type!r}")
        super().__init__(kv_type)
        runtime.init()  # idempotent: joins the running engine when there is one
        self._prefix = f"kvstore{next(_store_ids)}"
        self._pending: dict[str, _Pending] = {}

    # --- identity ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the engine."""
        return runtime.current().engine.rank

    @property
    def num_workers(self) -> int:
        """Number of ranks in the engine."""
        return runtime.current().engine.size

    # --- MXNet API ------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Finish this rank's pushes in flight, then wait until every rank reaches the barrier."""
        self._settle_all()
        collectives.submit(CollectiveType.BARRIER, [], wake=False).wait()

    def close(self) -> None:
        """Finish pushes in flight (the engine keeps running).  Idempotent."""
        try:
            self._settle_all()
        except HoraError as e:
            log.warning("closing KVStore %s with pushes that failed: %s", self._prefix, e)
            self._pending.clear()

    # --- hooks ----------------------------------------------------------------------------------
    def _init(self, keys: list[str], values: list[Array]) -> None:
        for key, value in zip(keys, values, strict=True):
            if key in self._store:
                raise ConfigError(f"key {self._user_key(key)!r} is already initialised; init() each key once")
            if dtype_name(value) not in _SUPPORTED:
                raise ConfigError(f"key {self._user_key(key)!r} has dtype {dtype_name(value)}, which the allreduce "
                                  f"engine does not carry; use one of: {', '.join(_SUPPORTED)}")
        copies = [copy_of(v) for v in values]
        handles = [self._submit(CollectiveType.BROADCAST, copy, f"{self._prefix}.init.{key}", root=0, wake=False)
                   for key, copy in zip(keys, copies, strict=True)]
        for handle in handles:
            handle.wait()
        for key, copy in zip(keys, copies, strict=True):
            self._store[key] = copy

    def _push(self, keys: list[str], values: list[list[Array]], priority: int) -> None:
        for key, vals in zip(keys, values, strict=True):
            stored = self._stored(key, "push")
            self._check_shapes(key, vals, stored, "pushed")
            self._settle(key)
            merged = copy_of(vals[0], like=stored, device=device_of(vals[0]))
            for v in vals[1:]:
                merged += converted(v, merged)
            name = f"{self._prefix}.push.{key}"
            if self._compressor is None:
                handle = self._submit(CollectiveType.ALLREDUCE, merged, name)
                self._pending[key] = _Pending(handle, merged, compressed=False)
            else:
                packed = self._compressor.compress(key, numpy_of(merged))
                handle = self._submit(CollectiveType.ALLGATHER, packed.view(np.int32), name)
                self._pending[key] = _Pending(handle, merged, compressed=True)

    def _pull(self, keys: list[str], outs: list[list[Array]], priority: int) -> None:
        for key in keys:
            self._stored(key, "pull")
        for key in keys:
            self._settle(key)
        for key, targets in zip(keys, outs, strict=True):
            stored = self._store[key]
            self._check_shapes(key, targets, stored, "out")
            for out in targets:
                copy_into(out, stored)

    # --- internals --------------------------------------------------------------------------------
    def _submit(self, kind: CollectiveType, value: Array, name: str, *, root: int = -1, wake: bool = True) -> Handle:
        """Reduce, broadcast (both in place) or gather ``value`` through the core's entry point."""
        buf = np.ascontiguousarray(value) if isinstance(value, np.ndarray) else value
        adapter = collectives.NUMPY_ADAPTER if isinstance(buf, np.ndarray) else _torch_adapter()
        return collectives.submit(kind, [buf], name=name, op=ReduceOp.SUM, root=root, inplace=True,
                                  adapter=adapter, wake=wake)

    def _settle(self, key: str) -> None:
        """Wait for the key's push in flight (if any) and apply it to the stored value."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        result = pending.handle.wait()
        merged = pending.merged
        if pending.compressed:
            merged = self._decode_all(key, result[0], merged)
        self._apply(key, merged, self._store[key])

    def _decode_all(self, key: str, gathered: Any, like: Array) -> Array:
        words = numpy_of(gathered).view(np.uint32).reshape(self.num_workers, -1)
        size = int(np.prod(shape_of(like), dtype=np.int64))
        total = self._compressor.decompress(words[0], size)
        for r in range(1, words.shape[0]):
            total += self._compressor.decompress(words[r], size)
        return converted(total.reshape(shape_of(like)), like)

    def _settle_all(self) -> None:
        for key in list(self._pending):
            self._settle(key)


def _torch_adapter() -> collectives.Adapter:
    """torch tensors pass as they are; CUDA ones after the current stream has written them."""
    from hora.core.buffers.torch_ops import wait_for_stream

    return collectives.Adapter(to_buffer=None, sync=wait_for_stream)


__all__ = ["AllreduceKVStore"]
