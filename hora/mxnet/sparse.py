"""row_sparse NDArrays on hora's parameter-server stores: only touched rows travel.

MXNet's ``dist_sync`` store pushes a row_sparse gradient as its row ids and
rows, and ``row_sparse_pull`` fetches only the rows asked for.  These helpers
turn row_sparse NDArrays into the ``(ids, rows)`` pairs of
:meth:`hora.kvstore.dist.DistKVStore.push_rows` / ``pull_rows`` and back;
:mod:`hora.mxnet.kvstore` calls them.  ``init`` of a row_sparse value stores
its dense form (every row, as MXNet's server does).
"""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np

from hora.errors import ConfigError


class SparsePullError(ConfigError, mx.base.MXNetError):
    """``pull(..., ignore_sparse=False)`` on a dist store: refused as MXNet's dist stores refuse it (and of
    MXNet's error type too, which scripts written for MXNet catch)."""


def is_sparse(array: Any) -> bool:
    """True for a row_sparse NDArray (the only sparse storage type a store takes)."""
    return isinstance(array, mx.nd.NDArray) and array.stype == "row_sparse"


def check_storage(array: Any, what: str) -> None:
    """Refuse CSR arrays, which MXNet's stores do not take either.

    Raises:
        TypeError: a csr NDArray; the message names the fix.
    """
    if isinstance(array, mx.nd.NDArray) and array.stype == "csr":
        raise TypeError(f"{what} of a csr NDArray: KVStores take default and row_sparse arrays; call "
                        ".tostype('row_sparse') or .tostype('default') first")


def dense(array: mx.nd.NDArray) -> mx.nd.NDArray:
    """The default-storage form of a row_sparse array (rows it lacks are zero); other arrays as they are."""
    return array.tostype("default") if is_sparse(array) else array


def rows_of(arrays: list[mx.nd.NDArray]) -> tuple[np.ndarray, np.ndarray]:
    """The sum of one key's row_sparse values (one per device) as ``(row ids, rows)`` on the host."""
    total = arrays[0] if len(arrays) == 1 else mx.nd.add_n(*[a.as_in_context(arrays[0].context) for a in arrays])
    if not is_sparse(total):
        total = total.tostype("row_sparse")
    return total.indices.asnumpy().astype(np.int64), total.data.asnumpy()


def fill_rows(out: mx.nd.NDArray, ids: np.ndarray, rows: np.ndarray) -> None:
    """Make row_sparse ``out`` hold exactly ``rows`` at ``ids`` (sorted, unique), as MXNet's row_sparse_pull.

    Raises:
        TypeError: ``out`` is not a row_sparse NDArray.
    """
    if not is_sparse(out):
        raise TypeError(f"row_sparse_pull needs row_sparse outs (mx.nd.sparse.zeros('row_sparse', shape)), got "
                        f"a {getattr(out, 'stype', type(out).__name__)} array; use pull() for default arrays")
    # Not recorded: gluon pulls a sparse weight inside autograd.record(), and MXNet's own store writes it
    # from its engine, outside the graph, too.
    with mx.autograd.pause():
        value = mx.nd.sparse.row_sparse_array((rows.astype(np.dtype(out.dtype), copy=False), ids),
                                              shape=out.shape, ctx=out.context, dtype=out.dtype)
        value.copyto(out)


def row_ids_of(row_ids: Any, count: int) -> list[np.ndarray]:
    """``row_ids`` (an NDArray, or a list with one per out or a single one for all) as host int64 arrays.

    Raises:
        ConfigError: the number of row-id arrays fits neither one nor ``count``.
    """
    if row_ids is None:
        raise ConfigError("row_sparse_pull needs row_ids=: an NDArray of the row ids to pull (per out, or one)")
    arrays = list(row_ids) if isinstance(row_ids, (list, tuple)) else [row_ids]
    if len(arrays) not in (1, count):
        raise ConfigError(f"row_sparse_pull: {len(arrays)} row_ids for {count} outs; pass one, or one per out")
    host = [a.asnumpy() if isinstance(a, mx.nd.NDArray) else np.asarray(a) for a in arrays]
    return host * count if len(host) == 1 else host


class NativeStoreSurface(mx.kv.KVStore):
    """Makes a hora server store an ``mx.kv.KVStore`` for gluon's sparse checks.

    gluon's ``Trainer`` checks with ``isinstance(kv, mx.kv.KVStore)`` before it
    trains row_sparse weights or sparse gradients on a store instance. The check
    stands for "a store that takes row_sparse pushes and row_sparse_pull", which
    hora's server stores do, so they are real subclasses. This base then
    replaces every member of ``KVStore`` that uses its C handle:

    - there is no handle (``handle`` is None) and nothing to free;
    - ``_barrier`` is the store's barrier;
    - ``_set_updater`` (a Python updater on the workers) and ``_send_command_to_servers``
      (MXNet's raw server commands) raise with what to use instead.

    The store class (first in the bases) supplies everything else.
    """

    handle = None

    def __del__(self) -> None:
        return None  # no C handle to free; the store closes at exit

    def _barrier(self) -> None:
        self.barrier()  # type: ignore[attr-defined]

    def _set_updater(self, updater: Any) -> None:
        raise ConfigError("hora's server stores run the optimizer on the servers (set_optimizer) and take no "
                          "worker-side updater: use set_optimizer, or update on the workers with the 'hora' store")

    def _send_command_to_servers(self, head: int, body: str) -> None:
        raise ConfigError(f"MXNet's raw server command {head} has no hora equivalent; the optimizer travels with "
                          "set_optimizer, and server profiling is not available on hora's servers")
