"""Gluon training through hora.mxnet, checked against plain one-process MXNet; run on 2 and 3 ranks by tests/mxnet.

* deferred initialisation: ``broadcast_parameters`` before the first forward
  pass gives every rank the root's values once the shapes are known;
* the equivalence test: ``size`` ranks × batch B with ``DistributedTrainer``
  end with the weights of one process training on the size·B rows with a
  plain ``gluon.Trainer`` (computed on every rank as the reference), also with
  ``num_groups`` and ``gradient_predivide_factor``, and close with fp16
  compression;
* ``gluon.Trainer(kvstore=mx.kv.create('hora'))`` matches the same reference,
  and its first step gives every rank rank 0's initial weights;
* ``DistributedOptimizer`` in a custom loop (list updates) matches it too.

Each rank prints ``mxnet training ok``.
"""

from __future__ import annotations

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hora.mxnet as hvd

B = 8
STEPS = 6
OPT = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}


def data(size: int) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
    rng = np.random.RandomState(42)
    x = rng.randn(STEPS, size * B, 10).astype(np.float32)
    y = rng.randint(0, 3, size=(STEPS, size * B)).astype(np.float32)
    return mx.nd.array(x), mx.nd.array(y)


def model(seed: int) -> gluon.nn.Sequential:
    mx.random.seed(seed)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(3))
    net.initialize(mx.init.Xavier())
    return net


def weights(net: gluon.Block) -> list[np.ndarray]:
    return [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]


def train(net: gluon.Block, trainer: gluon.Trainer, xs: mx.nd.NDArray, ys: mx.nd.NDArray, rows: slice,
          batch: int) -> None:
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(STEPS):
        with autograd.record():
            loss = loss_fn(net(xs[step][rows]), ys[step][rows])
        loss.backward()
        trainer.step(batch)


def reference(size: int) -> list[np.ndarray]:
    """One process, size·B rows a step, plain gluon.Trainer."""
    xs, ys = data(size)
    net = model(seed=7)
    net(xs[0][:1])
    train(net, gluon.Trainer(net.collect_params(), "sgd", dict(OPT), kvstore=None), xs, ys, slice(None), size * B)
    return weights(net)


def same_everywhere(arrays: list[np.ndarray], what: str) -> None:
    for i, a in enumerate(arrays):
        gathered = hvd.allgather(mx.nd.array(a[None], dtype=a.dtype), name=f"check.{what}.{i}").asnumpy()
        for r in range(1, gathered.shape[0]):
            np.testing.assert_array_equal(gathered[r], gathered[0], err_msg=f"{what}: ranks differ")


def close(got: list[np.ndarray], want: list[np.ndarray], what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=what)


def check_deferred_broadcast(rank: int) -> None:
    net = model(seed=100 + rank)  # different values on every rank; shapes unknown until the first forward
    deferred = [name for name, p in net.collect_params().items() if p._deferred_init]
    assert deferred and len(deferred) < len(list(net.collect_params().keys())), deferred  # weights wait, biases do not
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="deferred.")
    net(mx.nd.ones((2, 10)))
    same_everywhere(weights(net), "deferred init")
    root = model(seed=100)
    root(mx.nd.ones((2, 10)))
    close(weights(net), weights(root), "deferred init did not give rank 0's values", rtol=0, atol=0)


def distributed_trainer(rank: int, size: int, want: list[np.ndarray], **kwargs) -> list[np.ndarray]:
    xs, ys = data(size)
    net = model(seed=7 + 1000 * rank)
    net(xs[0][:1])
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix=kwargs.get("prefix", ""))
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(OPT), **kwargs)
    train(net, trainer, xs, ys, slice(rank * B, (rank + 1) * B), B)
    return weights(net)


def check_hora_store_surface(kv) -> None:
    """What MXNet's ``horovod`` store offers, and a clear error where the allreduce store has nothing to do."""
    from hora.errors import ConfigError

    assert kv.local_rank == hvd.local_rank()
    for call, args in ((kv.set_optimizer, (mx.optimizer.SGD(),)), (kv.save_optimizer_states, ("x.states",)),
                       (kv.load_optimizer_states, ("x.states",)),
                       (kv.set_gradient_compression, ({"type": "2bit", "threshold": 0.5},))):
        try:
            call(*args)
        except ConfigError as e:
            assert "hora_dist_sync" in str(e), e
        else:
            raise AssertionError(f"{call.__name__} was accepted by the 'hora' store")
    try:
        kv.is_capable("telepathy")
    except ValueError as e:
        assert "telepathy" in str(e), e
    else:
        raise AssertionError("an unknown capability was answered")
    value = mx.nd.ones((2, 3)) * (kv.rank + 1)
    out = mx.nd.zeros((2, 3))
    kv.broadcast("surface.b", value, out=out)
    assert (out.asnumpy() == 1).all()
    kv.pushpull("surface.p", value)
    assert (value.asnumpy() == kv.num_workers * (kv.num_workers + 1) / 2).all()


def check_hora_kvstore(rank: int, size: int, want: list[np.ndarray]) -> None:
    xs, ys = data(size)
    net = model(seed=7)
    net(xs[0][:1])
    kv = mx.kv.create("hora")
    assert kv.type == "hora" and kv.rank == rank and kv.num_workers == size and not kv.is_capable("optimizer")
    check_hora_store_surface(kv)
    trainer = gluon.Trainer(net.collect_params(), "sgd", dict(OPT), kvstore=kv)
    train(net, trainer, xs, ys, slice(rank * B, (rank + 1) * B), B * size)  # the store sums: pass the global batch
    close(weights(net), want, "gluon.Trainer(kvstore='hora') differs from one process")
    # different initial weights: the store's broadcast at the first step gives every rank rank 0's
    net = model(seed=500 + rank)
    net(xs[0][:1])
    trainer = gluon.Trainer(net.collect_params(), "sgd", dict(OPT), kvstore=mx.kv.create("hora"))
    train(net, trainer, xs, ys, slice(rank * B, (rank + 1) * B), B * size)
    same_everywhere(weights(net), "kvstore='hora' after training from different initial weights")


def check_distributed_optimizer(rank: int, size: int, want: list[np.ndarray]) -> None:
    xs, ys = data(size)
    net = model(seed=7)
    net(xs[0][:1])
    params = [p for _, p in sorted(net.collect_params().items())]
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(rescale_grad=1.0 / B, **OPT))
    updater = mx.optimizer.get_updater(opt)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(STEPS):
        with autograd.record():
            loss = loss_fn(net(xs[step][rank * B:(rank + 1) * B]), ys[step][rank * B:(rank + 1) * B])
        loss.backward()
        updater(list(range(len(params))), [p.grad() for p in params], [p.data() for p in params])
    close(weights(net), want, "DistributedOptimizer in a custom loop differs from one process")


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    check_deferred_broadcast(rank)
    want = reference(size)
    close(distributed_trainer(rank, size, want), want, "DistributedTrainer differs from one process")
    close(distributed_trainer(rank, size, want, prefix="groups.", num_groups=2, gradient_predivide_factor=2.0),
          want, "DistributedTrainer(num_groups=2, gradient_predivide_factor=2) differs from one process")
    close(distributed_trainer(rank, size, want, prefix="fp16.", compression=hvd.Compression.fp16), want,
          "DistributedTrainer with fp16 compression is far from one process", rtol=2e-2, atol=2e-3)
    check_hora_kvstore(rank, size, want)
    check_distributed_optimizer(rank, size, want)
    hvd.shutdown()
    print("mxnet training ok")


if __name__ == "__main__":
    main()
