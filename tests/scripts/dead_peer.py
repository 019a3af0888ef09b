"""The last rank dies mid-job; the others must get an error, not hang."""

import os
import sys
import time

import torch

import hora.torch as hvd
from hora.errors import HoraError

hvd.init()
hvd.allreduce(torch.ones(1), name="warmup")
if hvd.rank() == hvd.size() - 1:
    os._exit(7)
start = time.monotonic()
try:
    for i in range(1000):
        hvd.allreduce(torch.ones(1000), name=f"step.{i}")
        time.sleep(0.01)
    print("NO ERROR")
except HoraError as e:
    print(f"ERROR after {time.monotonic() - start:.1f}s: {type(e).__name__}: {e}")
    sys.exit(0)
