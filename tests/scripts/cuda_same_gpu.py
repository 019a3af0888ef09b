"""Every rank puts its tensor on cuda:0: with two ranks NCCL refuses, and hora must say why."""

import torch

import hora.torch as hvd

hvd.init()
try:
    out = hvd.allreduce(torch.ones(4, device="cuda:0"), op=hvd.Sum)
    print(f"rank {hvd.rank()} result {out.tolist()}", flush=True)
finally:
    hvd.shutdown()
