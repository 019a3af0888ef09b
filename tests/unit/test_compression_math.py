"""The compressors' math on fixed inputs, in one process (NumPy and torch buffers).

On one rank an allreduce returns its input, so what a compressor returns is
exactly what it sent: the tests check the approximation itself, the error
feedback bookkeeping, the fused layouts and the saved state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hora.torch as hvd
from hora.core.buffers.numpy_ops import NUMPY
from hora.core.buffers.torch_ops import TORCH
from hora.core.compression import Compression, ErrorFeedback, PowerSGD, parse_spec
from hora.core.compression.exchange import FlatLayout, fingerprint, tensor_digest
from hora.core.compression.powersgd import matrix_rank
from hora.core.ops import ReduceOp
from hora.errors import ConfigError

FAMILIES = ["numpy", "torch"]


@pytest.fixture(scope="module", autouse=True)
def engine():
    # init() fills in the global set's ranks and shutdown() keeps them: put back what later tests expect.
    before = (hvd.global_process_set.ranks, hvd.global_process_set.process_set_id)
    hvd.init()
    yield
    hvd.shutdown()
    hvd.global_process_set.ranks, hvd.global_process_set.process_set_id = before


def _as(family: str, a: np.ndarray):
    return a.copy() if family == "numpy" else torch.from_numpy(a.copy())


def _np(t) -> np.ndarray:
    return np.asarray(t)


def _low_rank(rng: np.random.Generator, shape: tuple[int, ...], r: int) -> np.ndarray:
    n, m = shape[0], int(np.prod(shape[1:]))
    return (rng.standard_normal((n, r)) @ rng.standard_normal((r, m))).reshape(shape)


@pytest.mark.parametrize("family", FAMILIES)
def test_rank_r_matrix_is_recovered_exactly(family):
    """A rank-r matrix (and a conv kernel of rank r as out x rest) survives a rank-r PowerSGD step."""
    rng = np.random.default_rng(1)
    shapes = [(64, 48), (64, 48), (32, 8, 3, 3), (50, 20)]
    grads = [_low_rank(rng, s, 3) for s in shapes]
    tensors = [_as(family, g) for g in grads]
    c = PowerSGD(rank=3, error_feedback=False)
    c.reduce(tensors, [f"t{i}" for i in range(len(shapes))])
    for g, t in zip(grads, tensors, strict=True):
        np.testing.assert_allclose(_np(t), g, rtol=1e-9, atol=1e-9)
    # A matrix of higher rank is not recovered by a rank-3 step: the test above can fail.
    full = [rng.standard_normal((64, 48))]
    out = [_as(family, full[0])]
    PowerSGD(rank=3, error_feedback=False).reduce(out, ["f"])
    assert np.abs(_np(out[0]) - full[0]).max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("make", [lambda: Compression.fp16.with_error_feedback(),
                                  lambda: Compression.bf16.with_error_feedback(),
                                  lambda: PowerSGD(rank=1, min_compression_rate=0)],
                         ids=["fp16+ef", "bf16+ef", "powersgd"])
def test_error_feedback_keeps_sent_plus_residual_equal_to_true_sum(family, make):
    rng = np.random.default_rng(2)
    c = make()
    shapes = [(20, 30), (30,), (6, 4, 3)]
    names = ["a", "b", "c"]
    true_sum = [np.zeros(s) for s in shapes]
    sent_sum = [np.zeros(s) for s in shapes]
    for _ in range(6):
        grads = [rng.standard_normal(s) * 1e-3 + 1.0 / 3 for s in shapes]  # not representable in fp16/bf16
        tensors = [_as(family, g) for g in grads]
        c.reduce(tensors, names)
        for i in range(len(shapes)):
            true_sum[i] += grads[i]
            sent_sum[i] += _np(tensors[i])
    residual = c.state_dict()["tensors"]
    lost = 0.0
    for i, name in enumerate(names):
        res = _np(residual[name]["residual"]) if name in residual else 0.0
        np.testing.assert_allclose(sent_sum[i] + res, true_sum[i], rtol=0, atol=1e-9)
        lost = max(lost, float(np.abs(res).max()) if name in residual else 0.0)
    assert lost > 0, "the compressor lost nothing: the test would not see a broken residual"


def test_fused_layout_round_trips():
    rng = np.random.default_rng(3)
    shapes = [(3, 4), (5,), (2, 2, 2), (1,)]
    layout = FlatLayout.of(shapes)
    assert layout.total == 12 + 5 + 8 + 1 and layout.offsets == [0, 12, 17, 25]
    for ops, make in ((NUMPY, lambda a: a), (TORCH, torch.from_numpy)):
        sources = [make(rng.standard_normal(s)) for s in shapes]
        flat = ops.empty([layout.total + 3], "float64", ops.device(sources[0]))
        layout.pack(ops, sources, flat)
        for i, s in enumerate(sources):
            np.testing.assert_array_equal(_np(layout.view(ops, flat, i)), _np(s))
        outs = [ops.zeros(s, "float64", ops.device(sources[0])) for s in shapes]
        layout.unpack(ops, flat, outs)
        for o, s in zip(outs, sources, strict=True):
            np.testing.assert_array_equal(_np(o), _np(s))


@pytest.mark.parametrize("family", FAMILIES)
def test_powersgd_packs_p_and_q_of_all_tensors_into_one_buffer_each(family):
    """Same-shape matrices form one batch; P and Q of all batches tile their flat buffers, the uncompressed
    tensors follow the P; the P of each batch is the product M Q, computed straight into its place."""
    rng = np.random.default_rng(4)
    shapes = [(40, 30)] * 5 + [(30,), (16, 9), (8, 4, 3, 3), (2, 2)]
    grads = [rng.standard_normal(s) for s in shapes]
    c = PowerSGD(rank=2, error_feedback=False)
    c.reduce([_as(family, g) for g in grads], [f"t{i}" for i in range(len(shapes))])
    (g,) = c._groups
    assert [(b.n, b.m, b.r, b.count) for b in g.batches] == [(40, 30, 2, 5), (16, 9, 2, 1), (8, 36, 2, 1)]
    assert g.plain == [5, 8]  # the vector and the 2 x 2 (too small to gain 2x)
    assert g.p_total == sum(b.count * b.n * b.r for b in g.batches)
    assert g.q_total == sum(b.count * b.m * b.r for b in g.batches) == len(g.qflat)
    ends = [(b.p_offset, b.p_offset + b.count * b.n * b.r) for b in g.batches]
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))
    assert len(g.pflat) == g.p_total + 30 + 4
    # The uncompressed tail round-trips exactly.
    np.testing.assert_array_equal(_np(g.pflat[g.p_total : g.p_total + 30]), grads[5])


def test_matrix_rank_rules():
    assert matrix_rank((100,), 4, 2) == 0  # vectors travel uncompressed
    assert matrix_rank((1024, 1024), 4, 2) == 4
    assert matrix_rank((10, 3), 4, 0) == 3  # clipped to the matrix
    assert matrix_rank((10, 10), 4, 2) == 0  # (10 + 10) * 4 * 2 >= 100
    assert matrix_rank((64, 3, 3, 3), 2, 2) == 2  # a conv kernel as 64 x 27


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_before_start_step_then_compressed(family):
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal((50, 40)), rng.standard_normal(40)]
    c = PowerSGD(rank=1, start_step=2)
    for step in range(3):
        tensors = [_as(family, g) for g in grads]
        c.reduce(tensors, ["w", "b"], op=ReduceOp.SUM, prescale=2.0)
        np.testing.assert_allclose(_np(tensors[1]), 2 * grads[1])
        error = np.abs(_np(tensors[0]) - 2 * grads[0]).max()
        assert (error < 1e-12) == (step < 2), (step, error)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_rank_powersgd_equals_plain_sum(family):
    rng = np.random.default_rng(6)
    grads = [rng.standard_normal((12, 7)), rng.standard_normal((5, 9, 2))]
    tensors = [_as(family, g) for g in grads]
    PowerSGD(rank=12, min_compression_rate=0).reduce(tensors, ["a", "b"], op=ReduceOp.SUM)
    for g, t in zip(grads, tensors, strict=True):
        np.testing.assert_allclose(_np(t), g, atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=2, min_compression_rate=0),
                                  lambda: PowerSGD(rank=2, warm_start=False, min_compression_rate=0),
                                  lambda: ErrorFeedback("float16")], ids=["powersgd", "cold", "fp16+ef"])
def test_saved_state_continues_identically(family, make):
    rng = np.random.default_rng(7)
    steps = [[rng.standard_normal((20, 10)), rng.standard_normal((10,))] for _ in range(6)]
    a = make()
    for grads in steps[:3]:
        a.reduce([_as(family, g) for g in grads], ["w", "b"])
    saved = a.state_dict()
    b = make()
    b.load_state_dict(saved)
    for grads in steps[3:]:
        ta, tb = [_as(family, g) for g in grads], [_as(family, g) for g in grads]
        a.reduce(ta, ["w", "b"])
        b.reduce(tb, ["w", "b"])
        for x, y in zip(ta, tb, strict=True):
            np.testing.assert_array_equal(_np(x), _np(y))
    # A fresh compressor without the state does differ: the test can fail.
    c = make()
    tc = [_as(family, g) for g in steps[3]]
    c.reduce(tc, ["w", "b"])
    d = make()
    d.load_state_dict(saved)
    td = [_as(family, g) for g in steps[3]]
    d.reduce(td, ["w", "b"])
    assert np.abs(_np(tc[0]) - _np(td[0])).max() > 0


def test_residuals_of_another_rank_start_from_zero():
    c = PowerSGD(rank=1, min_compression_rate=0)
    c.reduce([np.random.default_rng(8).standard_normal((6, 5))], ["w"])
    saved = c.state_dict()
    assert np.abs(saved["tensors"]["w"]["residual"]).max() > 0
    foreign = {**saved, "rank": saved["rank"] + 1}
    d = PowerSGD(rank=1, min_compression_rate=0)
    d.reduce([np.zeros((6, 5))], ["w"])
    d.load_state_dict(foreign)
    state = d.state_dict()["tensors"]["w"]
    assert np.abs(state["residual"]).max() == 0
    np.testing.assert_array_equal(state["q"], saved["tensors"]["w"]["q"])  # the shared factor is kept


def test_clear_errors():
    c = PowerSGD(rank=2)
    with pytest.raises(ConfigError, match="op=MAX"):
        c.reduce([np.ones((4, 4))], ["w"], op=ReduceOp.MAX)
    with pytest.raises(ConfigError, match="allgather"):
        c.check_op(ReduceOp.SUM, kind="allgather")
    with pytest.raises(ConfigError, match="stateful"):
        c.compress(np.ones(3))
    with pytest.raises(ConfigError, match="rank=0"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="powersgd:RANK"):
        parse_spec("topk")
    assert isinstance(parse_spec("powersgd:4"), PowerSGD) and parse_spec("powersgd:4").rank == 4
    assert parse_spec("bf16") is Compression.bf16


@pytest.mark.parametrize("family", FAMILIES)
def test_stateless_casts_keep_horovods_api(family):
    x = _as(family, np.linspace(-1, 1, 7, dtype=np.float32))
    for comp, wire in ((Compression.fp16, "float16"), (Compression.bf16, "bfloat16")):
        sent, ctx = comp.compress(x)
        assert str(sent.dtype).endswith(wire) and ctx is not None
        back = comp.decompress(sent, ctx)
        assert str(back.dtype).endswith("float32")
        np.testing.assert_allclose(_np(back), _np(x), atol=1e-2)
    sent, ctx = Compression.none.compress(x)
    assert sent is x and Compression.none.decompress(sent, ctx) is x


def test_fingerprint_tells_step_settings_and_tensors_apart():
    tensors = [("0.weight", (4, 3), "float32"), ("0.bias", (4,), "float32")]
    base = {"kind": "powersgd", "rank": 2, "step": 3}
    d = fingerprint(base, tensors)
    assert 0 <= d < 2**31
    assert fingerprint(dict(reversed(base.items())), tensors) == d  # the order of the settings does not count
    assert fingerprint(base, tensor_digest(tensors)) == d  # a kept digest of the list gives the same value
    assert fingerprint({**base, "step": 4}, tensors) != d
    assert fingerprint({**base, "rank": 1}, tensors) != d
    assert fingerprint(base, [tensors[0], ("0.bias", (5,), "float32")]) != d


@pytest.mark.parametrize("family", FAMILIES)
def test_large_batches_written_straight_into_gradients_match_the_scratch_path(family, monkeypatch):
    """PowerSGD writes a large batch's approximation into the gradients; the result equals the scratch stack's."""
    import hora.core.compression.powersgd as powersgd

    shapes = [(20, 30), (20, 30), (6, 4, 3), (30,)]
    names = [f"t{i}" for i in range(len(shapes))]
    rng = np.random.default_rng(5)
    steps = [[rng.standard_normal(s) for s in shapes] for _ in range(3)]
    results = {}
    for direct in (False, True):
        monkeypatch.setattr(powersgd, "DIRECT_ELEMENTS", 0 if direct else 1 << 40)
        c = PowerSGD(rank=2, min_compression_rate=0)
        for grads in steps:
            tensors = [_as(family, g) for g in grads]
            c.reduce(tensors, names, op=ReduceOp.SUM, prescale=0.5)
        assert all(b.direct == direct for g in c._groups for b in g.batches)
        state = c.state_dict()["tensors"]
        results[direct] = [_np(t) for t in tensors] + [_np(state[n]["residual"]) for n in names[:3]]
    for a, b in zip(results[False], results[True], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_wire_buffers_reuse_one_buffer_per_gradient_and_cast_back_in_place(family):
    from hora.core.compression import WireBuffers

    wire = WireBuffers()
    x = _as(family, np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
    for comp, dtype in ((Compression.fp16, "float16"), (Compression.bf16, "bfloat16")):
        sent, ctx = wire.compress(comp, x, "w")
        again, _ = wire.compress(comp, x * 2, "w")
        assert again is sent and str(sent.dtype).endswith(dtype), "the wire buffer was not reused"
        out = _as(family, np.zeros((3, 4), np.float32))
        wire.decompress_into(comp, sent, ctx, out)
        np.testing.assert_allclose(_np(out), 2 * _np(x), atol=2e-2)
        other, _ = wire.compress(comp, x, "b")
        assert other is not sent
    # Not a built-in cast: the compressor's own methods, no buffer kept.
    sent, ctx = wire.compress(Compression.none, x, "w")
    assert sent is x and ctx is None

    class Negate(Compression.fp16):
        @staticmethod
        def compress(tensor):
            return -tensor, "neg"

        @staticmethod
        def decompress(tensor, ctx):
            return -tensor

    sent, ctx = wire.compress(Negate, x, "w")
    out = _as(family, np.zeros((3, 4), np.float32))
    wire.decompress_into(Negate, sent, ctx, out)
    np.testing.assert_allclose(_np(out), _np(x))
