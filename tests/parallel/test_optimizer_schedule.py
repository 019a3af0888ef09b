"""When DistributedOptimizer submits its allreduces: from the hooks, or all at step().

tests/test_multiprocess.py runs this file with HORA_OVERLAP=1 and =0 and says
which one through EXPECT_OVERLAP; elsewhere both schedules must give the same
averaged gradients.
"""

from __future__ import annotations

import os

import pytest
import torch

import hora.torch as hvd
from hora.core import runtime
from hora.errors import HoraError


class _Mixed(torch.nn.Module):
    """float32 and float64 layers, plus a float16 parameter (divided after the sum) and an unused one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 4).double()
        self.h16 = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
        self.unused = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)).double())
        return h.sum() + (self.h16.float() * (x.sum() / 100)).sum()


def _grads_on(rank: int) -> tuple[_Mixed, dict[str, torch.Tensor]]:
    model = _Mixed()
    x = torch.arange(12, dtype=torch.float32).reshape(2, 6) * (rank + 1) / 10
    model(x).backward()
    return model, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_schedule_follows_the_engine():
    expected = os.environ.get("EXPECT_OVERLAP")
    if expected is None:
        pytest.skip("run by tests/test_multiprocess.py with HORA_OVERLAP set")
    overlap = runtime.current().engine.overlap
    assert overlap == (expected == "1")
    model = _Mixed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 6)).backward()
    used = [p for n, p in model.named_parameters() if n != "unused"]
    if overlap:  # each hook submitted its own allreduce
        assert len(opt._handles) == len(used) and not opt._deferred
    else:  # nothing submitted yet: step() sends them together
        assert not opt._handles and len(opt._deferred) == len(used)
    opt.step()
    assert not opt._handles and not opt._deferred


def test_averaged_gradients_of_mixed_dtypes_and_an_unused_parameter():
    n, r = hvd.size(), hvd.rank()
    per_rank = [_grads_on(k)[1] for k in range(n)]
    model = _Mixed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    x = torch.arange(12, dtype=torch.float32).reshape(2, 6) * (r + 1) / 10
    model(x).backward()
    opt.step()
    for name, p in model.named_parameters():
        if name == "unused":
            assert torch.equal(p.grad, torch.zeros(2)), "an unused parameter's gradient is reduced as zeros"
            continue
        want = sum(g[name].double() for g in per_rank) / n
        tol = 1e-3 if p.dtype == torch.float16 else 1e-6
        torch.testing.assert_close(p.grad.double(), want, rtol=tol, atol=tol, msg=f"gradient of {name}")
        assert p.grad.dtype == p.dtype


def test_second_backward_before_step_is_refused():
    model = _Mixed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 6)).backward()
    with pytest.raises(HoraError, match="backward_passes_per_step"):
        model(torch.ones(2, 6)).backward()
    with pytest.raises(HoraError, match="zero_grad"):
        opt.zero_grad()
    opt.step()
