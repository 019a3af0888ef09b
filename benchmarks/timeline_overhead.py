"""What the timeline costs: the MLP and the ResNet-50 gradient set of benchmarks/allreduce.py, timeline off and on.

Both cases come from ``allreduce.py``: the gradient set is its
``async ×161 + synchronize`` case (161 named ``allreduce_async_`` of
ResNet-50's gradient shapes, 97.5 MiB), and the MLP is its 784-1024-1024-10
model trained with ``DistributedOptimizer`` (batch 128 per rank).  For each
hora controller, "off" and "on" blocks alternate in the balanced order of
:func:`common.time_interleaved`; an "on" block starts a timeline
(``hvd.start_timeline``), runs, and stops it, so the file's opening, the
writer thread's work and the final flush are all inside the timed block.
The ratio is the median of per-cycle on/off ratios.

Launch on 2 ranks::

    hora run -np 2 --mpi python benchmarks/timeline_overhead.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from allreduce import gradset_hora_cases, mlp_setup, open_hora, resnet50_gradients, sgd_step
from common import markdown_table, median, start_world, time_interleaved


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hora-controllers", default="mpi,gloo", help="comma-separated controllers to measure")
    p.add_argument("--cases", default="gradset,mlp", help="comma-separated: gradset, mlp")
    p.add_argument("--repeats", type=int, default=8, help="paired blocks of each (on, off)")
    p.add_argument("--gradset-iters", type=int, default=5, help="gradient-set reductions per block")
    p.add_argument("--mlp-steps", type=int, default=50, help="MLP training steps per block")
    p.add_argument("--mlp-batch-size", type=int, default=128)
    p.add_argument("--mark-cycles", action="store_true", help="record CYCLE_START instants too")
    return p.parse_args()


def blocks(hvd, case: str, args: argparse.Namespace) -> Callable[[], None]:
    """One timed block of a case."""
    if case == "gradset":
        run = gradset_hora_cases(hvd, resnet50_gradients())["async ×161 + synchronize"]

        def block() -> None:
            for _ in range(args.gradset_iters):
                run()
        return block
    model, x, y = mlp_setup(args.mlp_batch_size)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def block() -> None:
        for _ in range(args.mlp_steps):
            sgd_step(model, opt, x, y)
    return block


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    world = start_world()
    out_dir = Path(tempfile.mkdtemp(prefix="hora-timeline-bench-"))
    rows = []
    for controller in filter(None, args.hora_controllers.split(",")):
        hvd, why = open_hora(world, controller)
        if hvd is None:
            print(why, file=sys.stderr)
            continue
        for case in args.cases.split(","):
            block = blocks(hvd, case, args)
            path = str(out_dir / f"{controller}-{case}.json")
            sizes: list[int] = []

            def on(block: Callable[[], None] = block, path: str = path, sizes: list[int] = sizes,
                   hvd=hvd) -> None:
                hvd.start_timeline(path, mark_cycles=args.mark_cycles)
                block()
                hvd.stop_timeline()
                if world.rank == 0:
                    sizes.append(os.path.getsize(path))

            times = time_interleaved(world, {"off": block, "on": on}, 1, args.repeats)
            ratio = median([b / a for a, b in zip(times["off"], times["on"], strict=True)])
            per_block = args.gradset_iters if case == "gradset" else args.mlp_steps
            rows.append([controller, case, f"{median(times['off']) / per_block * 1000:.2f}",
                         f"{median(times['on']) / per_block * 1000:.2f}", f"{ratio:.3f}",
                         f"{(median(sizes) if sizes else 0) / per_block / 1024:.0f}"])
            if world.rank == 0:
                print(f"[timeline] {controller} {case}: on/off {ratio:.3f}", flush=True)
        hvd.shutdown()
    if world.rank == 0:
        print(markdown_table(["controller", "case", "off ms/step", "on ms/step", "on ÷ off (paired median)",
                              "timeline KiB/step"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
