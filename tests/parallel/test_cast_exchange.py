"""fp16/bf16 through the flat cast exchange (hora.core.compression.cast), on every rank of a job."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hora.torch as hvd
from hora.core.compression.cast import CastExchange
from hora.errors import ConfigError, HoraError, MismatchError

SHAPES = [(7, 5), (5,), (3, 4, 2), (11,), (2, 3), (1,)]


class _Exact(torch.nn.Module):
    """Parameters whose gradient is a known integer tensor per rank (exact in fp16 and bf16, and its mean too)."""

    def __init__(self, unused: int | None = None) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s)) for s in SHAPES)
        self.unused = unused

    @staticmethod
    def grad(i: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * i + rank)
        return torch.randint(-20, 21, SHAPES[i], generator=g).float()

    def loss(self, rank: int) -> torch.Tensor:
        return sum((p * self.grad(i, rank)).sum() for i, p in enumerate(self.ps) if i != self.unused)


def _reduced(compression, flat: bool, passes: int = 1, unused_on_rank1: bool = False, **options) -> list:
    model = _Exact(unused=2 if unused_on_rank1 and hvd.rank() == 1 else None)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), compression=compression,
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                   **options)
    assert (opt._casts is not None) == ("groups" not in options), "the flat path is taken exactly without groups"
    if not flat:
        opt._casts = None
    for _ in range(passes):
        model.loss(hvd.rank()).backward()
    opt.synchronize()
    if flat and opt._casts is not None:
        assert not opt._wire._buffers, "no per-tensor wire buffer was made: the gradients went through the exchange"
    grads = [p.grad.clone() for p in model.ps]
    opt.remove_hooks()
    return grads


def _expected(i: int, op, wire: torch.dtype, passes: int = 1, unused_on_rank1: bool = False,
              predivide: float = 1.0) -> torch.Tensor:
    """The sum on the wire is exact (small integers); Average's division rounds once, to the wire dtype."""
    total = sum(_Exact.grad(i, r) * passes / predivide for r in range(hvd.size())
                if not (unused_on_rank1 and r == 1 and i == 2))
    if op != hvd.Average:
        return total
    return (total * (predivide / hvd.size())).to(wire).float()


@pytest.mark.parametrize("compression", [hvd.Compression.fp16, hvd.Compression.bf16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("options", [{}, {"op": hvd.Sum}, {"passes": 2}, {"gradient_predivide_factor": 2.0},
                                     {"unused_on_rank1": True}, {"groups": 2}],
                         ids=["average", "sum", "passes2", "predivide", "unused", "groups"])
def test_flat_casts_equal_the_per_tensor_path_and_the_exact_mean(compression, options):
    flat = _reduced(compression, True, **options)
    per_tensor = _reduced(compression, False, **options)
    op = options.get("op", hvd.Average)
    for i, (a, b) in enumerate(zip(flat, per_tensor, strict=True)):
        assert a.dtype == torch.float32 and a.shape == SHAPES[i]
        assert torch.equal(a, b), f"parameter {i}: the flat path differs from the per-tensor one"
        want = _expected(i, op, torch.float16 if compression is hvd.Compression.fp16 else torch.bfloat16,
                         options.get("passes", 1), options.get("unused_on_rank1", False),
                         options.get("gradient_predivide_factor", 1.0))
        assert torch.equal(a, want), f"parameter {i}: not the exact {op} of the ranks' gradients"


def test_a_second_backward_before_the_step_is_refused_and_zero_grad_too():
    model = _Exact()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), compression=hvd.Compression.fp16,
                                   named_parameters=model.named_parameters())
    model.loss(hvd.rank()).backward()
    with pytest.raises(HoraError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(HoraError, match="backward_passes_per_step"):
        model.loss(hvd.rank()).backward()
    opt.synchronize()  # the step still completes on every rank
    opt.zero_grad()  # and zero_grad is allowed again after it
    opt.remove_hooks()


def _arrays(family: str, rank: int, sizes=(300, 5, 1000, 2, 700)) -> list:
    out = []
    for i, n in enumerate(sizes):
        a = np.arange(n, dtype=np.float32) % 13 - 6 + i + rank
        out.append(torch.from_numpy(a) if family == "torch" else a)
    return out


@pytest.mark.parametrize("family", ["numpy", "torch"])
@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_chunks_are_sent_whatever_order_the_gradients_arrive_in(family, wire):
    rank, size = hvd.rank(), hvd.size()
    grads = _arrays(family, rank)
    keys = [f"g{i}" for i in range(len(grads))]
    # 512-byte chunks: several allreduces, so the order in which they fill differs between the ranks
    ex = CastExchange(wire, keys, grads, keys, op=hvd.Sum, chunk_bytes=512, process_set=None)
    # a chunk closes once it holds 512 wire bytes; a gradient is never split
    assert ex.chunk_names == ["allreduce.cast.g0..g0", "allreduce.cast.g1..g2", "allreduce.cast.g3..g4"]
    order = list(range(len(grads)))
    order = order[::-1] if rank % 2 else order
    for step in range(2):
        for i in order[:3]:  # the rest is added by finish(), from grad_of
            ex.add(keys[i], grads[i])
        assert ex.pending
        ex.finish(lambda k: grads[keys.index(k)])
        assert not ex.pending
        for i, g in enumerate(grads):
            want = sum(_arrays("numpy", r)[i] for r in range(size)) * (size ** step)
            np.testing.assert_array_equal(np.asarray(g), want, err_msg=f"step {step}, gradient {i}")


def test_a_gradient_reduced_elsewhere_is_sent_as_zeros_and_left_alone():
    grads = _arrays("torch", hvd.rank(), sizes=(10, 20))
    before = grads[1].clone()
    ex = CastExchange("float16", ["a", "b"], grads, ["a", "b"], op=hvd.Sum)
    ex.finish(lambda k: grads[0] if k == "a" else None)
    assert torch.equal(grads[1], before)
    want = sum(torch.from_numpy(_arrays("numpy", r, sizes=(10, 20))[0]) for r in range(hvd.size()))
    assert torch.equal(grads[0], want)


def test_ranks_whose_layouts_differ_fail_on_every_rank_then_the_next_step_works():
    rank = hvd.rank()
    bad = _arrays("torch", rank, sizes=(10, 20 + rank))
    ex = CastExchange("float16", ["a", "b"], bad, ["mm.a", "mm.b"], op=hvd.Sum)
    with pytest.raises(MismatchError, match="mm.a"):
        ex.finish(lambda k: bad[0] if k == "a" else bad[1])
    assert not ex.pending  # ready for a new step despite the failure
    good = _arrays("torch", rank, sizes=(10, 20))
    ex = CastExchange("float16", ["a", "b"], good, ["ok.a", "ok.b"], op=hvd.Average)
    ex.finish(lambda k: good[0] if k == "a" else good[1])
    want = sum(torch.from_numpy(_arrays("numpy", r, sizes=(10, 20))[1]) for r in range(hvd.size())) / hvd.size()
    torch.testing.assert_close(good[1], want, rtol=1e-3, atol=1e-3)


def test_bad_arguments_are_refused():
    grads = _arrays("torch", 0, sizes=(4,))
    with pytest.raises(ConfigError, match="Average or Sum"):
        CastExchange("float16", ["a"], grads, ["a"], op=hvd.Max)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        CastExchange("float16", ["a"], grads, ["a"], chunk_bytes=0)
    with pytest.raises(ConfigError, match="not floating"):
        CastExchange("float16", ["a"], [torch.ones(3, dtype=torch.int64)], ["a"])
    ex = CastExchange("float16", ["a"], grads, ["a"], op=hvd.Sum)
    ex.add("a", grads[0])
    with pytest.raises(ConfigError, match="added twice"):
        ex.add("a", grads[0])
    ex.finish(lambda k: grads[0])
