"""Rank 0 submits a collective nobody else does; every rank must raise StallError."""

import time

import torch

import hora.torch as hvd
from hora.errors import StallError

hvd.init()
start = time.monotonic()
try:
    if hvd.rank() == 0:
        hvd.allreduce(torch.ones(2), name="only.rank0")
    else:
        hvd.allreduce(torch.ones(2), name=f"only.rank{hvd.rank()}")
    print("NO ERROR")
except StallError as e:
    print(f"STALL after {time.monotonic() - start:.1f}s: {e}")
