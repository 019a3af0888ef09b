"""Allreduce in a loop, printing 'step <n> <rank> <host>' every 10 steps; exit 0 after --seconds (host-loss tests)."""

import argparse
import socket
import time

import torch

import hora.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=600.0)
args = parser.parse_args()
hvd.init()
end = time.monotonic() + args.seconds
step = 0
while time.monotonic() < end:
    total = hvd.allreduce(torch.ones(1024), op=hvd.Sum, name="loop")
    assert float(total[0]) == hvd.size(), float(total[0])
    if step % 10 == 0:
        print(f"step {step} {hvd.rank()} {socket.gethostname()}", flush=True)
    step += 1
    time.sleep(0.02)
print(f"finished {hvd.rank()} after {step} steps", flush=True)
