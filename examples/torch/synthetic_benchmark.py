"""Synthetic training throughput: images per second with hora's DistributedOptimizer.

Every rank trains a model on one fixed random batch, so the figure measures
compute plus gradient allreduce and nothing of data loading.  The output
follows Horovod's ``pytorch_synthetic_benchmark.py``, so existing log parsers
keep working.

    hora run -np 2 python examples/torch/synthetic_benchmark.py --model resnet50 --image-size 64 --batch-size 8
    mpirun -np 2 python examples/torch/synthetic_benchmark.py --model resnet18 --json

On a small CPU host use a smaller ``--image-size`` (64) and fewer batches; the
defaults (ResNet-50, 224x224, batch 32) are the usual GPU setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import timeit

import torch
import torch.nn.functional as F
from models import MODEL_NAMES, build_model

import hora.torch as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (Horovod's names and defaults, plus --image-size and --json)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=MODEL_NAMES, default="resnet50", help="model to train")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per process")
    p.add_argument("--image-size", type=int, default=224, help="side of the square synthetic images")
    p.add_argument("--num-classes", type=int, default=1000, help="classifier output size")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="untimed batches before measuring")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="batches timed together as one iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of timed iterations")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate for one process")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
    p.add_argument("--use-adasum", action="store_true", help="combine gradients with Adasum instead of averaging")
    p.add_argument("--no-cuda", action="store_true", help="run on CPU even when CUDA is available")
    p.add_argument("--json", action="store_true", help="print one final JSON line with the results (rank 0)")
    args = p.parse_args(argv)
    for name in ("batch_size", "image_size", "num_classes", "num_batches_per_iter", "num_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_warmup_batches < 0:
        p.error(f"--num-warmup-batches must be >= 0, got {args.num_warmup_batches}")
    return args


def log(msg: str) -> None:
    """Print on rank 0 only."""
    if hvd.rank() == 0:
        print(msg, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    args = parse_args(argv)
    hvd.init()

    use_cuda = not args.no_cuda and torch.cuda.is_available()
    if use_cuda:
        if hvd.local_rank() >= torch.cuda.device_count():
            sys.exit(f"rank {hvd.rank()} has local rank {hvd.local_rank()} but this host has "
                     f"{torch.cuda.device_count()} GPU(s): run at most that many processes per host, or --no-cuda")
        torch.cuda.set_device(hvd.local_rank())
        device, kind = torch.device("cuda", hvd.local_rank()), "GPU"
    else:
        # Ranks on one host share its cores: split them instead of oversubscribing.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, hvd.local_size())))
        device, kind = torch.device("cpu"), "CPU"

    torch.manual_seed(1234)
    model = build_model(args.model, args.num_classes, args.image_size).to(device)
    # Adasum adapts the step size itself; plain averaging uses the linear scaling rule.
    lr_scale = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scale)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        if use_cuda:
            torch.cuda.synchronize()

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Image size: {args.image_size}x{args.image_size}")
    log(f"Number of {kind}s: {hvd.size()}")

    log("Running warmup...")
    timeit.timeit(step, number=args.num_warmup_batches)

    log("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {rate:.1f} img/sec per {kind}")
        rates.append(rate)

    mean = statistics.fmean(rates)
    conf = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
    log(f"Img/sec per {kind}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {kind}(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    if args.json:
        log(json.dumps({
            "model": args.model, "batch_size": args.batch_size, "image_size": args.image_size,
            "device": kind, "size": hvd.size(), "fp16_allreduce": args.fp16_allreduce, "adasum": args.use_adasum,
            "img_sec_per_device": rates, "img_sec_per_device_mean": mean, "img_sec_per_device_conf": conf,
            "img_sec_total": hvd.size() * mean, "img_sec_total_conf": hvd.size() * conf,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
