"""Worker of ``hora bench train``: synthetic training throughput through allreduce or parameter servers.

Like ``examples/torch/synthetic_benchmark.py`` (Horovod's synthetic
benchmark): every rank trains on one fixed random batch, so the figure is
compute plus gradient exchange and nothing of data loading.  Before the
distributed steps, each rank times a few purely local steps (forward,
backward, a local optimizer step) with all ranks doing the same at once; that
is the compute time ``C`` the cost model needs, with the host's sharing of
cores already in it.  Then ``--iters`` timed iterations of ``--steps`` steps
with hora's ``DistributedOptimizer``: allreduce (``--strategy allreduce``) or
a ``dist_sync`` KVStore (``--strategy ps``, launched with ``-s S``).

The models are those of ``examples/torch/models.py`` (resnet18, resnet50,
mlp) when the repository is there, and a built-in MLP otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hora.bench.jobs import emit
from hora.bench.workers import cpu_use, host_cpu

EXAMPLE_MODELS = Path(__file__).resolve().parents[3] / "examples" / "torch" / "models.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Model, batch, steps, strategy."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="untimed distributed steps")
    p.add_argument("--steps", type=int, default=5, help="steps per timed iteration")
    p.add_argument("--iters", type=int, default=3, help="timed iterations")
    p.add_argument("--compute-steps", type=int, default=5,
                   help="local steps timed one by one; their median is the compute time")
    p.add_argument("--strategy", choices=("allreduce", "ps"), default="allreduce")
    p.add_argument("--compression", default="none", help="allreduce compressor: fp16, bf16, powersgd:RANK...")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (0: the host's cores over its local ranks)")
    return p.parse_args(argv)


def build_model(name: str, num_classes: int, image_size: int) -> Any:
    """A model from examples/torch/models.py, or the built-in MLP when that file is absent."""
    from torch import nn

    if EXAMPLE_MODELS.is_file():
        spec = importlib.util.spec_from_file_location("hora_example_models", EXAMPLE_MODELS)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.build_model(name, num_classes, image_size)
    if name != "mlp":
        raise SystemExit(f"model {name!r} needs {EXAMPLE_MODELS}; without it only 'mlp' is available")
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size * image_size, 1024), nn.ReLU(),
                         nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, num_classes))


def main(argv: list[str] | None = None) -> int:
    """Time local steps, then distributed steps; emit the result of this rank."""
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // max(1, hvd.local_size())))
    torch.manual_seed(1234)
    model = build_model(args.model, args.num_classes, args.image_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, args.num_classes, (args.batch_size,))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    step()  # first-call allocations
    hvd.barrier()
    before, local_steps = host_cpu(), []
    for _ in range(args.compute_steps):
        t0 = time.perf_counter()
        step()
        local_steps.append(time.perf_counter() - t0)
    compute_s = statistics.median(local_steps)  # a burst of other load on the machine moves one step, not C
    compute_cpu = cpu_use(before, host_cpu(), args.compute_steps)
    if rank == 0:
        emit("progress", phase="compute", compute_s=compute_s)

    if args.strategy == "ps":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             kvstore="dist_sync")
    else:
        from hora.core.compression import parse_spec

        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=parse_spec(args.compression))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(args.warmup):
        step()
    step_times = []
    before = host_cpu()
    for i in range(args.iters):
        hvd.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        step_times.append((time.perf_counter() - t0) / args.steps)
        if rank == 0:
            emit("progress", phase="train", done=i + 1, total=args.iters)
    train_cpu = cpu_use(before, host_cpu(), args.iters * args.steps)
    emit("result", rank=rank, size=size, step_times=step_times, compute_s=compute_s, param_bytes=param_bytes,
         batch_size=args.batch_size, model=args.model, strategy=args.strategy, compression=args.compression,
         param_shapes=[list(p.shape) for p in model.parameters()],
         host_cpu={"compute": compute_cpu, "train": train_cpu})
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
