"""The compressors' own CPU per step on one rank (no network): the ResNet-50 and VGG16 gradient sets.

On one rank every allreduce returns its input, so the time of
``compressor.reduce`` is the compressor's own work: packing, casts, PowerSGD's
batched products and orthogonalization, error feedback.  A cast is timed the
way ``hora.torch.DistributedOptimizer`` runs it (``fp16``, ``bf16``: wire
buffers kept between steps, the result cast straight into the gradient) and
the way Horovod's API spells it (``fp16 (compress/decompress)``: a new wire
tensor and a new full-precision tensor every step, then a copy).  Compare it with the
exchange time it saves on a slow link (printed from the cost model: a ring
of 4 hosts at 1 Gbit/s)::

    python benchmarks/compression_cpu.py [--threads 1] [--sets resnet50,vgg16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hora.torch as hvd
from hora.bench.compression import exchange, gradient_set
from hora.bench.model import CostModel
from hora.core.compression import WireBuffers, is_stateful, parse_spec

CASES = ["fp16 (compress/decompress)", "fp16", "bf16", "fp16+ef", "powersgd:1", "powersgd:2", "powersgd:4"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--sets", default="resnet50,vgg16")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the ranks of a host share its cores)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hvd.init()
    link = CostModel.from_strings("1gbit")
    print("| gradient set | compressor | CPU per step (median) | 1 Gbit/s x 4 exchange saved (model) | CPU / saved |")
    print("|---|---|---|---|---|")
    for name in args.sets.split(","):
        shapes = gradient_set(name)
        g = torch.Generator().manual_seed(0)
        grads = [torch.randn(s, generator=g) for s in shapes]
        names = [f"{name}.{i}" for i in range(len(shapes))]
        full = link.ring_allreduce(exchange(shapes, "none").wire_bytes, 4).total
        for case in CASES:
            spec, _, horovod_api = case.partition(" ")
            comp = parse_spec(spec)
            work = [t.clone() for t in grads]
            if is_stateful(comp):
                def step(comp=comp, work=work, names=names) -> None:
                    comp.reduce(work, names)
            elif horovod_api:  # compress before the allreduce, decompress after, as Horovod's API has it
                def step(comp=comp, work=work) -> None:
                    for w in work:
                        w.copy_(comp.decompress(*comp.compress(w)))
            else:  # as hora.torch's optimizer runs a cast
                wire = WireBuffers()

                def step(comp=comp, work=work, wire=wire) -> None:
                    for i, w in enumerate(work):
                        wire.decompress_into(comp, *wire.compress(comp, w, i), w)
            step()  # first step: layout, settings check
            times = []
            for _ in range(args.steps):
                for w, t in zip(work, grads, strict=True):
                    w.copy_(t)
                t0 = time.process_time()
                step()
                times.append(time.process_time() - t0)
            cpu = statistics.median(times)
            ex = exchange(shapes, spec)
            saved = full - sum(link.ring_allreduce(b, 4).total for b in ex.rounds)
            print(f"| {name} | {case} | {cpu * 1e3:.1f} ms | {saved * 1e3:.0f} ms | {cpu / saved:.1%} |", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
