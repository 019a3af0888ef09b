"""Collectives on CUDA tensors (NCCL), one GPU per rank; skipped without enough GPUs.

tests/test_cuda.py launches this file on one rank wherever a GPU exists;
tests/test_multiprocess.py runs it on 2 and 3 ranks, where it needs a GPU per
local rank (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import pytest
import torch

import hora.torch as hvd
from hora.core import runtime

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


@pytest.fixture
def dev() -> torch.device:
    if torch.cuda.device_count() < hvd.local_size():
        pytest.skip("needs one CUDA device per local rank")
    device = torch.device("cuda", hvd.local_rank())
    torch.cuda.set_device(device)
    return device


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.device, got.dtype, tuple(got.shape)) == (want.device, want.dtype, tuple(want.shape))
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0)


def test_cuda_tensors_run_on_nccl(dev):
    backend = runtime.current().engine._backend_for("cuda")
    assert backend.name == "nccl"
    calls = []
    original = backend.allreduce_
    backend.allreduce_ = lambda buf, *a, **k: (calls.append(buf.device), original(buf, *a, **k))[1]
    try:
        hvd.allreduce(torch.ones(3, device=dev), name="cuda.which")
    finally:
        del backend.allreduce_
    assert calls == [dev]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_collective_values(dev, dtype):
    n, r = hvd.size(), hvd.rank()
    tri = n * (n - 1) // 2
    base = torch.arange(10, device=dev).to(dtype)
    _same(hvd.allreduce(base + r, op=hvd.Sum, name=f"c.ar.{dtype}"), (base * n + tri).to(dtype))
    inplace = (base + r).clone()
    assert hvd.allreduce_(inplace, op=hvd.Sum, name=f"c.ari.{dtype}") is inplace
    _same(inplace, (base * n + tri).to(dtype))
    outs = hvd.grouped_allreduce([base + r, base[:3] * 3 + r], op=hvd.Sum, name=f"c.g.{dtype}")
    _same(outs[0], (base * n + tri).to(dtype))
    _same(outs[1], (base[:3] * 3 * n + tri).to(dtype))
    # allgather with a different first dimension on every rank
    mine = torch.full((r + 1, 3), r, device=dev).to(dtype)
    _same(hvd.allgather(mine, name=f"c.ag.{dtype}"),
          torch.cat([torch.full((j + 1, 3), j, device=dev).to(dtype) for j in range(n)]))
    _same(hvd.broadcast(torch.full((5,), r + 7, device=dev).to(dtype), root_rank=n - 1, name=f"c.bc.{dtype}"),
          torch.full((5,), n + 6, device=dev).to(dtype))
    sent = (torch.arange(2 * n, device=dev) + 100 * r).to(dtype)
    _same(hvd.alltoall(sent, name=f"c.a2a.{dtype}"),
          torch.cat([(torch.arange(2 * r, 2 * r + 2, device=dev) + 100 * j).to(dtype) for j in range(n)]))
    rows = 3 * n + 1  # uneven: rank 0 keeps one row more
    got = hvd.reducescatter(torch.ones(rows, 2, device=dev).to(dtype) * (r + 1), op=hvd.Sum, name=f"c.rs.{dtype}")
    _same(got, torch.full((3 + (r == 0), 2), n * (n + 1) // 2, device=dev).to(dtype))


def test_cuda_average_large_and_noncontiguous(dev):
    n, r = hvd.size(), hvd.rank()
    x = torch.randn(5 << 20, device=dev, generator=torch.Generator(device=dev).manual_seed(3))  # past fusion
    torch.testing.assert_close(hvd.allreduce(x + r, name="c.big"), x + (n - 1) / 2)
    t = (torch.arange(12.0, device=dev).view(3, 4) + r).t()
    hvd.allreduce_(t, op=hvd.Sum, name="c.nc")
    _same(t.contiguous(), (torch.arange(12.0, device=dev).view(3, 4) * n + n * (n - 1) / 2).t().contiguous())


def test_cuda_result_ready_on_another_stream(dev):
    """A finished collective's output may be read on any stream right away."""
    n = hvd.size()
    side = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(side):
        t = torch.full((8 << 20,), float(hvd.rank() + 1), device=dev)
        gathered = hvd.allgather(t, name="c.ss.ag")
        total = gathered.sum().item()
    assert total == float((8 << 20) * n * (n + 1) // 2)


def test_cuda_training_matches_cpu_big_batch(dev):
    n, r = hvd.size(), hvd.rank()
    steps, per = 4, 4

    def model() -> torch.nn.Module:
        torch.manual_seed(1234)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()

    g = torch.Generator().manual_seed(99)
    x = torch.randn(steps, per * n, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (steps, per * n), generator=g)
    loss = torch.nn.CrossEntropyLoss()
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        ref_opt.zero_grad()
        loss(ref(x[s]), y[s]).backward()
        ref_opt.step()
    net = model().to(dev)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=net.named_parameters())
    for s in range(steps):
        opt.zero_grad()
        shard = slice(r * per, (r + 1) * per)
        loss(net(x[s][shard].to(dev)), y[s][shard].to(dev)).backward()
        opt.step()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-10, atol=1e-10)
