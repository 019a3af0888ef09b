"""A dist_sync worker: push rank+1 for a few rounds, check each pulled sum, print its host."""

import socket
import sys

import numpy as np

import hora.kvstore as kvs

kind = sys.argv[1] if len(sys.argv) > 1 else "dist_sync"
kv = kvs.create(kind)
rank, workers = kv.rank, kv.num_workers
kv.init("w", np.zeros(1000, dtype=np.float32))
for step in range(3):
    kv.push("w", np.full(1000, rank + 1 + step, dtype=np.float32))
    out = np.empty(1000, dtype=np.float32)
    kv.pull("w", out=out)
    want = sum(r + 1 + step for r in range(workers))
    if not np.all(out == want):
        print(f"rank {rank}: step {step} pulled {out[:3]} instead of {want}", file=sys.stderr)
        sys.exit(1)
print(f"worker {rank} of {workers} on {socket.gethostname()}: {kind} sums ok", flush=True)
