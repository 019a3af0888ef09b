"""Stateful compression through hora.torch.DistributedOptimizer, on every rank of a job."""

from __future__ import annotations

import threading

import pytest
import torch

import hora.torch as hvd
from hora.errors import ConfigError, MismatchError


def _model(seed: int = 1234) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


def _train(compression, steps: int = 4, process_set=hvd.global_process_set, **kwargs) -> torch.nn.Module:
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   process_set=process_set, **kwargs)
    passes = kwargs.get("backward_passes_per_step", 1)
    loss_fn = torch.nn.CrossEntropyLoss()
    for s in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = _batch(s * passes + k, hvd.rank())
            loss_fn(model(x), y).backward()
        opt.step()
    return model


def _same_on_every_rank(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        gathered = hvd.allgather(p.detach().unsqueeze(0), name=f"check.{name}")
        for r in range(1, gathered.shape[0]):
            assert torch.equal(gathered[r], gathered[0]), f"{name} differs between rank 0 and rank {r}"


@pytest.mark.parametrize("make", [lambda: hvd.Compression.powersgd(rank=1, min_compression_rate=0),
                                  lambda: hvd.Compression.powersgd(rank=2, start_step=2),
                                  lambda: hvd.Compression.fp16.with_error_feedback(),
                                  lambda: hvd.Compression.bf16],
                         ids=["powersgd1", "powersgd2-start2", "fp16+ef", "bf16"])
def test_every_rank_ends_with_identical_weights(make):
    model = _train(make())
    _same_on_every_rank(model)
    # Compression changed the training: the plain run ends elsewhere (so the check above is not vacuous).
    plain = _train(hvd.Compression.none)
    assert any(not torch.allclose(p, q) for p, q in zip(model.parameters(), plain.parameters(), strict=True))


@pytest.mark.parametrize("options", [{}, {"op": hvd.Sum}, {"backward_passes_per_step": 2}, {"groups": 2},
                                     {"gradient_predivide_factor": 2.0}],
                         ids=["average", "sum", "passes2", "groups2", "predivide"])
def test_full_rank_powersgd_equals_plain_allreduce(options):
    full = hvd.Compression.powersgd(rank=64, min_compression_rate=0)
    compressed = _train(full, **options)
    plain = _train(hvd.Compression.none, **options)
    for (name, p), q in zip(compressed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=f"{name} differs from the plain allreduce")


def test_process_set_of_two_ranks():
    if hvd.size() < 3:
        pytest.skip("needs 3 ranks: a set of two, and one rank outside it")
    ps = hvd.add_process_set([0, 1])
    try:
        model = _train(hvd.Compression.powersgd(rank=64, min_compression_rate=0), process_set=ps)
        plain = _train(hvd.Compression.none, process_set=ps)
        if hvd.rank() in (0, 1):
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9)
    finally:
        hvd.remove_process_set(ps)


def test_state_dict_carries_the_compressor_and_broadcast_syncs_it():
    model = _model()
    comp = hvd.Compression.powersgd(rank=1, min_compression_rate=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=comp,
                                   named_parameters=model.named_parameters())
    x, y = _batch(0, hvd.rank())
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    state = opt.state_dict()
    assert state["hora_compression"]["step"] == 1
    assert set(state["hora_compression"]["tensors"]) == {"0.weight", "2.weight", "4.weight"}
    if hvd.rank() != 0:
        comp.step = 7  # out of step: the broadcast must bring it back
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert comp.step == 1
    residual = comp.state_dict()["tensors"]["0.weight"]["residual"]
    assert float(residual.abs().max()) == 0.0  # residuals restart from zero, on every rank


def _step_outcome(opt: hvd.DistributedOptimizer, model: torch.nn.Module, step: int) -> list[BaseException]:
    """One training step in a thread with a deadline: the exceptions it raised (a hang fails the test)."""
    x, y = _batch(step, hvd.rank())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            opt.step()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "a compressor state mismatch hung instead of raising"
    if outcome:
        opt.clear_pending()  # the failed step's gradients are abandoned
    return outcome


def test_settings_that_differ_fail_on_every_rank_naming_tensor_and_setting():
    model = _model()
    comp = hvd.Compression.powersgd(rank=1 + (hvd.rank() == 1), min_compression_rate=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=comp,
                                   named_parameters=model.named_parameters())
    outcome = _step_outcome(opt, model, 0)
    assert len(outcome) == 1 and isinstance(outcome[0], MismatchError), outcome
    message = str(outcome[0])
    assert "'0.weight'" in message and "'rank'" in message and "rank 1: 2" in message, message


def _powersgd_optimizer() -> tuple[torch.nn.Module, hvd.DistributedOptimizer, object]:
    model = _model()
    comp = hvd.Compression.powersgd(rank=1, start_step=2, min_compression_rate=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=comp,
                                   named_parameters=model.named_parameters())
    return model, opt, comp


def _fails_naming_the_step(outcome: list[BaseException], steps: dict[int, int]) -> None:
    assert len(outcome) == 1 and isinstance(outcome[0], MismatchError), outcome
    message = str(outcome[0])
    assert "'0.weight'" in message and "different steps" in message, message
    for r, s in steps.items():
        assert f"rank {r}: {s}" in message, message
    assert "load_state_dict" in message and "broadcast_optimizer_state" in message, message


def test_state_loaded_on_some_ranks_fails_at_the_next_step_then_a_sync_recovers():
    """Mid-training, rank 0 restores a checkpoint from before start_step (it would send plain gradients) while
    the other ranks go on past it (they would send P and Q): without a check they wait on each other."""
    model, opt, comp = _powersgd_optimizer()
    assert not _step_outcome(opt, model, 0)
    saved = opt.state_dict()
    assert saved["hora_compression"]["step"] == 1
    for s in range(1, 3):
        assert not _step_outcome(opt, model, s)
    if hvd.rank() == 0:
        opt.load_state_dict(saved)
    _fails_naming_the_step(_step_outcome(opt, model, 3), {0: 1, 1: 3})
    # Nothing was left in flight: the advice works, and the ranks then train in step.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert comp.step == 1
    for s in range(3, 5):
        assert not _step_outcome(opt, model, s)
    _same_on_every_rank(model)


def test_state_reset_on_some_ranks_fails_at_the_next_step():
    model, opt, comp = _powersgd_optimizer()
    for s in range(3):
        assert not _step_outcome(opt, model, s)
    if hvd.rank() == 1:
        comp.reset()
    _fails_naming_the_step(_step_outcome(opt, model, 3), {0: 3, 1: 0})
    # A reset on every rank brings them together again.
    comp.reset()
    assert not _step_outcome(opt, model, 4)


def test_unsupported_op_is_refused():
    model = _model()
    with pytest.raises(ConfigError, match="op=MAX"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Max,
                                 compression=hvd.Compression.powersgd(rank=1))
    with pytest.raises(ConfigError, match="stateful"):
        hvd.allreduce(torch.ones(4, 4), compression=hvd.Compression.powersgd(rank=1))
