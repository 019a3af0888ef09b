"""Data-parallel training is equivalent to large-batch training on one process."""

from __future__ import annotations

import torch

import hora.torch as hvd


def _model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(steps, batch, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (steps, batch), generator=g)
    return x, y


def test_data_parallel_equals_big_batch():
    """N ranks x batch B give the same parameters as 1 process x batch N*B after several SGD steps."""
    n, r = hvd.size(), hvd.rank()
    per_rank, steps = 4, 5
    x, y = _data(steps, per_rank * n)
    loss_fn = torch.nn.CrossEntropyLoss()

    reference = _model().double()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        ref_opt.zero_grad()
        loss_fn(reference(x[s]), y[s]).backward()
        ref_opt.step()

    model = _model().double()
    with torch.no_grad():  # different start on each rank: broadcast must fix it
        for p in model.parameters():
            p.add_(r)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    with torch.no_grad():
        for p, q in zip(model.parameters(), _model().double().parameters(), strict=True):
            p.copy_(q) if r == 0 else None
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for s in range(steps):
        opt.zero_grad()
        shard = slice(r * per_rank, (r + 1) * per_rank)
        loss_fn(model(x[s][shard]), y[s][shard]).backward()
        opt.step()

    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10, msg=f"parameter {name} diverged")


def test_optimizer_state_broadcast_and_unused_params():
    r = hvd.rank()
    model = _model()
    extra = torch.nn.Linear(3, 3)  # never used in forward: its gradient is forced to zero and still reduced
    params = list(model.named_parameters()) + [("extra." + k, v) for k, v in extra.named_parameters()]
    opt = torch.optim.Adam([p for _, p in params], lr=1e-2 * (r + 1))
    opt = hvd.DistributedOptimizer(opt, named_parameters=params)
    x = torch.randn(4, 8) + r
    model(x).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 1e-2
    exp_avg = opt.state_dict()["state"][0]["exp_avg"]
    gathered = hvd.allgather(exp_avg.unsqueeze(0))
    torch.testing.assert_close(gathered[0], gathered[-1])
    assert torch.count_nonzero(extra.weight.grad) == 0


def test_backward_passes_per_step_accumulates():
    n, r = hvd.size(), hvd.rank()
    w = torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                   backward_passes_per_step=2, op=hvd.Sum)
    for k in range(2):
        (w * (r + 1 + k)).sum().backward()
    opt.step()
    expected = -sum((i + 1) + (i + 2) for i in range(n))
    assert w.tolist() == [float(expected)] * 2


def test_average_with_predivide_factor_and_groups():
    """Averaging happens partly in the gradient hook; every split of the 1/size factor gives the mean."""
    n, r = hvd.size(), hvd.rank()
    mean = sum(range(1, n + 1)) / n
    for factor, groups in [(1.0, None), (2.0, None), (0.5, 1)]:
        a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0),
                                       named_parameters=[(f"pre{factor}.a", a), (f"pre{factor}.b", b)],
                                       gradient_predivide_factor=factor, groups=groups)
        ((a * (r + 1)).sum() + (b * (r + 1)).sum()).backward()
        opt.step()
        torch.testing.assert_close(a.detach(), torch.full((3,), -mean), msg=f"factor {factor}")
        torch.testing.assert_close(b.detach(), torch.full((2, 2), -mean), msg=f"factor {factor}")


def test_fp16_compression():
    w = torch.nn.Parameter(torch.ones(5))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w16", w)],
                                   compression=hvd.Compression.fp16)
    (w * (hvd.rank() + 1)).sum().backward()
    opt.step()
    mean = sum(range(1, hvd.size() + 1)) / hvd.size()
    torch.testing.assert_close(w.detach(), torch.full((5,), 1 - mean))
    assert w.grad.dtype == torch.float32


def test_sync_batch_norm_matches_global_batch():
    """Forward and backward of SyncBatchNorm on shards equal BatchNorm on the whole batch."""
    n, r = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(4 * n, 3, 5, generator=g, dtype=torch.float64)
    weights = torch.randn(4 * n, 3, 5, generator=g, dtype=torch.float64)
    mine = slice(4 * r, 4 * (r + 1))

    local = full[mine].clone().requires_grad_()
    bn = hvd.SyncBatchNorm(3).double()
    out = bn(local)
    (out * weights[mine]).sum().backward()

    ref_in = full.clone().requires_grad_()
    ref = torch.nn.BatchNorm1d(3).double()
    ref_out = ref(ref_in)
    (ref_out * weights).sum().backward()

    torch.testing.assert_close(out, ref_out[mine])
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    torch.testing.assert_close(local.grad, ref_in.grad[mine])
