"""hora.torch.DistributedOptimizer(kvstore=...) in one process, on the 'local' store."""

from __future__ import annotations

import copy

import pytest
import torch

import hora.kvstore as kvs
import hora.torch as hvd
from hora.errors import ConfigError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 5) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("server", [None, "auto"])
@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-3),
], ids=["sgd", "adam"])
def test_local_store_matches_plain_torch(make, server):
    """One worker: the KVStore path (update on the worker or in the store) equals plain torch."""
    ref = _model()
    _train(ref, make(ref.parameters()))

    model = _model()
    opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                   kvstore="local", server_optimizer=server)
    _train(model, opt)
    # Adam's epsilon sits in a slightly different place in MXNet's rule than in torch's.
    tol = 1e-5 if server is None else 1e-4
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, atol=tol), f"{name}: max diff {(a - b).abs().max():.3g}"


def test_init_makes_store_value_the_starting_point():
    """The weights stored by init() are pulled back into the model (the KVStore's broadcast)."""
    model = _model()
    kv = kvs.create("local")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kvstore=kv,
                                   named_parameters=model.named_parameters())
    out = torch.empty_like(model[0].weight)
    kv.pull("0.weight", out=out)
    assert torch.equal(out, model[0].weight)
    assert opt.kvstore is kv


def test_unused_parameter_gets_zero_gradient_pushed():
    model = _model()
    extra = torch.nn.Parameter(torch.ones(2))
    params = [*model.parameters(), extra]
    before = extra.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), kvstore="local")
    _train(model, opt, steps=2)
    assert torch.equal(extra.detach(), before)
    assert extra.grad is not None and torch.count_nonzero(extra.grad) == 0


def test_allreduce_only_options_are_rejected():
    model = _model()
    with pytest.raises(ValueError, match="compression"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kvstore="local",
                                 compression=hvd.Compression.fp16)
    with pytest.raises(ValueError, match="needs kvstore"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), server_optimizer="auto")


def test_server_optimizer_refuses_what_it_cannot_express():
    model = _model()
    with pytest.raises(ConfigError, match="nesterov"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
                                 kvstore="local", server_optimizer="auto")
    with pytest.raises(ConfigError, match="RMSprop"):
        hvd.DistributedOptimizer(torch.optim.RMSprop(model.parameters()), kvstore="local", server_optimizer="auto")
    groups = [{"params": list(model[0].parameters()), "lr": 0.1}, {"params": list(model[2].parameters()), "lr": 1}]
    with pytest.raises(ConfigError, match="param groups"):
        hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1), kvstore="local", server_optimizer="auto")


def test_zero_grad_between_backward_and_step_is_an_error():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kvstore="local")
    model(torch.randn(2, 6)).sum().backward()
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_backward_passes_per_step_accumulates_locally():
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = copy.deepcopy(ref)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kvstore="local",
                                   backward_passes_per_step=2)
    x = torch.randn(4, 6)
    for m, o in ((ref, ref_opt), (model, opt)):
        o.zero_grad()
        m(x[:2]).sum().backward()
        m(x[2:]).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
