"""Data-parallel training on handwritten digits with MXNet's Module API and hora's DistributedOptimizer.

The Horovod recipe for Module scripts: ``hvd.init()``, an iterator over this
rank's shard, the optimizer wrapped in ``hvd.DistributedOptimizer`` (which
averages the gradients over the ranks in its update), ``kvstore=None``, and
rank 0's initial parameters broadcast with ``hvd.broadcast_parameters`` before
``fit``.  With ``--kv-store hora`` the optimizer stays plain and
``mx.kv.create('hora')`` sums the gradients instead (the learning rate then
sees the global batch through ``rescale_grad``).

    hora run -np 2 python examples/mxnet/train_module_digits.py --min-accuracy 0.95
"""

from __future__ import annotations

import argparse
import logging
import sys

import mxnet as mx
from common import digits, shard

import hora.mxnet as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--epochs", type=int, default=15, help="training epochs")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    p.add_argument("--lr", type=float, default=0.025, help="learning rate for one process (scaled by hvd.size())")
    p.add_argument("--seed", type=int, default=42, help="seed for the split, the init and the shuffle")
    p.add_argument("--kv-store", choices=["none", "hora"], default="none",
                   help="none: DistributedOptimizer averages the gradients; hora: mx.kv.create('hora') sums them")
    p.add_argument("--min-accuracy", type=float, default=0.0, help="exit with status 1 below this test accuracy")
    return p.parse_args(argv)


def symbol(num_classes: int) -> mx.sym.Symbol:
    """A 64-128-64-10 MLP with a softmax output."""
    net = mx.sym.Variable("data")
    net = mx.sym.Activation(mx.sym.FullyConnected(net, num_hidden=128, name="fc1"), act_type="relu")
    net = mx.sym.Activation(mx.sym.FullyConnected(net, num_hidden=64, name="fc2"), act_type="relu")
    net = mx.sym.FullyConnected(net, num_hidden=num_classes, name="fc3")
    return mx.sym.SoftmaxOutput(net, name="softmax")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x_tr, y_tr, x_te, y_te = digits(args.seed)
    idx = shard(len(y_tr), rank, size, args.seed, 0)
    train = mx.io.NDArrayIter(x_tr[idx], y_tr[idx], args.batch_size, shuffle=True, last_batch_handle="discard",
                              label_name="softmax_label")
    per = -(-len(y_te) // size)
    part = slice(rank * per, min((rank + 1) * per, len(y_te)))
    test = mx.io.NDArrayIter(x_te[part], y_te[part], args.batch_size, label_name="softmax_label")

    mx.random.seed(args.seed + rank)  # rank 0's initial parameters are broadcast below
    mod = mx.mod.Module(symbol(10), context=mx.cpu(hvd.local_rank()))
    mod.bind(data_shapes=train.provide_data, label_shapes=train.provide_label)
    mod.init_params(mx.init.Xavier())
    arg_params, aux_params = mod.get_params()
    hvd.broadcast_parameters(arg_params, root_rank=0)
    hvd.broadcast_parameters(aux_params, root_rank=0, prefix="aux.")
    mod.set_params(arg_params, aux_params)

    sgd = {"learning_rate": args.lr * size, "momentum": 0.9, "wd": 1e-4}
    if args.kv_store == "hora":
        optimizer, kvstore = mx.optimizer.SGD(rescale_grad=1.0 / (args.batch_size * size), **sgd), mx.kv.create("hora")
    else:
        optimizer = hvd.DistributedOptimizer(mx.optimizer.SGD(rescale_grad=1.0 / args.batch_size, **sgd))
        kvstore = None
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod.fit(train, eval_data=test, optimizer=optimizer, kvstore=kvstore, num_epoch=args.epochs,
            eval_metric="acc", batch_end_callback=None)

    correct = total = 0.0
    test.reset()
    for batch in test:  # the test shard is scored once, padding excluded, then the counts are summed
        mod.forward(batch, is_train=False)
        n = batch.data[0].shape[0] - batch.pad
        pred = mod.get_outputs()[0].asnumpy()[:n].argmax(axis=1)
        correct += float((pred == batch.label[0].asnumpy()[:n]).sum())
        total += n
    correct, total = hvd.allreduce(mx.nd.array([correct, total], dtype="float64"), op=hvd.Sum,
                                   name="test.accuracy").asnumpy()
    acc = correct / total
    if rank == 0:
        print(f"final test accuracy {acc:.4f} on {size} process(es) (kvstore={args.kv_store})", flush=True)
    hvd.shutdown()
    if acc < args.min_accuracy:
        print(f"test accuracy {acc:.4f} is below --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
