"""row_sparse keys on a server: merging pushed rows and applying them to the stored value.

A row_sparse key is stored like any other key: its full dense value, flat, on
the servers that hold its shards (placement cuts such a key on row
boundaries, so each row lives whole on one server).  What differs is the
traffic: a ``ROW_PUSH`` carries only the ids of the rows a worker touched and
those rows, a ``ROW_PULL`` names row ids and is answered with just those rows.

* **merge** (``dist_sync``): the round's pushes are concatenated and summed
  per row id (:func:`merge_rows`), as MXNet's server adds row_sparse arrays;
  a push with no rows still counts as the worker's push for the round.
* **apply**: with an optimizer that allows it (:func:`lazy_allowed`: SGD and
  Adam with ``lazy_update=True``, AdaGrad and Ftrl, as MXNet's lazy and
  sparse kernels), only the pushed rows
  of the value and of the optimizer's state change; otherwise the rows are
  scattered into a zero gradient and the dense update runs (what MXNet does
  for optimizers without a sparse kernel, and for ``lazy_update=False``).
* **no optimizer** (``dist_sync``): the merged rows become the value and every
  other row becomes zero, as a dense push of the same gradient would.  (MXNet's
  server copies its row_sparse merge buffer over the stored value here and
  then answers pulls of the other rows from memory it no longer owns.)
"""

from __future__ import annotations

from typing import Any

import numpy as np


def merge_rows(parts: list[tuple[np.ndarray, np.ndarray]], width: int,
               dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Sum rows with equal ids: returns sorted unique ids and their summed rows (``(len(ids), width)``).

    ``parts`` holds ``(ids, rows)`` pairs; ids may repeat within and across parts.
    """
    parts = [(i, r.reshape(-1, width)) for i, r in parts if i.size]
    if not parts:
        return np.empty(0, np.int64), np.empty((0, width), dtype)
    ids = np.concatenate([i for i, _ in parts]) if len(parts) > 1 else parts[0][0]
    rows = np.concatenate([r for _, r in parts]) if len(parts) > 1 else parts[0][1]
    # Sort, keep the first row of each run of equal ids, then add the repeats into it.  Only the repeats go
    # through np.add.at (slow per row), and np.add.reduceat along axis 0 is slower still on wide rows.
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    first = np.concatenate(([True], ordered[1:] != ordered[:-1]))
    out = np.take(rows, order[first], axis=0)
    if out.shape[0] < ordered.size:
        run = np.cumsum(first) - 1
        repeats = ~first
        np.add.at(out, run[repeats], np.take(rows, order[repeats], axis=0))
    return ordered[first].astype(np.int64, copy=False), out


def lazy_allowed(updater: Any) -> bool:
    """Whether the updater's optimizer updates only the pushed rows (:meth:`Optimizer.lazy_rows`).

    True where MXNet 1.9.1 has a lazy or sparse kernel: SGD (and ccSGD) and
    Adam with ``lazy_update``, AdaGrad (its sparse kernel) and Ftrl.  Each of
    them updates one element from that element's weight, gradient and state,
    so updating a subset of rows is exactly that kernel.  LARS (a norm over the
    whole key) and the optimizers without such a kernel take the dense path.
    """
    opt = getattr(updater, "optimizer", None)
    return opt is not None and opt.lazy_rows()


def apply_rows(updater: Any, key: str, ids: np.ndarray, rows: np.ndarray, value: np.ndarray, width: int) -> None:
    """Apply merged rows to the flat stored ``value`` through ``updater`` (lazily where allowed)."""
    if not lazy_allowed(updater):
        grad = np.zeros_like(value)
        grad.reshape(-1, width)[ids] = rows.reshape(-1, width)
        updater(key, grad, value)
        return
    # A push of no rows still runs the rule over zero rows: MXNet's updater counts the update (Adam's step,
    # the scheduler) before its kernel returns early on an empty gradient.
    matrix = value.reshape(-1, width)
    sub = np.take(matrix, ids, axis=0).reshape(-1)  # (take: faster than fancy indexing on big arrays)
    states = updater.states.get(key)
    if states is None:
        states = updater.optimizer.create_state_multi_precision(key, value)
    full = [name for name, s in states.items() if isinstance(s, np.ndarray) and s.size == value.size]
    picked = {name: (np.take(s.reshape(-1, width), ids, axis=0).reshape(-1) if name in full else s)
              for name, s in states.items()}
    # The updater runs its ordinary (dense) rule on the picked rows and their state; the key's full state
    # is put back after, with those rows written in.
    updater.states[key] = picked
    try:
        updater.update_rows(key, np.ascontiguousarray(rows, dtype=value.dtype).reshape(-1), sub)
    finally:
        updater.states[key] = states
    matrix[ids] = sub.reshape(-1, width)
    for name in full:
        states[name].reshape(-1, width)[ids] = picked[name].reshape(-1, width)
    for name, s in picked.items():
        if name not in full:
            states[name] = s  # scalars and counters the rule replaced
