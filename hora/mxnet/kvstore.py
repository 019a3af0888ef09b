"""hora's stores in MXNet's own KVStore registry, so ``gluon.Trainer`` and ``Module`` can use them.

Importing :mod:`hora.mxnet` registers, with ``mx.kvstore.KVStoreBase.register``:

==================  ===============================================================================
``hora``            sums across ranks with hora's allreduce engine, no servers (what MXNet's own
                    ``horovod`` entry does).  ``gluon.Trainer(..., kvstore=mx.kv.create('hora'))``
                    then trains data-parallel; the optimizer runs on every worker.
``hora_dist_sync``  hora's parameter servers (``hora run -n W -s S``), MXNet ``dist_sync``
                    semantics: a server merges every worker's push of a key, then runs the
                    optimizer that ``gluon.Trainer`` sends it.
``hora_dist_async`` the same servers with ``dist_async`` semantics: every push is applied on arrival.
==================  ===============================================================================

MXNet's Trainer drops a store given by a name without ``dist`` when the
process has a single device, so pass ``mx.kv.create('hora')`` rather than the
string ``'hora'``; the two server-backed names work as strings
(``kvstore='hora_dist_sync'``) as well.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Sequence
from typing import Any

import mxnet as mx
import numpy as np

from hora.core import runtime
from hora.core.ops import ReduceOp
from hora.errors import ConfigError
from hora.kvstore import base as kvbase
from hora.mxnet import engine, mpi_ops, sparse
from hora.mxnet.buffers import check_ndarray, copy_into, engine_view, on_host, read_view, write_view
from hora.mxnet.server_optimizer import hora_optimizer_of

log = logging.getLogger(__name__)

KVStoreBase = mx.kvstore.KVStoreBase

#: the names this module registers, with the hora.kvstore type behind each server-backed one.
NAMES = {"hora": "dist_sync_allreduce", "hora_dist_sync": "dist_sync", "hora_dist_async": "dist_async"}


def _as_list(value: Any) -> list[mx.nd.NDArray]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _pairs(key: Any, value: Any) -> list[tuple[Any, list[mx.nd.NDArray]]]:
    """MXNet's call forms (a key or a list of keys; per key an array or a list of arrays) as (key, arrays)."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise ConfigError(f"{len(key)} keys need one value (or list of values) each")
        return [(k, _as_list(v)) for k, v in zip(key, value, strict=True)]
    return [(key, _as_list(value))]


def _local_sum(arrays: list[mx.nd.NDArray]) -> mx.nd.NDArray:
    """The per-process sum of one key's values (one per device), on the first value's context."""
    if len(arrays) == 1:
        return arrays[0]
    ctx = arrays[0].context
    return mx.nd.add_n(*[a.as_in_context(ctx) for a in arrays])


class HoraAllreduceStore(KVStoreBase):
    """The ``hora`` store: ``pushpull`` sums the values over all ranks with the engine's allreduce.

    Created by ``mx.kv.create('hora')``; starts hora (``hvd.init()``) when
    it is not running.  No optimizer runs in the store
    (``is_capable('optimizer')`` is False), so ``gluon.Trainer`` updates on
    every worker with the summed gradients: pass ``step()`` the global batch
    size (per-rank batch × ``num_workers``) to average.
    """

    def __init__(self) -> None:
        runtime.init()
        self._sums: dict[Any, mx.nd.NDArray] = {}  # push results awaiting pull (Module's call pattern)

    def init(self, key: Any, value: Any) -> None:
        """Give every rank rank 0's value of each key, in place (MXNet stores worker 0's value at init)."""
        for k, arrays in _pairs(key, value):
            for i, a in enumerate(arrays):
                mpi_ops.broadcast_(check_ndarray(a, "init"), 0, name=f"hora.kv.init.{k}.{i}")

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Sum ``value`` over all ranks; the next ``pull`` of the key reads the sum."""
        pairs = _pairs(key, value)
        outs = [mx.nd.zeros(arrays[0].shape, ctx=arrays[0].context, dtype=arrays[0].dtype) for _, arrays in pairs]
        self.pushpull([k for k, _ in pairs], [v for _, v in pairs], out=outs, priority=priority)
        self._sums.update({k: o for (k, _), o in zip(pairs, outs, strict=True)})

    def pull(self, key: Any, out: Any = None, priority: int = 0, ignore_sparse: bool = True) -> None:
        """Copy the sum of the key's last ``push`` into ``out``."""
        for k, arrays in _pairs(key, out):
            if k not in self._sums:
                raise ConfigError(f"pull of key {k!r} before any push: the 'hora' KVStore holds no values, only "
                                  "the sum of the last push")
            for a in arrays:
                self._sums[k].copyto(a)

    def broadcast(self, key: Any, value: mx.nd.NDArray, out: Any, priority: int = 0) -> None:
        """Rank 0's ``value`` of ``key`` into every array of ``out``, on every rank."""
        src = check_ndarray(value, "broadcast").copy()
        mpi_ops.broadcast_(src, 0, name=f"hora.kv.broadcast.{key}")
        for o in _as_list(out):
            src.copyto(o)

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Sum ``value`` (per key: one array or one per device) over all ranks into ``out``, or into ``value``."""
        pairs = _pairs(key, value)
        outs = [v for _, v in pairs] if out is None else [o for _, o in _pairs(key, out)]
        tensors = []
        for _, arrays in pairs:
            total = _local_sum(arrays)
            # Reduce in the caller's array only when it is also where the result goes.
            tensors.append(total.copy() if total is arrays[0] and out is not None else total)
        # One grouped allreduce per call: the keys are negotiated and fused together.
        mpi_ops.grouped_allreduce_(tensors, op=ReduceOp.SUM, name="hora.kv." + ",".join(str(k) for k, _ in pairs))
        for summed, targets in zip(tensors, outs, strict=True):
            for t in targets:
                if t is not summed:
                    summed.copyto(t)

    def set_optimizer(self, optimizer: Any) -> None:
        """Refused: the store runs no optimizer (MXNet's ``horovod`` store silently ignores it; see the message)."""
        raise ConfigError("the 'hora' KVStore runs no optimizer (is_capable('optimizer') is False): let "
                          "gluon.Trainer update on the workers (update_on_kvstore=False), or use 'hora_dist_sync' "
                          "for an optimizer on parameter servers")

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Refused with what to use instead (MXNet's ``horovod`` store has no such method at all)."""
        raise ConfigError(f"the 'hora' KVStore does not compress gradients ({compression_params!r}): pass "
                          "hvd.DistributedTrainer(..., compression=hvd.Compression.fp16) for allreduce, or use "
                          "'hora_dist_sync', whose servers decode MXNet's 2-bit compression")

    @staticmethod
    def is_capable(capability: str) -> bool:
        """True for ``'optimizer'`` when the store runs one (the servers do; the allreduce store does not)."""
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return False
        raise ValueError(f"unknown capability: {capability}")

    @property
    def type(self) -> str:
        """The name the store is registered under."""
        return "hora"

    @property
    def rank(self) -> int:
        """This worker's rank among the workers."""
        return runtime.current().engine.rank

    @property
    def local_rank(self) -> int:
        """This worker's rank among the workers on its host (MXNet's ``horovod`` store has it too)."""
        return runtime.current().engine.topology.local_rank

    @property
    def num_workers(self) -> int:
        """Number of workers in the job."""
        return runtime.current().engine.size

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Refused: the store holds no optimizer state (MXNet's ``horovod`` store silently writes nothing)."""
        raise ConfigError("the 'hora' KVStore holds no optimizer state (the optimizer runs on every worker): save it "
                          "with gluon.Trainer.save_states, or use 'hora_dist_sync' to keep it on parameter servers")

    def load_optimizer_states(self, fname: str) -> None:
        """Refused: the store holds no optimizer state (MXNet's ``horovod`` store silently reads nothing)."""
        raise ConfigError("the 'hora' KVStore holds no optimizer state (the optimizer runs on every worker): load it "
                          "with gluon.Trainer.load_states, or use 'hora_dist_sync' to keep it on parameter servers")


class MixedKeysError(kvbase.MixedKeysError, mx.base.MXNetError):
    """int and str keys mixed in one store: refused as MXNet refuses it ("Mixed key types are not allowed"), and
    of MXNet's error type, which scripts written for MXNet catch (its nightly ``invalid_cpu`` test does)."""


class _ServerStore(KVStoreBase):
    """hora's parameter-server store (:mod:`hora.kvstore.dist`) behind MXNet's KVStore interface, on NDArrays.

    ``pushpull`` of host arrays (what ``gluon.Trainer`` calls, once per
    parameter) runs on MXNet's engine, as MXNet's own ``dist_sync`` does: it
    returns at once, the push leaves as soon as backward has written the
    gradient, and MXNet's next operators on ``out`` (the next forward pass)
    wait until the servers' values are in it.  So the parameters travel while
    backward computes the others, and all of them are in flight together.  An
    error of such a call (a lost server, an optimizer failure on a server) is
    raised by the store's next call.  Every other call, and ``pushpull`` of
    arrays that are not on the host, blocks as before (after waiting for the
    engine's calls in flight, so the order of a worker's pushes is kept).
    """

    kv_type = ""

    def __init__(self) -> None:
        from hora.kvstore import create

        self._store = create(NAMES[self.type])
        self._store.mixed_keys_error = MixedKeysError
        self._optimizer: Any = None
        self._key_vars: dict[str, mx.nd.NDArray] = {}  # per key: orders its engine calls (push, then copy-out)
        self._inflight = 0  # engine calls started and not yet finished
        self._idle = threading.Condition()
        self._error: BaseException | None = None  # the first failure of an engine call, for the next call
        atexit.register(self._drain, 60.0)  # runs before the store's own close (registered earlier)

    @staticmethod
    def _host(arrays: Sequence[mx.nd.NDArray]) -> list[np.ndarray]:
        return [read_view(check_ndarray(a, "push")) for a in arrays]

    # --- engine calls ------------------------------------------------------------------------------
    def _sync(self) -> None:
        """Before a blocking call: wait for the engine calls in flight, then raise the first one's error."""
        self._drain()
        self._raise_failure()

    def _raise_failure(self) -> None:
        with self._idle:
            error, self._error = self._error, None
        if error is not None:
            error.add_note("(raised by an earlier pushpull, which ran on MXNet's engine)")
            raise error

    def _drain(self, timeout: float | None = None) -> None:
        with self._idle:
            if not self._idle.wait_for(lambda: self._inflight == 0, timeout):
                log.warning("%d pushpull calls on MXNet's engine did not finish within %s s", self._inflight, timeout)

    def _failed(self, error: BaseException) -> None:
        with self._idle:
            if self._error is None:
                self._error = error

    def _ended(self) -> None:
        with self._idle:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.notify_all()

    def _key_var(self, name: str) -> mx.nd.NDArray:
        var = self._key_vars.get(name)
        if var is None:
            var = self._key_vars[name] = mx.nd.zeros((1,), ctx=mx.cpu())
        return var

    def _pushpull_on_engine(self, pairs: list[tuple[Any, list[mx.nd.NDArray]]],
                            outs: list[tuple[Any, list[mx.nd.NDArray]]], priority: int) -> bool:
        """Run ``pushpull`` as two engine operations; False when these arrays need the blocking path."""
        if not engine.available():
            return False
        keys = [k for k, _ in pairs]
        values = [v for _, v in pairs]
        targets = [o[0] for _, o in outs if len(o) == 1]
        if len(targets) != len(outs) or len(targets) != 1:
            return False  # several outs might share memory, which one operation may not write twice
        arrays = [a for v in values for a in v] + targets
        for a in arrays:
            check_ndarray(a, "pushpull")
            if not on_host(a):
                return False
        names = []
        for k, v in pairs:  # errors that belong to this call are raised here, not on the engine
            names += [self._store.check_arrays(k, a.shape, a.dtype) for a in v]
        self._store.check_arrays(keys[0], targets[0].shape, targets[0].dtype, "pull")
        key_vars = [self._key_var(n) for n in dict.fromkeys(names)]
        ticket: list[Any] = []

        def start(done: engine.Completion) -> None:  # engine thread: the gradients are written
            try:
                ticket.append(self._store.pushpull_async(keys, [[engine_view(a) for a in v] for v in values],
                                                         priority))
            except BaseException as e:
                self._failed(e)
                done()
                return
            ticket[0].on_ready(done)

        def finish() -> None:  # engine thread: the values are here, and nothing reads ``out`` any more
            try:
                if ticket:
                    ticket[0].finish([engine_view(targets[0])])
            except BaseException as e:
                self._failed(e)
            finally:
                self._ended()

        with self._idle:
            self._inflight += 1
        try:
            engine.push_async(start, reads=arrays[:-1], writes=key_vars, priority=priority, name="hora_pushpull")
        except BaseException:
            self._ended()
            raise
        engine.push_sync(finish, reads=key_vars, writes=targets, priority=priority, name="hora_pull_out")
        return True

    # --- KVStore ----------------------------------------------------------------------------------
    def init(self, key: Any, value: Any) -> None:
        """Store worker 0's value of each key on the servers (every worker calls it)."""
        self._sync()
        pairs = _pairs(key, value)
        # a row_sparse value is stored whole (its dense form), as MXNet's servers store every row
        self._store.init([k for k, _ in pairs], [self._host([sparse.dense(v[0])])[0] for _, v in pairs])

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Push values (several per key are summed first); returns once the data is copied.

        A row_sparse value travels as its row ids and rows only (:mod:`hora.mxnet.sparse`).
        """
        self._sync()
        pairs = _pairs(key, value)
        dense_pairs = []
        for k, v in pairs:
            for a in v:
                sparse.check_storage(a, "push")
            if any(sparse.is_sparse(a) for a in v):
                self._store.push_rows(k, *sparse.rows_of(v))
            else:
                dense_pairs.append((k, v))
        if dense_pairs:
            self._store.push([k for k, _ in dense_pairs], [self._host(v) for _, v in dense_pairs], priority)

    def row_sparse_pull(self, key: Any, out: Any = None, priority: int = 0, row_ids: Any = None) -> None:
        """Pull only the rows ``row_ids`` of each key into row_sparse ``out`` (MXNet's ``row_sparse_pull``).

        Row ids need not be sorted or unique: ``out`` holds each asked row once,
        sorted; rows nobody pushed hold their initial value.
        """
        self._sync()
        pairs = _pairs(key, out)
        if len(pairs) == 1:
            per_key = [row_ids]
        elif isinstance(row_ids, (list, tuple)) and len(row_ids) == len(pairs):
            per_key = list(row_ids)
        else:
            raise ConfigError(f"row_sparse_pull of {len(pairs)} keys needs a list of row_ids, one per key")
        for (k, outs), ids_of_key in zip(pairs, per_key, strict=True):
            for a, ids in zip(outs, sparse.row_ids_of(ids_of_key, len(outs)), strict=True):
                sparse.fill_rows(a, *self._store.pull_rows(k, ids))

    def pull(self, key: Any, out: Any = None, priority: int = 0, ignore_sparse: bool = True) -> None:
        """Copy the servers' values of each key into ``out``.

        row_sparse outs are skipped (MXNet's ``ignore_sparse=True``); pull their rows with
        ``row_sparse_pull``.  ``ignore_sparse=False`` is refused, as MXNet's dist stores refuse it.
        """
        if not ignore_sparse:
            raise sparse.SparsePullError("dist kvstore pull doesn't support ignore_sparse=False (as MXNet's): pull "
                                         "row_sparse values with row_sparse_pull(key, out, row_ids)")
        self._sync()
        pairs = []
        for k, arrays in _pairs(key, out):
            kept = [a for a in arrays if not sparse.is_sparse(a)]
            if kept:
                pairs.append((k, kept))
        if not pairs:
            return
        views: list[list[np.ndarray]] = []
        copies: list[tuple[mx.nd.NDArray, np.ndarray]] = []
        for _, arrays in pairs:
            row = []
            for a in arrays:
                if on_host(a):
                    row.append(write_view(a))
                else:
                    staged = np.empty(a.shape, np.dtype(a.dtype))
                    copies.append((a, staged))
                    row.append(staged)
            views.append(row)
        self._store.pull([k for k, _ in pairs], views, priority)
        for a, staged in copies:
            copy_into(a, staged)

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Worker 0's ``value`` into ``out`` on every worker: ``init`` on the servers, then ``pull``."""
        self.init(key, value)
        self.pull(key, out, priority)

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Push ``value`` (gradients), then pull the servers' values (weights, with an optimizer) into ``out``.

        On host arrays, one key and one ``out``, this returns at once and runs on MXNet's engine (see the
        class); otherwise it blocks until ``out`` holds the values.
        """
        self._raise_failure()
        pairs = _pairs(key, value)
        outs = pairs if out is None else _pairs(key, out)
        if len(outs) != len(pairs):
            raise ConfigError(f"{len(pairs)} keys need one out (or list of outs) each")
        if self._pushpull_on_engine(pairs, outs, priority):
            return
        self.push(key, value, priority)
        self.pull(key, value if out is None else out, priority)

    def set_optimizer(self, optimizer: Any) -> None:
        """Run ``optimizer`` (any of MXNet's eighteen ``mx.optimizer`` classes, or a hora one) on the servers.

        It travels as data (see :mod:`hora.mxnet.server_optimizer`); an
        optimizer class of your own is refused with the two ways out.
        """
        self._sync()
        self._optimizer = optimizer
        self._store.set_optimizer(hora_optimizer_of(optimizer))

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress pushes, e.g. ``{'type': '2bit', 'threshold': 0.5}``; the servers decode them."""
        self._sync()
        self._store.set_gradient_compression(compression_params)

    def barrier(self) -> None:
        """Wait until every worker reaches this point."""
        self._sync()
        self._store.barrier()

    @staticmethod
    def is_capable(capability: str) -> bool:
        """True for ``'optimizer'`` when the store runs one (the servers do; the allreduce store does not)."""
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return True
        raise ValueError(f"unknown capability: {capability}")

    @property
    def type(self) -> str:
        """The name the store is registered under."""
        return self.kv_type

    @property
    def rank(self) -> int:
        """This worker's rank among the workers."""
        return self._store.rank

    @property
    def num_workers(self) -> int:
        """Number of workers in the job."""
        return self._store.num_workers

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Write the optimizer state to ``fname`` (servers' state for the PS-backed stores)."""
        self._sync()
        self._store.save_optimizer_states(fname, dump_optimizer)

    def load_optimizer_states(self, fname: str) -> None:
        """Restore the state written by ``save_optimizer_states``."""
        self._sync()
        self._store.load_optimizer_states(fname)

    def close(self) -> None:
        """Leave the parameter-server job (also done at exit)."""
        self._drain(60.0)
        self._store.close()


class HoraDistSyncStore(_ServerStore, sparse.NativeStoreSurface):
    """``hora_dist_sync``: MXNet's ``dist_sync`` on hora's parameter servers (an ``mx.kv.KVStore``, for gluon's
    sparse checks: see :class:`hora.mxnet.sparse.NativeStoreSurface`)."""

    kv_type = "hora_dist_sync"


class HoraDistAsyncStore(_ServerStore, sparse.NativeStoreSurface):
    """``hora_dist_async``: MXNet's ``dist_async`` on hora's parameter servers (an ``mx.kv.KVStore`` too)."""

    kv_type = "hora_dist_async"


def register() -> None:
    """Register the stores under :data:`NAMES` in MXNet's registry (idempotent; done on import)."""
    for name, cls in (("hora", HoraAllreduceStore), ("hora_dist_sync", HoraDistSyncStore),
                      ("hora_dist_async", HoraDistAsyncStore)):
        if KVStoreBase.kv_registry.get(name) is cls:
            continue
        # MXNet names a registered store after its class, lower-cased.
        cls.__name__ = name
        KVStoreBase.register(cls)
