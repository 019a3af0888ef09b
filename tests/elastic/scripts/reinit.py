"""init -> allreduce -> shutdown, many times in one process; prints threads, open files and RSS after each."""

import json
import os
import sys
import threading

import torch

import hora.torch as hvd

rounds = int(sys.argv[1])
for i in range(rounds):
    hvd.init()
    total = hvd.allreduce(torch.full((1000,), float(hvd.rank() + 1)), op=hvd.Sum)
    assert float(total[0]) == hvd.size() * (hvd.size() + 1) / 2
    hvd.shutdown()
    with open("/proc/self/statm") as f:
        rss_mib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    print(json.dumps({"round": i, "rank": int(os.environ.get("HORA_RANK", 0)),
                      "threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
                      "rss_mib": rss_mib}), flush=True)
