"""Data-parallel training on handwritten digits through a parameter-server KVStore.

The same model and data as ``examples/torch/train_digits.py``, but gradients
go to parameter servers instead of an allreduce, the way MXNet users train:

    hora run -np 2 -s 2 python examples/kvstore/train_digits_ps.py --kv-store dist_sync
    hora run -np 2 -s 1 python examples/kvstore/train_digits_ps.py --kv-store dist_async
    hora run -np 2 python examples/kvstore/train_digits_ps.py --kv-store dist_sync_allreduce

With ``--update-on-server`` (always for ``dist_async``) the servers run the
SGD update and hold the weights; otherwise they sum the gradients and each
worker runs SGD on the average.  ``--kv-store local`` trains in one process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hora.kvstore as kvs
import hora.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch"))
from train_digits import SmallCNN, load_arrays, save_checkpoint, shard_indices, split, to_images  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; defaults reach >= 0.95 test accuracy."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kv-store", default="dist_sync", choices=kvs.TYPES, help="KVStore type")
    p.add_argument("--update-on-server", action="store_true", help="run SGD on the servers (dist_sync)")
    p.add_argument("--gc-threshold", type=float, default=0.0, help="2-bit gradient compression threshold (0: off)")
    p.add_argument("--data", type=Path, default=None, help=".npz with X and y; default: scikit-learn's digits")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate for one worker (scaled by workers)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-interval", type=int, default=10, help="batches between speed/accuracy lines")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints-ps"))
    p.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 when the test accuracy is below this")
    return p.parse_args(argv)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` that ``model`` labels correctly (every worker scores the whole set)."""
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


def main(argv: list[str] | None = None) -> int:
    """Train, evaluate, checkpoint on worker 0; return the exit status."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    kv = kvs.create(args.kv_store)
    rank, workers = kv.rank, kv.num_workers
    say = print if rank == 0 else (lambda *a, **k: None)

    x, y = load_arrays(args.data)
    train, test = split(to_images(x), y, 0.2, args.seed)
    say(f"KVStore {kv.type}: {workers} worker(s); training on {len(train)} samples, testing on {len(test)}",
        flush=True)

    torch.manual_seed(args.seed + rank)  # different on purpose: init() makes worker 0's weights everyone's
    model = SmallCNN(train.x.shape[1], train.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * workers, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    if args.gc_threshold > 0:
        kv.set_gradient_compression({"type": "2bit", "threshold": args.gc_threshold})
    server = "auto" if args.update_on_server else None
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), kvstore=kv,
                                   server_optimizer=server)

    for epoch in range(args.epochs):
        model.train()
        idx = shard_indices(len(train), rank, workers, args.seed, epoch)
        tic = win_start = time.perf_counter()
        hits = seen = 0
        for i in range(0, len(idx), args.batch_size):
            b = idx[i : i + args.batch_size]
            opt.zero_grad()
            out = model(train.x[b])
            F.cross_entropy(out, train.y[b]).backward()
            opt.step()
            hits += int((out.argmax(1) == train.y[b]).sum())
            seen += len(b)
            batch = i // args.batch_size + 1
            if batch % args.log_interval == 0:
                speed = seen * workers / (time.perf_counter() - win_start)
                say(f"Epoch[{epoch}] Batch [{batch - args.log_interval}-{batch}]\tSpeed: {speed:.2f} samples/sec"
                    f"\taccuracy={hits / seen:f}", flush=True)
                hits = seen = 0
                win_start = time.perf_counter()
        val = accuracy(model, test.x, test.y)
        say(f"Epoch[{epoch}] Validation-accuracy={val:f}\tTime cost={time.perf_counter() - tic:.3f}", flush=True)
        if rank == 0:
            save_checkpoint(args.checkpoint_dir, epoch, model, opt)

    kv.barrier()  # async workers finish at different times: score the final weights everywhere
    if args.kv_store == "dist_async" or args.update_on_server:
        opt.pull_parameters()
    test_acc = accuracy(model, test.x, test.y)
    say(f"Test accuracy: {test_acc:.4f}", flush=True)
    kv.close()
    if test_acc < args.min_accuracy:
        print(f"error: worker {rank}: test accuracy {test_acc:.4f} is below --min-accuracy {args.min_accuracy}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
