"""Stateful compression through hora.mxnet's DistributedTrainer; run on 2 and 3 ranks by tests/mxnet.

* PowerSGD leaves every rank with identical weights, different from plain training;
* PowerSGD at full rank equals the plain allreduce;
* ``save_states`` mid-training, loaded into a fresh trainer, continues identically;
* ``DistributedOptimizer(compression=...)`` (under a plain ``gluon.Trainer``) takes a stateful
  compressor too: identical weights on every rank, full rank equal to plain, its state in ``state_dict()``.

Each rank prints ``mxnet compression ok``.
"""

from __future__ import annotations

import os
import tempfile

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hora.mxnet as hvd

STEPS = 6


def model() -> gluon.nn.Sequential:
    mx.random.seed(3)
    # Fixed prefixes: every instance has the same parameter names, as a fresh process would.
    net = gluon.nn.Sequential(prefix="net_")
    with net.name_scope():
        net.add(gluon.nn.Dense(24, activation="tanh", prefix="a_"), gluon.nn.Dense(16, activation="tanh", prefix="b_"),
                gluon.nn.Dense(3, prefix="c_"))
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 10)))
    return net


def weights(net: gluon.Block) -> list[np.ndarray]:
    return [p.data().asnumpy() for p in net.collect_params().values()]  # in definition order, as the trainer


def train(net, trainer, steps: range) -> None:
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for s in steps:
        rng = np.random.RandomState(100 * s + hvd.rank())
        x, y = mx.nd.array(rng.randn(8, 10)), mx.nd.array(rng.randint(0, 3, 8))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(8)


def run(compression) -> tuple[gluon.Block, hvd.DistributedTrainer]:
    net = model()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                                     compression=compression)
    train(net, trainer, range(STEPS))
    return net, trainer


def same_on_every_rank(ws: list[np.ndarray], tag: str) -> None:
    for i, w in enumerate(ws):
        gathered = hvd.allgather(mx.nd.array(w[None]), name=f"{tag}.{i}").asnumpy()
        for r in range(1, gathered.shape[0]):
            np.testing.assert_array_equal(gathered[r], gathered[0], err_msg=f"{tag}: weight {i} differs on rank {r}")


def run_optimizer(compression) -> tuple[gluon.Block, hvd.DistributedOptimizer]:
    net = model()
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9), compression=compression)
    train(net, gluon.Trainer(net.collect_params(), opt, kvstore=None), range(STEPS))
    return net, opt


def check_distributed_optimizer(plain_trainer: list[np.ndarray]) -> None:
    plain = weights(run_optimizer(hvd.Compression.none)[0])
    for a, b in zip(plain, plain_trainer, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    net, opt = run_optimizer(hvd.Compression.powersgd(rank=1, min_compression_rate=0))
    compressed = weights(net)
    same_on_every_rank(compressed, "opt")
    assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(compressed, plain, strict=True))
    state = opt.state_dict()["compression"]
    assert state and all(s["step"] == STEPS for s in state.values()), state
    full = weights(run_optimizer(hvd.Compression.powersgd(rank=64, min_compression_rate=0))[0])
    for a, b in zip(full, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    fp16 = weights(run_optimizer(hvd.Compression.fp16)[0])
    for a, b in zip(fp16, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3)


def main() -> None:
    hvd.init()
    compressed = weights(run(hvd.Compression.powersgd(rank=1, min_compression_rate=0))[0])
    for i, w in enumerate(compressed):
        gathered = hvd.allgather(mx.nd.array(w[None]), name=f"check.{i}").asnumpy()
        for r in range(1, gathered.shape[0]):
            np.testing.assert_array_equal(gathered[r], gathered[0], err_msg=f"weight {i} differs on rank {r}")
    plain = weights(run(hvd.Compression.none)[0])
    check_distributed_optimizer(plain)
    assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(compressed, plain, strict=True))

    full = weights(run(hvd.Compression.powersgd(rank=64, min_compression_rate=0))[0])
    for a, b in zip(full, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    net = model()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                                     compression=hvd.Compression.powersgd(rank=2, min_compression_rate=0))
    train(net, trainer, range(3))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"trainer.{hvd.rank()}")
        trainer.save_states(path)
        saved = weights(net)
        train(net, trainer, range(3, STEPS))
        fresh = model()
        for p, w in zip(fresh.collect_params().values(), saved, strict=True):
            p.set_data(mx.nd.array(w))
        resumed = hvd.DistributedTrainer(fresh.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                                         compression=hvd.Compression.powersgd(rank=2, min_compression_rate=0))
        resumed.load_states(path)
        train(fresh, resumed, range(3, STEPS))
    for a, b in zip(weights(net), weights(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    print("mxnet compression ok", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
