"""float16 and bfloat16 allreduce: 16-bit on MPI's wire, rounded at every step of the reduction."""

from __future__ import annotations

import pytest
import torch

import hora.torch as hvd
from hora.core import runtime
from hora.core.executor import compute_dtype

HALVES = [torch.float16, torch.bfloat16]


def cpu_backend():
    return runtime.current().engine._backend_for("cpu")


def require_half_wire():
    backend = cpu_backend()
    if backend.name != "mpi":
        pytest.skip("MPI backend only")
    if not backend.half_on_wire:
        pytest.skip("16-bit MPI reductions are off: on one host by default (HORA_MPI_HALF_OPS=1 turns them on)")
    return backend


def stepwise_cases(dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-rank values (n x size) and the sum every pairwise order of rounding agrees on.

    With three ranks, only rows where ((a+b)+c), ((a+c)+b) and ((b+c)+a), each
    rounded at every step, give one result that differs from rounding the
    float32 sum once are kept, so the check holds whatever order MPI adds in
    and fails for the old round-once upcast; those rows are tiled to ``n``.
    """
    gen = torch.Generator().manual_seed(11)
    size = hvd.size()
    x = (torch.rand(n if size == 2 else 20_000, size, generator=gen) * 4 + 0.5).to(dtype)
    f = x.float()

    def r(t):
        return t.to(dtype).float()

    if size == 2:
        return x, r(f[:, 0] + f[:, 1]).to(dtype)
    assert size == 3
    o1, o2, o3 = (r(r(f[:, i] + f[:, j]) + f[:, k]) for i, j, k in ((0, 1, 2), (0, 2, 1), (1, 2, 0)))
    keep = (o1 == o2) & (o2 == o3) & (o1 != r(f.sum(1)))
    assert keep.sum() > 50
    reps = -(-n // int(keep.sum()))
    return x[keep].repeat(reps, 1)[:n], o1[keep].repeat(reps)[:n].to(dtype)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("n", [3000, 400_000])  # fused, and direct (past the MPI direct threshold)
def test_sum_rounds_at_every_step(dtype, n):
    if hvd.size() not in (2, 3):
        pytest.skip("expected values are worked out for 2 and 3 ranks")
    require_half_wire()
    values, want = stepwise_cases(dtype, n)
    out = hvd.allreduce(values[:, hvd.rank()].contiguous(), op=hvd.Sum, name=f"half.step.{dtype}.{n}")
    assert out.dtype == dtype
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", HALVES)
def test_max_min_product(dtype):
    require_half_wire()
    r = hvd.rank()
    t = torch.tensor([r + 0.5, -r - 0.25, 1.5, float("inf") if r == 1 else 1.0], dtype=dtype)
    n = hvd.size()
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Max, name=f"half.max.{dtype}"),
                               torch.tensor([n - 0.5, -0.25, 1.5, float("inf")], dtype=dtype))
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Min, name=f"half.min.{dtype}"),
                               torch.tensor([0.5, -n + 0.75, 1.5, 1.0], dtype=dtype))
    # every partial product below is exact in both dtypes, so the order of the steps does not matter
    want = [1.0, 1.0, 1.5 ** n, float("inf")]
    for k in range(n):
        want[0] *= k + 0.5
        want[1] *= -k - 0.25
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Product, name=f"half.prod.{dtype}"),
                               torch.tensor(want, dtype=dtype))


class _Recorder:
    """Stands in for the backend's communicator and notes what each Allreduce hands to MPI."""

    def __init__(self, comm):
        self._comm = comm
        self.calls: list[tuple[int, int]] = []

    def Allreduce(self, send, recv, op):  # noqa: N802 - mpi4py's name
        self.calls.append((recv[1], recv[2].Get_size()))
        return self._comm.Allreduce(send, recv, op=op)

    def __getattr__(self, name):
        return getattr(self._comm, name)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("n", [1000, 300_000])
def test_bytes_on_the_wire_are_16_bit(dtype, n):
    backend = require_half_wire()
    name = str(dtype).removeprefix("torch.")
    assert compute_dtype(name, backend) == name  # no upcast planned
    recorder = _Recorder(backend.comm)
    hvd.allreduce(torch.ones(8), name="half.wire.warm")  # the engine is idle between rounds after this
    backend.comm = recorder
    try:
        out = hvd.allreduce(torch.full((n,), 0.5, dtype=dtype), op=hvd.Sum, name=f"half.wire.{dtype}.{n}")
    finally:
        backend.comm = recorder._comm
    assert torch.equal(out, torch.full((n,), 0.5 * hvd.size(), dtype=dtype))
    assert recorder.calls, "the allreduce did not go through the backend's communicator"
    assert all(item == 2 for _, item in recorder.calls), recorder.calls
    assert sum(count * item for count, item in recorder.calls) == 2 * n


def test_reducescatter_bfloat16():
    require_half_wire()
    n = hvd.size()
    t = torch.arange(4 * n, dtype=torch.float32).to(torch.bfloat16) + hvd.rank()
    out = hvd.reducescatter(t, op=hvd.Sum, name="half.rs")
    rows = 4 * n // n
    me = hvd.rank()
    want = (torch.arange(4 * n, dtype=torch.float32) * n + sum(range(n)))[me * rows:(me + 1) * rows]
    torch.testing.assert_close(out, want.to(torch.bfloat16))
