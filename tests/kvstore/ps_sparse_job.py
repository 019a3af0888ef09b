"""row_sparse keys through real servers (run by tests/kvstore/test_ps_sparse.py under ``hora run -np 2 -s 2``).

``python ps_sparse_job.py sync|async``: pushes rows with repeated and empty id
lists, pulls rows with repeated ids and rows nobody pushed, and checks every
value against NumPy; prints ``SPARSE OK <mode> <checks>``.
"""

from __future__ import annotations

import sys

import numpy as np

import hora.kvstore as kvs
from hora.kvstore.optimizer import SGD, Adam

ROWS, WIDTH = 40, 3  # 120 elements: with HORA_PS_BIGARRAY_BOUND=50 the key is cut over both servers


def _init() -> np.ndarray:
    return np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH) / 8


def _rows(rank: int, it: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank 0 pushes ids with a repeat on both servers' halves; rank 1 pushes nothing on odd steps."""
    if rank == 1 and it % 2:
        return np.empty(0, np.int64), np.empty((0, WIDTH), np.float32)
    ids = np.array([1, 4, 4, 30, 39] if rank == 0 else [4, 9 + it, 25], np.int64)
    rows = (np.arange(ids.size * WIDTH, dtype=np.float32).reshape(-1, WIDTH) + rank + it) / 4
    return ids, rows


def _dense(ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    g = np.zeros((ROWS, WIDTH), np.float32)
    np.add.at(g, ids, rows)
    return g


def sync() -> int:
    kv = kvs.create("dist_sync")
    kv.init("emb", _init())
    assert len(kv._info("emb").shards) == 2, kv._info("emb").shards
    checks = 0
    # no optimizer: the merged rows become the value, every other row zero (as a dense push would)
    for it in range(3):
        kv.push_rows("emb", *_rows(kv.rank, it))
        want = sum(_dense(*_rows(r, it)) for r in range(kv.num_workers))
        ids, rows = kv.pull_rows("emb", np.array([39, 0, 4, 4, 25, 1, 0], np.int64))
        np.testing.assert_array_equal(ids, [0, 1, 4, 25, 39])  # sorted, each once
        np.testing.assert_array_equal(rows, want[ids])
        full = np.full((ROWS, WIDTH), 7, np.float32)
        kv.pull("emb", out=full)
        np.testing.assert_array_equal(full, want)
        out = np.full((ROWS, WIDTH), 7, np.float32)
        kv.row_sparse_pull("emb", out=out, row_ids=np.array([4.0, 39.0], np.float32))
        expect = np.zeros_like(want)
        expect[[4, 39]] = want[[4, 39]]
        np.testing.assert_array_equal(out, expect)
        checks += 3
    # lazy SGD (wd and momentum) and Adam: only the pushed rows and their state move (MXNet's lazy_update);
    # lazy_update=False: every row decays.  Replayed here with the textbook formulas.
    for opt, kind in ((SGD(learning_rate=0.1, momentum=0.9, wd=0.1), "sgd"),
                      (Adam(learning_rate=0.01, wd=0.01), "adam"),
                      (SGD(learning_rate=0.1, wd=0.1, lazy_update=False), "sgd-dense")):
        kv.init(kind, _init())
        kv.set_optimizer(opt)
        w, m, v = _init().astype(np.float64), np.zeros((ROWS, WIDTH)), np.zeros((ROWS, WIDTH))
        for it in range(3):
            kv.push_rows(kind, *_rows(kv.rank, it))
            ids, rows = _merged(it, kv.num_workers)
            if kind == "sgd-dense":
                ids, rows = np.arange(ROWS), _dense(ids, rows)
            g = rows + (0.1 if kind != "adam" else 0.01) * w[ids]
            if kind == "adam":
                t = it + 1
                m[ids] = 0.9 * m[ids] + 0.1 * g
                v[ids] = 0.999 * v[ids] + 0.001 * g * g
                w[ids] -= 0.01 * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t) * m[ids] / (np.sqrt(v[ids]) + 1e-8)
            else:
                m[ids] = (0.9 if kind == "sgd" else 0.0) * m[ids] - 0.1 * g
                w[ids] += m[ids]
            got = np.empty((ROWS, WIDTH), np.float32)
            kv.pull(kind, out=got)
            if kind != "sgd-dense":
                untouched = np.setdiff1d(np.arange(ROWS),
                                         np.concatenate([_merged(i, kv.num_workers)[0] for i in range(it + 1)]))
                np.testing.assert_array_equal(got[untouched], _init()[untouched])
            np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-6, err_msg=f"{kind} step {it}")
            checks += 1
    # bad input: a clear error on the worker, nothing sent
    from hora.errors import ConfigError

    kv.init("flat", np.zeros(6, np.float32))
    for call, words in ((lambda: kv.push_rows("flat", [0], np.zeros((1, 1), np.float32)), "2 or more dimensions"),
                        (lambda: kv.pull_rows("emb", [ROWS]), f"[0, {ROWS})"),
                        (lambda: kv.push_rows("emb", [1, 2], np.zeros((2, WIDTH + 1), np.float32)), "need rows"),
                        (lambda: kv.push_rows("emb", [1], np.zeros((1, WIDTH), np.float64)), "need rows"),
                        (lambda: kv.row_sparse_pull("emb", np.zeros((ROWS, WIDTH + 1), np.float32), [1]), "shape")):
        try:
            call()
        except ConfigError as e:
            assert words in str(e), e
            checks += 1
        else:
            raise AssertionError(f"no error for a call that should fail with {words!r}")
    # what a worker's checks would stop, sent raw: each server refuses it with a reason, and nothing changes
    from hora.errors import PSError
    from hora.kvstore.ps.wire import Cmd

    shard = kv._info("emb").shards[0]
    n = shard.size
    forged = (({"n": n + WIDTH, "w": WIDTH}, [0], 1, "do not fit"),
              ({"n": n, "w": WIDTH}, [n // WIDTH], 1, "row ids must be int64"),
              ({"n": n, "w": WIDTH}, [0, 1], 1, "need 6"))
    before = np.empty((ROWS, WIDTH), np.float32)
    kv.pull("emb", out=before)
    for fields, ids, count, words in forged:
        rows = np.ones(count * WIDTH, np.float32)
        try:
            kv._client.call(shard.server, Cmd.ROW_PUSH, {"k": "emb", "seq": 1000, **fields},
                            (np.array(ids, np.int64), rows))
        except PSError as e:
            assert words in str(e), e
            checks += 1
        else:
            raise AssertionError(f"the server took a forged row push ({words})")
    after = np.empty_like(before)
    kv.pull("emb", out=after)
    np.testing.assert_array_equal(after, before)
    kv.barrier()
    kv.close()
    return checks


def _merged(it: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
    g = sum(_dense(*_rows(r, it)) for r in range(workers))
    ids = np.unique(np.concatenate([_rows(r, it)[0] for r in range(workers)]))
    return ids, g[ids]


def async_() -> int:
    kv = kvs.create("dist_async")
    kv.init("emb", _init())
    kv.set_optimizer(SGD(learning_rate=1.0))  # w -= g: the final value is exact whatever the order
    steps = 5
    for it in range(steps):
        kv.push_rows("emb", *_rows(kv.rank, it))
        ids, rows = kv.pull_rows("emb", np.array([4, 4, 0], np.int64))  # sees this worker's pushes
        np.testing.assert_array_equal(ids, [0, 4])
        assert rows[0].tolist() == _init()[0].tolist()  # nobody pushes row 0
    kv.barrier()
    want = _init() - sum(_dense(*_rows(r, it)) for r in range(kv.num_workers) for it in range(steps))
    got = np.empty_like(want)
    kv.pull("emb", out=got)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    ids, rows = kv.pull_rows("emb", np.arange(ROWS)[::-1])
    np.testing.assert_allclose(rows, want, rtol=1e-6)
    kv.barrier()
    kv.close()
    return steps + 2


if __name__ == "__main__":
    mode = sys.argv[1]
    n = sync() if mode == "sync" else async_()
    print(f"SPARSE OK {mode} {n}", flush=True)
