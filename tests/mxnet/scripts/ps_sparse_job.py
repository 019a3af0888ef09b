"""row_sparse keys on hora's parameter-server stores, from MXNet: ``hora run -np 2 -s 2 python ps_sparse_job.py``.

``--kv-store hora_dist_sync``: init of a row_sparse value, ``row_sparse_pull``
with repeated and unsorted ids and rows never pushed, ``pull`` skipping
row_sparse outs and refusing ``ignore_sparse=False`` (as MXNet's dist stores),
merged row pushes (one worker pushing no rows) under MXNet's ``test``
optimizer, and lazy SGD, Adam, AdaGrad and Ftrl equal bit for bit to MXNet's own updater on the
merged row_sparse gradient.  ``--gluon``: a ``SparseEmbedding``
(row_sparse weight) through ``kvstore='hora_dist_sync'``, then an
``nn.Embedding(sparse_grad=True)`` (dense weight, row_sparse gradient) through
that store instance, each train to the weights of one process training on
both workers' batches (see docs/sparse.md).
``--kv-store hora_dist_async``: every worker's row pushes are applied once.
Each worker prints ``ps sparse ok``.
"""

from __future__ import annotations

import argparse

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hora.mxnet  # noqa: F401  (registers hora's stores with MXNet)

SHAPE = (40, 3)


def rsp(ids, rows) -> mx.nd.NDArray:
    return mx.nd.sparse.row_sparse_array((np.asarray(rows, np.float32), np.asarray(ids, np.int64)), shape=SHAPE)


def grad_of(rank: int, it: int) -> mx.nd.NDArray:
    if rank == 1 and it % 2:
        return mx.nd.sparse.zeros("row_sparse", SHAPE)  # no rows: still this worker's push of the round
    ids = [1, 4, 30, 39] if rank == 0 else [4, 9 + it, 25]
    return rsp(ids, (np.arange(len(ids) * 3).reshape(-1, 3) + rank + it) / 4)


def merged(it: int, workers: int) -> mx.nd.NDArray:
    total = grad_of(0, it)
    for r in range(1, workers):
        total = mx.nd.sparse.add(total, grad_of(r, it)) if hasattr(mx.nd.sparse, "add") else total + grad_of(r, it)
    return total.tostype("row_sparse")


def initial() -> np.ndarray:
    return np.arange(40 * 3, dtype=np.float32).reshape(SHAPE) / 8


def check_store(kv) -> None:
    rank, workers = kv.rank, kv.num_workers
    init_rows = [0, 2, 4, 30]
    kv.init("emb", rsp(init_rows, initial()[init_rows]))
    want = np.zeros(SHAPE, np.float32)
    want[init_rows] = initial()[init_rows]  # rows the init value lacks are zero
    out = mx.nd.sparse.zeros("row_sparse", SHAPE)
    kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array([30, 2, 2, 7]))
    assert out.indices.asnumpy().tolist() == [2, 7, 30], out.indices
    np.testing.assert_array_equal(out.data.asnumpy(), want[[2, 7, 30]])
    kept = mx.nd.sparse.zeros("row_sparse", SHAPE)
    kv.pull("emb", out=kept)  # ignore_sparse=True (MXNet's default): row_sparse outs are left alone
    assert kept.indices.size == 0
    try:  # as MXNet's dist stores: a full pull of row_sparse values is refused
        kv.pull("emb", out=kept, ignore_sparse=False)
    except mx.base.MXNetError as e:
        assert "ignore_sparse=False" in str(e), e
    else:
        raise AssertionError("pull(ignore_sparse=False) was accepted")
    assert isinstance(kv, mx.kv.KVStore)  # a real subclass, for gluon's checks (docs/sparse.md)
    try:  # as MXNet ("Mixed key types are not allowed"): an int key in a store of str keys, an MXNetError
        kv.init(999, mx.nd.ones((2, 2)).tostype("row_sparse"))
    except mx.base.MXNetError as e:
        assert "do not mix int and str keys" in str(e), e
    else:
        raise AssertionError("an int key was accepted among str keys")

    kv.set_optimizer(mx.optimizer.create("test", rescale_grad=0.5))  # w += 0.5 * g
    value = want.copy()
    for it in range(3):
        kv.push("emb", [grad_of(rank, it)])
        value += 0.5 * merged(it, workers).asnumpy()
        outs = [mx.nd.sparse.zeros("row_sparse", SHAPE) for _ in range(2)]
        kv.row_sparse_pull("emb", out=outs, row_ids=mx.nd.array([4, 0, 4, 12], dtype="int64"))
        for o in outs:
            np.testing.assert_allclose(o.asnumpy()[[0, 4, 12]], value[[0, 4, 12]], rtol=1e-6)
        dense = mx.nd.zeros(SHAPE)
        kv.pull("emb", out=dense)
        np.testing.assert_allclose(dense.asnumpy(), value, rtol=1e-6)

    for key, name, params in (("lazy_sgd", "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.1}),
                              ("lazy_sgd_plain", "sgd", {"learning_rate": 0.1, "wd": 0.1, "rescale_grad": 0.5}),
                              ("lazy_adam", "adam", {"learning_rate": 0.01, "wd": 0.01}),
                              ("lazy_adagrad", "adagrad", {"learning_rate": 0.1}),
                              ("lazy_ftrl", "ftrl", {"learning_rate": 0.1, "lamda1": 0.001, "wd": 0.01})):
        kv.init(key, mx.nd.array(initial()))
        kv.set_optimizer(mx.optimizer.create(name, **params))  # lazy_update=True is MXNet's default
        updater = mx.optimizer.get_updater(mx.optimizer.create(name, **params))
        local = mx.nd.array(initial()).tostype("row_sparse")  # as MXNet's server holds a row_sparse key
        for it in range(3):
            kv.push(key, grad_of(rank, it))
            updater(0, merged(it, workers), local)  # MXNet's own lazy (or sparse) kernel
            got = mx.nd.zeros(SHAPE)
            kv.pull(key, out=got)
            np.testing.assert_array_equal(got.asnumpy(), local.asnumpy(), err_msg=f"{name} step {it}")
        untouched = [0, 2, 3]
        np.testing.assert_array_equal(got.asnumpy()[untouched], initial()[untouched])


def check_gluon(workers: int, rank: int) -> None:
    rng = np.random.RandomState(3)
    xs = rng.randint(0, 50, size=(4, workers * 6)).astype(np.float32)

    def train(sparse_weight: bool, kvstore, rows) -> tuple[np.ndarray, object]:
        mx.random.seed(7)
        if sparse_weight:  # row_sparse weight and gradient
            net = gluon.contrib.nn.SparseEmbedding(50, 4)
        else:  # dense weight, row_sparse gradient
            net = gluon.nn.Embedding(50, 4, sparse_grad=True)
        net.initialize(mx.init.Uniform(0.5))

        def weight() -> np.ndarray:
            return (net.weight.row_sparse_data(mx.nd.arange(50)) if sparse_weight else net.weight.data()).asnumpy()

        # a sparse weight makes the Trainer send the optimizer at the first pull, before any step: so the
        # batch scaling goes in rescale_grad, and step(1)
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5, "rescale_grad": 1 / xs.shape[1]},
                                kvstore=kvstore)
        start = weight()
        for x in xs:
            batch = mx.nd.array(x[rows])
            with autograd.record():
                loss = (net(batch) ** 2).sum()
            loss.backward()
            trainer.step(1)
        end = weight()
        assert np.abs(end - start).max() > 0.01, "the embedding did not train"
        return end, trainer._kvstore

    mine = slice(rank * 6, (rank + 1) * 6)
    # the store's name, as gluon's _create_sparse_kvstore takes; then the same store as an instance (a worker
    # joins the job once), which gluon takes because the store is an mx.kv.KVStore
    got, store = train(True, "hora_dist_sync", mine)
    assert isinstance(store, mx.kv.KVStore)
    np.testing.assert_allclose(got, train(True, "local", slice(None))[0], rtol=1e-5, atol=1e-6)
    got, _ = train(False, store, mine)
    np.testing.assert_allclose(got, train(False, "local", slice(None))[0], rtol=1e-5, atol=1e-6)


def check_async(kv) -> None:
    kv.init("emb", mx.nd.array(initial()))
    kv.set_optimizer(mx.optimizer.create("test", rescale_grad=1.0))
    for it in range(4):
        kv.push("emb", grad_of(kv.rank, it))
    kv.barrier()
    want = initial() + sum(grad_of(r, it).asnumpy() for r in range(kv.num_workers) for it in range(4))
    out = mx.nd.sparse.zeros("row_sparse", SHAPE)
    kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.arange(40))
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kv-store", default="hora_dist_sync")
    p.add_argument("--gluon", action="store_true", help="the gluon checks (gluon creates the store itself)")
    args = p.parse_args()
    if args.gluon:  # a worker joins the job once, and gluon makes its own store from the name
        import os

        check_gluon(int(os.environ["HORA_SIZE"]), int(os.environ["HORA_RANK"]))
    else:
        kv = mx.kv.create(args.kv_store)
        (check_store if args.kv_store == "hora_dist_sync" else check_async)(kv)
        kv.barrier()
    print(f"ps sparse ok ({args.kv_store}{', gluon' if args.gluon else ''})", flush=True)


if __name__ == "__main__":
    main()
