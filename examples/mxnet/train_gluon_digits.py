"""Data-parallel Gluon training on handwritten digits with hora's Horovod API for MXNet.

The script is a single-process Gluon script with the changes the Horovod +
MXNet blog lists: ``hvd.init()``, a context per local rank, the learning rate
scaled by ``hvd.size()``, ``hvd.broadcast_parameters`` of the (deferred)
parameters, and ``hvd.DistributedTrainer`` in place of ``gluon.Trainer``;
each rank trains on its own shard.  Replace ``import hora.mxnet as hvd`` by
``import horovod.mxnet as hvd`` and it runs on Horovod unchanged.

    hora run -np 2 python examples/mxnet/train_gluon_digits.py --min-accuracy 0.95
"""

from __future__ import annotations

import argparse
import sys
import time

import mxnet as mx
import numpy as np
from common import digits, shard
from mxnet import autograd, gluon

import hora.mxnet as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--epochs", type=int, default=15, help="training epochs")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    p.add_argument("--lr", type=float, default=0.025, help="learning rate for one process (scaled by hvd.size())")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--seed", type=int, default=42, help="seed for the split, the init and the shuffles")
    p.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    p.add_argument("--min-accuracy", type=float, default=0.0, help="exit with status 1 below this test accuracy")
    return p.parse_args(argv)


def build(num_classes: int) -> gluon.nn.HybridSequential:
    """An MLP whose input size Gluon infers at the first batch (deferred initialisation)."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dropout(0.2), gluon.nn.Dense(64, activation="relu"),
            gluon.nn.Dense(num_classes))
    return net


def accuracy(net: gluon.Block, x: np.ndarray, y: np.ndarray, rank: int, size: int, ctx: mx.Context) -> float:
    """Test accuracy over all ranks: each scores a contiguous slice, the counts are summed."""
    per = -(-len(y) // size)
    part = slice(rank * per, min((rank + 1) * per, len(y)))
    pred = net(mx.nd.array(x[part], ctx=ctx)).argmax(axis=1).asnumpy()
    counts = mx.nd.array([float((pred == y[part]).sum()), float(len(pred))], dtype="float64")
    correct, total = hvd.allreduce(counts, op=hvd.Sum, name="test.accuracy").asnumpy()
    return correct / total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ctx = mx.cpu(hvd.local_rank())
    x_tr, y_tr, x_te, y_te = digits(args.seed)

    mx.random.seed(args.seed + rank)  # different on every rank: broadcast_parameters makes them agree
    net = build(num_classes=10)
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize()
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)  # deferred: runs right after the first forward pass
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": args.lr * size, "momentum": args.momentum,
                                                     "wd": 1e-4}, compression=compression)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    start = time.perf_counter()
    seen = 0
    for epoch in range(args.epochs):
        idx = shard(len(y_tr), rank, size, args.seed, epoch)
        total = 0.0
        for lo in range(0, len(idx), args.batch_size):
            batch = idx[lo:lo + args.batch_size]
            data, label = mx.nd.array(x_tr[batch], ctx=ctx), mx.nd.array(y_tr[batch], ctx=ctx)
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(len(batch))
            total += float(loss.sum().asscalar())
            seen += len(batch)
        acc = accuracy(net, x_te, y_te, rank, size, ctx)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {total / len(idx):.4f}, test accuracy {acc:.4f}",
                  flush=True)
    rate = seen * size / (time.perf_counter() - start)
    if rank == 0:
        print(f"final test accuracy {acc:.4f} on {size} process(es), {rate:,.0f} samples/s", flush=True)
    hvd.shutdown()
    if acc < args.min_accuracy:
        print(f"test accuracy {acc:.4f} is below --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
