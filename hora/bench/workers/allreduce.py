"""Worker of ``hora bench allreduce``: time hora's in-place allreduce of float32 buffers.

Per size: one checked allreduce (rank r contributes ``r + 1``, every element
must come back as ``1 + ... + N``), ``--warmup`` untimed ones, then
``--iters`` timed ones, each after a barrier.  Every rank reports its own
times; the driver takes, per iteration, the slowest rank (a collective is
done when its last rank is) and the median over iterations.
"""

from __future__ import annotations

import argparse
import sys
import time

from hora.bench.jobs import emit
from hora.bench.workers import cpu_use, host_cpu


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes in bytes (comma-separated), iterations, warmup."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--sizes", required=True, help="comma-separated sizes in bytes, multiples of 4")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Measure every size and emit the results."""
    args = parse_args(argv)
    import torch

    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    sizes = [int(s) for s in args.sizes.split(",")]
    times: dict[str, list[float]] = {}
    cpu: dict[str, dict[str, float] | None] = {}
    for i, nbytes in enumerate(sizes):
        buf = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32)
        name = f"bench.allreduce.{nbytes}"
        hvd.allreduce_(buf, op=hvd.Sum, name=name)
        expected = size * (size + 1) / 2
        if not bool(torch.all(buf == expected)):
            raise SystemExit(f"rank {rank}: allreduce of {nbytes} bytes gave {buf[:3].tolist()}, "
                             f"expected {expected}")
        buf.zero_()  # sums of zeros stay finite however many iterations run
        for _ in range(args.warmup):
            hvd.allreduce_(buf, op=hvd.Sum, name=name)
        ts = []
        before = host_cpu()
        for _ in range(args.iters):
            hvd.barrier()
            t0 = time.perf_counter()
            hvd.allreduce_(buf, op=hvd.Sum, name=name)
            ts.append(time.perf_counter() - t0)
        times[str(nbytes)] = ts
        cpu[str(nbytes)] = cpu_use(before, host_cpu(), args.iters)
        if rank == 0:
            emit("progress", done=i + 1, total=len(sizes), bytes=nbytes)
    emit("result", rank=rank, size=size, controller="mpi" if hvd.mpi_enabled() else "gloo", times=times,
         host_cpu=cpu)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
