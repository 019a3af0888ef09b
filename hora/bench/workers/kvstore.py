"""Worker of ``hora bench kvstore``: push+pull time per iteration through hora's KVStore, MXNet's API.

The same load as ``benchmarks/mxnet_peer/kvstore_bench.py`` runs on MXNet:
one float32 key per size, inited by worker 0, then per iteration a barrier,
``push`` of a gradient of ones and ``pull(out=...)``.  The first pull is
checked: with no updater the store holds the sum of the workers' pushes, so
every element must equal the number of workers.  ``--optimizer NAME`` runs
that server optimizer on every push instead (its update is then part of the
time).  Works for every
distributed type (``dist_sync`` with servers from ``hora run -s S``,
``dist_sync_allreduce`` without).
"""

from __future__ import annotations

import argparse
import sys
import time

from hora.bench.jobs import emit
from hora.bench.workers import cpu_use, host_cpu


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Store type, sizes in bytes, iterations."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--kvstore", default="dist_sync")
    p.add_argument("--sizes", required=True, help="comma-separated sizes in bytes, multiples of 4")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--optimizer", default="", help="a server optimizer by name, MXNet's defaults; 'sgd+momentum' is "
                                                   "SGD with momentum 0.9")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Measure every size and emit this worker's times."""
    args = parse_args(argv)
    import numpy as np

    import hora.kvstore as kvs

    kv = kvs.create(args.kvstore)
    rank, workers = kv.rank, kv.num_workers
    if args.optimizer:
        name, momentum = args.optimizer.removesuffix("+momentum"), args.optimizer.endswith("+momentum")
        kv.set_optimizer(kvs.optimizer.create(name, **({"momentum": 0.9} if momentum else {})))
    sizes = [int(s) for s in args.sizes.split(",")]
    times: dict[str, list[float]] = {}
    cpu: dict[str, dict[str, float] | None] = {}
    try:
        for key, nbytes in enumerate(sizes):
            n = nbytes // 4
            kv.init(key, np.zeros(n, dtype=np.float32))
            grad, out = np.ones(n, dtype=np.float32), np.zeros(n, dtype=np.float32)
            ts = []
            for i in range(args.warmup + args.iters):
                kv.barrier()
                if i == args.warmup:
                    before = host_cpu()
                t0 = time.perf_counter()
                kv.push(key, grad)
                kv.pull(key, out=out)
                dt = time.perf_counter() - t0
                if i == 0 and not args.optimizer and not np.all(out == workers):
                    raise SystemExit(f"worker {rank}: pulled {out[:3].tolist()} for key {key}, "
                                     f"expected {workers} everywhere")
                if i >= args.warmup:
                    ts.append(dt)
            times[str(nbytes)] = ts
            cpu[str(nbytes)] = cpu_use(before, host_cpu(), args.iters)
            if rank == 0:
                emit("progress", done=key + 1, total=len(sizes), bytes=nbytes)
        emit("result", rank=rank, workers=workers, kvstore=args.kvstore, times=times, host_cpu=cpu)
    finally:
        kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
