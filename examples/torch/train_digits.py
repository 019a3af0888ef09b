"""Data-parallel training of a small CNN on handwritten digits with hora's Horovod API.

The script is written the way a Horovod user writes one: only ``hvd.init``,
``hvd.rank/size/local_rank``, ``hvd.DistributedOptimizer``, the two broadcasts
and ``hvd.allreduce`` for metrics.  Replace ``import hora.torch as hvd`` by
``import horovod.torch as hvd`` and it runs on Horovod unchanged.

Data: scikit-learn's bundled 8x8 digits (1797 images, no download), or your
own arrays with ``--data file.npz`` holding ``X`` (``(N, H, W)``,
``(N, C, H, W)`` or ``(N, H*W)`` with a square ``H*W``) and integer labels ``y``.

Run on 2 processes::

    hora run -np 2 python examples/torch/train_digits.py --min-accuracy 0.95
    mpirun -np 2 python examples/torch/train_digits.py          # also works

Each rank trains on a disjoint shard of the training set (reshuffled every
epoch with ``seed + epoch``, like ``DistributedSampler``), gradients are
averaged by the DistributedOptimizer, and rank 0 alone logs, shows the progress
bar and writes checkpoints.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import hora.torch as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; defaults reach >= 0.95 test accuracy on digits."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, default=None,
                   help=".npz file with arrays X and y; default: scikit-learn's bundled digits")
    p.add_argument("--epochs", type=int, default=10, help="number of training epochs")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate for one process (scaled by hvd.size())")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="SGD weight decay")
    p.add_argument("--test-fraction", type=float, default=0.2, help="fraction of the data held out for testing")
    p.add_argument("--seed", type=int, default=42, help="seed for the split, the init and the shuffles")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
    p.add_argument("--log-interval", type=int, default=10, help="batches between speed/accuracy log lines")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"),
                   help="where rank 0 saves model and optimizer state every epoch")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--no-cuda", action="store_true", help="train on CPU even when CUDA is available")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with status 1 when the final test accuracy is below this")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "log_interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.test_fraction < 1.0:
        p.error(f"--test-fraction must be in (0, 1), got {args.test_fraction}")
    return args


# --------------------------------------------------------------------------- data


@dataclass(frozen=True, slots=True)
class Dataset:
    """Images ``(N, C, H, W)`` as float32 and labels ``(N,)`` as int64."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)

    @property
    def num_classes(self) -> int:
        return int(self.y.max()) + 1


def load_arrays(path: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """Read ``X`` and ``y`` from an ``.npz`` file, or return scikit-learn's digits.

    Raises:
        SystemExit: the file lacks ``X`` or ``y``, or their lengths differ.
    """
    if path is None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images.astype(np.float32), digits.target.astype(np.int64)
    with np.load(path) as f:
        missing = {"X", "y"} - set(f.files)
        if missing:
            sys.exit(f"{path}: missing array(s) {sorted(missing)}; found {f.files}. "
                     "Save with np.savez(path, X=..., y=...)")
        x, y = f["X"].astype(np.float32), f["y"].astype(np.int64)
    if len(x) != len(y):
        sys.exit(f"{path}: X has {len(x)} rows but y has {len(y)}")
    return x, y


def to_images(x: np.ndarray) -> np.ndarray:
    """Reshape to ``(N, C, H, W)``: ``(N, H, W)`` gains a channel; ``(N, D)`` needs a square ``D``."""
    if x.ndim == 4:
        return x
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 2:
        side = math.isqrt(x.shape[1])
        if side * side == x.shape[1]:
            return x.reshape(len(x), 1, side, side)
    sys.exit(f"cannot read inputs of shape {x.shape} as images: expected (N, H, W), (N, C, H, W) or (N, H*W)")


def split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Seeded stratified train/test split, standardised with the training mean and std.

    Every rank computes the same split from the same seed, so no data is exchanged.
    """
    from sklearn.model_selection import train_test_split

    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    mean, std = float(x_tr.mean()), float(x_tr.std()) or 1.0
    make = lambda a, b: Dataset(torch.from_numpy((a - mean) / std).float(), torch.from_numpy(b))
    return make(x_tr, y_tr), make(x_te, y_te)


def shard_indices(n: int, rank: int, size: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """This rank's indices of ``n`` samples, disjoint from every other rank's.

    Like ``torch.utils.data.DistributedSampler``: permute with ``seed + epoch``
    (the same permutation on every rank), pad by wrapping around to a multiple
    of ``size`` so every rank runs the same number of steps, take every
    ``size``-th index starting at ``rank``.
    """
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g)
    else:
        order = torch.arange(n)
    total = math.ceil(n / size) * size
    if total > n:
        order = torch.cat([order, order[: total - n]])
    return order[rank:total:size]


def test_shard(n: int, rank: int, size: int) -> slice:
    """A contiguous, unpadded slice of the test set, so each sample is counted exactly once."""
    per = math.ceil(n / size)
    return slice(min(rank * per, n), min((rank + 1) * per, n))


# --------------------------------------------------------------------------- model


class SmallCNN(nn.Module):
    """Two 3x3 conv layers, max-pool, a hidden linear layer; adapts to any input size."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.pool = nn.AdaptiveMaxPool2d(4)
        self.drop = nn.Dropout(0.25)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(N, C, H, W)`` to logits ``(N, num_classes)``."""
        x = F.relu(self.conv1(x))
        x = self.pool(F.relu(self.conv2(x)))
        x = self.drop(torch.flatten(x, 1))
        return self.fc2(self.drop(F.relu(self.fc1(x))))


# --------------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    """Print a line on rank 0 without breaking the progress bar."""
    if hvd.rank() == 0:
        tqdm.write(msg, file=sys.stdout)
        sys.stdout.flush()


def global_accuracy(correct: int, count: int, name: str) -> float:
    """Sum correct predictions and sample counts over all ranks and divide."""
    totals = hvd.allreduce(torch.tensor([float(correct), float(count)], dtype=torch.float64), op=hvd.Sum, name=name)
    return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, device: torch.device, batch_size: int, name: str) -> float:
    """Accuracy of ``model`` on ``data``, each rank scoring its own slice, combined with allreduce."""
    model.eval()
    part = test_shard(len(data), hvd.rank(), hvd.size())
    x, y = data.x[part], data.y[part]
    correct = 0
    for i in range(0, len(y), batch_size):
        xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        correct += int((model(xb).argmax(1) == yb).sum())
    return global_accuracy(correct, len(y), name)


def save_checkpoint(directory: Path, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Write ``checkpoint-{epoch}.pt`` atomically (rank 0 only calls this)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"checkpoint-{epoch}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, path)
    return path


def latest_checkpoint(directory: Path) -> Path | None:
    """The ``checkpoint-{epoch}.pt`` with the highest epoch, or None."""
    found = sorted(directory.glob("checkpoint-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def resume(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint on rank 0; return the first epoch still to run, agreed by all ranks.

    Only rank 0 reads the file (other hosts may not see it); the broadcasts
    in ``main`` then give every rank the same weights and optimizer state.
    """
    start = 0
    if hvd.rank() == 0:
        path = latest_checkpoint(directory)
        if path is not None:
            state = torch.load(path, map_location="cpu")
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = int(state["epoch"]) + 1
            log(f"Resumed from {path}: starting at epoch {start}")
    return int(hvd.broadcast(torch.tensor(start), root_rank=0, name="resume_epoch"))


# --------------------------------------------------------------------------- training


def train_epoch(epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer, data: Dataset,
                args: argparse.Namespace, device: torch.device) -> float:
    """One pass over this rank's shard; returns the training accuracy over all ranks."""
    model.train()
    idx = shard_indices(len(data), hvd.rank(), hvd.size(), args.seed, epoch)
    batches = [idx[i : i + args.batch_size] for i in range(0, len(idx), args.batch_size)]
    show_bar = hvd.rank() == 0 and not args.no_progress and sys.stderr.isatty()
    bar = tqdm(total=len(batches), desc=f"Epoch {epoch}", unit="batch", leave=False, disable=not show_bar)

    correct = count = 0  # whole epoch, this rank
    win_correct = win_count = 0  # current log window, this rank
    win_start = time.perf_counter()
    for i, b in enumerate(batches):
        xb, yb = data.x[b].to(device), data.y[b].to(device)
        optimizer.zero_grad()
        out = model(xb)
        loss = F.cross_entropy(out, yb)
        loss.backward()
        optimizer.step()

        hits = int((out.argmax(1) == yb).sum())
        correct, count = correct + hits, count + len(yb)
        win_correct, win_count = win_correct + hits, win_count + len(yb)
        bar.update(1)
        if (i + 1) % args.log_interval == 0:
            # Every rank processes the same number of samples per step, so the
            # global speed is this rank's speed times the number of ranks.
            speed = win_count * hvd.size() / (time.perf_counter() - win_start)
            log(f"Epoch[{epoch}] Batch [{i + 1 - args.log_interval}-{i + 1}]\tSpeed: {speed:.2f} samples/sec"
                f"\taccuracy={win_correct / win_count:f}")
            win_correct = win_count = 0
            win_start = time.perf_counter()
    bar.close()
    return global_accuracy(correct, count, "train_accuracy")


def main(argv: list[str] | None = None) -> int:
    """Train, evaluate, checkpoint; return the process exit status."""
    args = parse_args(argv)
    hvd.init()

    use_cuda = not args.no_cuda and torch.cuda.is_available()
    if use_cuda:
        if hvd.local_rank() >= torch.cuda.device_count():
            sys.exit(f"rank {hvd.rank()} has local rank {hvd.local_rank()} but this host has "
                     f"{torch.cuda.device_count()} GPU(s): run at most that many processes per host, or --no-cuda")
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda", hvd.local_rank()) if use_cuda else torch.device("cpu")
    if not use_cuda:
        # Ranks on one host share its cores; one thread each avoids oversubscription.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, hvd.local_size())))

    x, y = load_arrays(args.data)
    train, test = split(to_images(x), y, args.test_fraction, args.seed)
    log(f"Training on {len(train)} samples ({len(train) // hvd.size()}+ per rank), testing on {len(test)}, "
        f"{hvd.size()} process(es), device {device}")

    torch.manual_seed(args.seed)  # identical init everywhere; the broadcast below makes sure of it
    model = SmallCNN(train.x.shape[1], max(train.num_classes, test.num_classes)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=args.momentum, weight_decay=args.weight_decay)
    start_epoch = resume(args.checkpoint_dir, model, optimizer) if args.resume else 0

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average)

    for epoch in range(start_epoch, args.epochs):
        tic = time.perf_counter()
        train_acc = train_epoch(epoch, model, optimizer, train, args, device)
        val_acc = evaluate(model, test, device, 256, "val_accuracy")
        log(f"Epoch[{epoch}] Train-accuracy={train_acc:f}\tValidation-accuracy={val_acc:f}"
            f"\tTime cost={time.perf_counter() - tic:.3f}")
        if hvd.rank() == 0:
            save_checkpoint(args.checkpoint_dir, epoch, model, optimizer)

    test_acc = evaluate(model, test, device, 256, "test_accuracy")
    log(f"Test accuracy: {test_acc:.4f}")
    if test_acc < args.min_accuracy:
        if hvd.rank() == 0:
            print(f"error: test accuracy {test_acc:.4f} is below --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
