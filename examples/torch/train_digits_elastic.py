"""Elastic training of the digits CNN: workers may join and leave while it trains, and training goes on.

Written as a Horovod elastic script (``import horovod.torch as hvd`` runs it
unchanged): the model, optimizer and an :class:`ElasticSampler` live in a
``hvd.elastic.TorchState``, committed every ``--batches-per-commit`` batches;
``@hvd.elastic.run`` restores the last commit when a peer dies and re-forms the
ring when hosts come or go.  After every reset the learning rate is rescaled to
the new size, and the sampler deals out only the samples this epoch has not
yet seen.

Run with a fixed host set that tolerates failures (kill a worker to see it)::

    hora run -np 4 --min-np 2 --max-np 4 -H localhost:2,127.0.0.1:2 \
        python examples/torch/train_digits_elastic.py

or with a host discovery script whose output changes while it trains::

    hora run -np 2 --min-np 2 --host-discovery-script ./discover.sh \
        python examples/torch/train_digits_elastic.py --epochs 20
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import SmallCNN, evaluate, load_arrays, log, split, to_images  # noqa: E402

import hora.torch as hvd  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=10, help="number of training epochs")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate for one process (scaled by hvd.size())")
    p.add_argument("--batches-per-commit", type=int, default=10, help="batches between state.commit() calls")
    p.add_argument("--seed", type=int, default=42, help="seed for the split, the init and the shuffles")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with status 1 when the final test accuracy is below this")
    args = p.parse_args(argv)
    if min(args.epochs, args.batch_size, args.batches_per_commit) < 1:
        p.error("--epochs, --batch-size and --batches-per-commit must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    torch.manual_seed(args.seed)
    x, y = load_arrays(None)
    train_data, test_data = split(to_images(x), y, 0.2, args.seed)
    dataset = TensorDataset(train_data.x, train_data.y)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = SmallCNN(train_data.x.shape[1], train_data.num_classes)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
                                         named_parameters=model.named_parameters())

    def on_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        log(f"ring re-formed: {hvd.size()} workers")

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            model.train()
            for batch_idx, (data, target) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(data), target)
                loss.backward()
                optimizer.step()
                sampler.record_batch(batch_idx, args.batch_size)
                state.batch += 1
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
            accuracy = evaluate(model, test_data, torch.device("cpu"), 256, f"test.{state.epoch}")
            log(f"epoch {state.epoch}: {hvd.size()} workers, loss {loss.item():.4f}, test accuracy {accuracy:.4f}")
            state.epoch += 1
            state.batch = 0
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    accuracy = evaluate(model, test_data, torch.device("cpu"), 256, "test.final")
    log(f"final test accuracy {accuracy:.4f} on {hvd.size()} workers")
    hvd.shutdown()
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
