"""gluon.Trainer on hora's parameter servers through MXNet's own KVStore registry.

Run as ``hora run -np 2 -s 2 python ps_train_job.py --kv-store hora_dist_sync``
(or ``hora_dist_async``).  No engine is started: the workers talk to the
servers only.  With ``hora_dist_sync`` the servers run the optimizer that the
Trainer sends them (``--optimizer``: SGD, Adam, LAMB, RMSProp, AdaGrad)
on the sum of both workers' gradients, so the weights must match one process
training on both workers' rows with a plain Trainer (computed here as the
reference; the gradients are summed in another order there, hence a tolerance).
Not Nadam: MXNet keeps its momentum schedule once per optimizer, so once per
server, and its servers (like hora's) split the parameters between them.  With ``hora_dist_async`` every push is
applied on arrival: the loss must fall.  Each worker prints ``ps training ok``.
"""

from __future__ import annotations

import argparse

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hora.mxnet  # noqa: F401  (registers hora's stores with MXNet)

B = 8
STEPS = 6
OPTIMIZERS = {  # gluon.Trainer's optimizer and its arguments, which the Trainer sends to the servers
    "sgd": {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3},
    "adam": {"learning_rate": 0.01, "wd": 1e-3},
    "lamb": {"learning_rate": 0.01, "wd": 1e-3},
    "rmsprop": {"learning_rate": 0.01, "centered": True},
    "adagrad": {"learning_rate": 0.05},
}


def data(workers: int) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
    rng = np.random.RandomState(42)
    return (mx.nd.array(rng.randn(STEPS, workers * B, 10).astype(np.float32)),
            mx.nd.array(rng.randint(0, 3, size=(STEPS, workers * B)).astype(np.float32)))


def model(seed: int) -> gluon.nn.Sequential:
    mx.random.seed(seed)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(16, activation="relu", in_units=10), gluon.nn.Dense(3, in_units=16))
    net.initialize(mx.init.Xavier())
    return net


def run(net, trainer, xs, ys, rows, batch) -> list[float]:
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for step in range(STEPS):
        with autograd.record():
            loss = loss_fn(net(xs[step][rows]), ys[step][rows])
        loss.backward()
        trainer.step(batch)
        losses.append(float(loss.mean().asscalar()))
    return losses


def weights(net) -> list[np.ndarray]:
    return [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]


def engine_errors_reach_the_next_call(kv) -> None:
    """A pushpull on MXNet's engine returns at once; what fails there (here the servers' SGD on an int key)
    is raised by the store's next call (by the pushpull itself under NaiveEngine, where it blocks)."""
    from hora.errors import ConfigError, PSError

    kv.init(1000, mx.nd.ones((4,), dtype="int32"))
    out = mx.nd.zeros((4,), dtype="int32")
    try:
        kv.pushpull(1000, mx.nd.ones((4,), dtype="int32"), out=out)
        mx.nd.waitall()
        kv.barrier()
    except PSError as e:
        assert "floating-point" in str(e), e
    else:
        raise AssertionError("the failed pushpull was not reported")
    try:  # checked at the call, before anything reaches the engine
        kv.pushpull(1000, mx.nd.ones((5,), dtype="int32"), out=out)
    except ConfigError as e:
        assert "int32[4]" in str(e), e
    else:
        raise AssertionError("a pushpull of the wrong shape was accepted")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-store", required=True)
    parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
    args = parser.parse_args()
    opt = OPTIMIZERS[args.optimizer]
    kv = mx.kv.create(args.kv_store)
    assert kv.type == args.kv_store and kv.is_capable("optimizer")
    rank, workers = kv.rank, kv.num_workers
    xs, ys = data(workers)
    # The same start everywhere: the store's first broadcast comes after the first backward pass.
    net = model(seed=7)
    trainer = gluon.Trainer(net.collect_params(), args.optimizer, dict(opt), kvstore=kv)
    rows = slice(rank * B, (rank + 1) * B)
    if args.kv_store == "hora_dist_sync":
        run(net, trainer, xs, ys, rows, B * workers)
        ref = model(seed=7)
        run(ref, gluon.Trainer(ref.collect_params(), args.optimizer, dict(opt), kvstore=None), xs, ys, slice(None),
            B * workers)
        for got, want in zip(weights(net), weights(ref), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg="hora_dist_sync != one process")
        if args.optimizer == "sgd":
            engine_errors_reach_the_next_call(kv)
    else:
        # the same batch over and over: whatever the order of the pushes, the loss on it must fall
        fixed_x = mx.nd.stack(*[xs[0]] * STEPS)
        fixed_y = mx.nd.stack(*[ys[0]] * STEPS)
        losses = run(net, trainer, fixed_x, fixed_y, rows, B * workers)
        assert losses[-1] < losses[0], losses
    kv.barrier()
    print(f"ps training ok ({args.kv_store}, {args.optimizer})")


if __name__ == "__main__":
    main()
