"""The last rank dies between two fp16 steps of a model whose gradients travel in several chunks.

The others are inside ``optimizer.step()``, waiting on the cast exchange's
chunks; they must get an error (or be stopped by ``hora run``), not hang.
"""

import os
import sys
import time

import torch

import hora.torch as hvd
from hora.errors import HoraError

hvd.init()
torch.manual_seed(0)
# 2 x 4.2 M parameters: 16 MiB of float16, two 8 MiB chunks
model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), compression=hvd.Compression.fp16,
                               named_parameters=model.named_parameters())
assert len(opt._casts.chunk_names) >= 2, "the model should fill several chunks"
x = torch.randn(8, 2048)
start = time.monotonic()
try:
    for step in range(1000):
        if step == 2 and hvd.rank() == hvd.size() - 1:
            os._exit(7)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    print("NO ERROR")
except HoraError as e:
    print(f"ERROR after {time.monotonic() - start:.1f}s: {type(e).__name__}: {e}")
    sys.exit(0)
