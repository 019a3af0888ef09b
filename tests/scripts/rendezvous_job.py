"""A --gloo job whose rank 1 joins late: the rendezvous-store attack test plants values meanwhile.

Run by tests/test_rendezvous_security.py under ``hora run -np 2 --gloo``.
Rank 1 waits for the file ``GO_FILE`` (at most 90 s) before ``init()``; then
both ranks allreduce and print ``RESULT`` with the sum, which must be exact.
"""

from __future__ import annotations

import os
import time

import torch

import hora.torch as hvd

if os.environ.get("HORA_RANK") == "1":
    deadline = time.monotonic() + 90
    while not os.path.exists(os.environ["GO_FILE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
hvd.init()
out = hvd.allreduce(torch.arange(4, dtype=torch.float32) * (hvd.rank() + 1), op=hvd.Sum)
print("RESULT", " ".join(f"{x:g}" for x in out.tolist()), flush=True)
hvd.shutdown()
