"""float16/bfloat16 allreduce on the MPI engine: 16-bit on the wire against the float32 upcast, in one job.

Launch on 2 (or more) ranks with MPI as the engine::

    hora run -np 2 --mpi python benchmarks/mpi_half.py --mib 64

hora is initialised twice in the same processes: once with
``HORA_MPI_HALF_OPS=0`` (float16 and bfloat16 cast to float32, reduced with
MPI's own sum, cast back: the behaviour before) and once with ``=1``
(16-bit words reduced by hora's user-defined MPI operator, the default when a job spans hosts).  Each time it
times ``hvd.allreduce`` (sum) of a ``--mib`` MiB float16 tensor, the same
number of bfloat16 elements, and the same number of float32 elements (which
the switch must not change).  The kernel's own cost (ns per element, one
rank, no MPI) is printed too.  Rank 0 prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

import hora.torch as hvd
from hora.core.buffers.half import HalfReducer
from hora.core.ops import ReduceOp

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, after one warm-up; ranks start each run together."""
    fn()
    times = []
    for _ in range(repeats):
        hvd.allreduce(torch.zeros(1), name="mpi_half.barrier")
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # The slowest rank's median is the collective's time.
    return hvd.allreduce(torch.tensor([statistics.median(times)]), op=hvd.Max, name="mpi_half.max").item()


def measure(elements: int, repeats: int) -> dict[str, float]:
    """Times of one allreduce per dtype under the engine hora was initialised with."""
    out = {}
    for dtype in DTYPES:
        t = torch.ones(elements, dtype=dtype)
        name = f"mpi_half.{dtype}"
        out[str(dtype).removeprefix("torch.")] = timed(lambda t=t, name=name: hvd.allreduce(t, name=name), repeats)
    return out


def kernel_ns(elements: int) -> dict[str, float]:
    """ns per element of the 16-bit sum kernel on one segment of ``elements`` (no MPI)."""
    reducer = HalfReducer()
    a = np.random.default_rng(0).standard_normal(elements).astype(np.float16).view(np.uint16)
    b = a.copy()
    out = {}
    for name in ("float16", "bfloat16"):
        reducer.reduce(name, ReduceOp.SUM, a, b)
        t0 = time.perf_counter()
        for _ in range(5):
            reducer.reduce(name, ReduceOp.SUM, a, b)
        out[name] = (time.perf_counter() - t0) / 5 / elements * 1e9
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--mib", type=int, default=64, help="float16 tensor size in MiB")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    elements = args.mib * (1 << 20) // 2
    results = {}
    for label, flag in (("upcast (before)", "0"), ("16-bit (after)", "1")):
        os.environ["HORA_MPI_HALF_OPS"] = flag
        hvd.init()
        results[label] = measure(elements, args.repeats)
        size = hvd.size()
        rank = hvd.rank()
        hvd.shutdown()
    if rank == 0:
        before, after = results["upcast (before)"], results["16-bit (after)"]
        print(f"{size} ranks, {elements:,} elements ({args.mib} MiB as float16), median of {args.repeats}\n")
        print("| dtype | upcast (before) | 16-bit (after) | after / before |")
        print("|---|---|---|---|")
        for name in before:
            print(f"| {name} | {before[name] * 1e3:.1f} ms | {after[name] * 1e3:.1f} ms | "
                  f"{after[name] / before[name]:.2f}x |")
        ns = kernel_ns(1 << 20)
        print("\nsum kernel, one 1 Mi-element segment: "
              + ", ".join(f"{k} {v:.2f} ns/element" for k, v in ns.items()))


if __name__ == "__main__":
    main()
