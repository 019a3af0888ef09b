"""Values, dtypes, shapes and errors of every collective, checked on every rank."""

from __future__ import annotations

import time

import pytest
import torch

import hora.torch as hvd
from hora.core import runtime
from hora.errors import HoraError, MismatchError

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def rank_tensor(shape, dtype, offset=0):
    """A tensor whose value depends on the rank, exactly representable in every dtype."""
    r = hvd.rank()
    return (torch.arange(int(torch.tensor(shape).prod())).reshape(shape) % 5 + r + offset).to(dtype)


def expected_sum(shape, dtype):
    n = hvd.size()
    base = torch.arange(int(torch.tensor(shape).prod())).reshape(shape) % 5
    return (base * n + sum(range(n))).to(dtype)


@pytest.mark.parametrize("dtype", FLOATS + INTS)
@pytest.mark.parametrize("shape", [(17,), (3, 4, 5), (0,)])
def test_allreduce_sum_dtypes(dtype, shape):
    t = rank_tensor(shape, dtype)
    out = hvd.allreduce(t, op=hvd.Sum, name=f"sum.{dtype}.{shape}")
    assert out.dtype == dtype and out.shape == t.shape
    torch.testing.assert_close(out, expected_sum(shape, dtype))


@pytest.mark.parametrize("dtype", FLOATS)
def test_allreduce_average(dtype):
    t = rank_tensor((4, 6), dtype)
    out = hvd.allreduce(t)
    exp = expected_sum((4, 6), torch.float64) / hvd.size()
    torch.testing.assert_close(out.double(), exp, atol=1e-2, rtol=1e-2)


def test_allreduce_min_max_product():
    r, n = hvd.rank(), hvd.size()
    t = torch.tensor([r + 1.0, -r, 2.0])
    assert hvd.allreduce(t, op=hvd.Min).tolist() == [1.0, -(n - 1), 2.0]
    assert hvd.allreduce(t, op=hvd.Max).tolist() == [float(n), 0.0, 2.0]
    prod = 1.0
    for i in range(n):
        prod *= i + 1
    assert hvd.allreduce(t, op=hvd.Product).tolist()[0] == prod


def test_allreduce_bool_is_logical():
    r = hvd.rank()
    t = torch.tensor([True, r == 0, False])
    assert hvd.allreduce(t, op=hvd.Sum).tolist() == [True, True, False]
    assert hvd.allreduce(t, op=hvd.Min).tolist() == [True, hvd.size() == 1, False]


def test_integer_average_truncates():
    out = hvd.allreduce(torch.full((3,), 2 * hvd.rank() + 1, dtype=torch.int32), op=hvd.Average)
    n = hvd.size()
    assert out.tolist() == [int(sum(2 * i + 1 for i in range(n)) / n)] * 3


def test_prescale_postscale():
    t = torch.ones(5)
    out = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert out.tolist() == [hvd.size() * 0.5] * 5
    avg = hvd.allreduce(t, op=hvd.Average, prescale_factor=3.0)
    torch.testing.assert_close(avg, torch.full((5,), 3.0))


def test_allreduce_inplace_and_async():
    t = rank_tensor((8,), torch.float32)
    h = hvd.allreduce_async_(t, op=hvd.Sum, name="inplace.async")
    out = hvd.synchronize(h)
    assert out is t
    torch.testing.assert_close(t, expected_sum((8,), torch.float32))
    src = rank_tensor((8,), torch.float32)
    h = hvd.allreduce_async(src, op=hvd.Sum)
    res = hvd.synchronize(h)
    torch.testing.assert_close(src, rank_tensor((8,), torch.float32))  # input untouched
    torch.testing.assert_close(res, expected_sum((8,), torch.float32))


def test_poll_eventually_true():
    h = hvd.allreduce_async(torch.ones(3), name="poll")
    deadline = time.monotonic() + 10
    while not hvd.poll(h):
        assert time.monotonic() < deadline, "poll() never became true"
        time.sleep(0.001)
    hvd.synchronize(h)


def test_noncontiguous_inputs():
    base = rank_tensor((6, 4), torch.float32)
    t = base.t()  # non-contiguous view
    assert not t.is_contiguous()
    out = hvd.allreduce(t, op=hvd.Sum)
    torch.testing.assert_close(out, expected_sum((6, 4), torch.float32).t())
    inplace = rank_tensor((6, 4), torch.float32).t()
    hvd.allreduce_(inplace, op=hvd.Sum)
    torch.testing.assert_close(inplace, expected_sum((6, 4), torch.float32).t())


def test_many_small_tensors_fused():
    tensors = [rank_tensor((i + 1,), torch.float32) for i in range(50)]
    handles = [hvd.allreduce_async(t, op=hvd.Sum, name=f"fuse.{i}") for i, t in enumerate(tensors)]
    for i, h in enumerate(handles):
        torch.testing.assert_close(hvd.synchronize(h), expected_sum((i + 1,), torch.float32))


def test_round_with_more_fused_bytes_than_the_fusion_buffer():
    """Many fused buckets and direct tensors in one round: gloo keeps them in flight together,
    and a full fusion buffer is drained before it is reused."""
    executor = runtime.current().engine._executor
    saved = executor.fusion_threshold
    executor.fusion_threshold = 64 * 1024  # every rank alike; the names below are new, so plans are fresh
    try:
        shapes = [(3000,), (70_000,), (5000,), (300_000,), (12, 1000), (9000,), (2,)] * 3
        dtypes = [torch.float32, torch.float16, torch.float64]
        tensors = [rank_tensor(s, dtypes[i % 3]) for i, s in enumerate(shapes)]
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"drain.{i}") for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)
    finally:
        executor.fusion_threshold = saved
    for i, (s, t) in enumerate(zip(shapes, tensors, strict=True)):
        torch.testing.assert_close(t, expected_sum(s, dtypes[i % 3]))


def test_large_tensor():
    t = torch.full((3_000_000,), float(hvd.rank()))
    out = hvd.allreduce(t, op=hvd.Sum)
    assert float(out[0]) == float(out[-1]) == float(sum(range(hvd.size())))


def test_tensor_split_over_connections():
    """gloo cuts a tensor of several times split_bytes into pieces in flight on different devices:
    every element must still land in its place, for every op and an odd length."""
    n = 4_500_001  # float64: 36 MB, uneven pieces
    t = rank_tensor((n,), torch.float64)
    hvd.allreduce_(t, op=hvd.Sum, name="split.sum")
    torch.testing.assert_close(t, expected_sum((n,), torch.float64), rtol=0, atol=0)
    m = rank_tensor((n,), torch.float64)
    out = hvd.allreduce(m, op=hvd.Max, name="split.max")
    torch.testing.assert_close(out, rank_tensor((n,), torch.float64, offset=hvd.size() - 1 - hvd.rank()))
    avg = hvd.allreduce(torch.full((n,), float(hvd.rank())), op=hvd.Average, name="split.avg")
    assert torch.all(avg == (hvd.size() - 1) / 2)


def test_grouped_allreduce():
    ts = [rank_tensor((3,), torch.float32), rank_tensor((2, 2), torch.float64)]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum)
    torch.testing.assert_close(outs[0], expected_sum((3,), torch.float32))
    torch.testing.assert_close(outs[1], expected_sum((2, 2), torch.float64))
    hvd.grouped_allreduce_(ts, op=hvd.Sum)
    torch.testing.assert_close(ts[1], expected_sum((2, 2), torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool, torch.bfloat16])
def test_allgather_variable_first_dim(dtype):
    r, n = hvd.rank(), hvd.size()
    t = torch.full((r + 1, 3), r).to(dtype)
    out = hvd.allgather(t)
    assert out.shape == (sum(range(1, n + 1)), 3)
    expected = torch.cat([torch.full((i + 1, 3), i).to(dtype) for i in range(n)])
    assert torch.equal(out, expected)


def test_allgather_empty_on_some_ranks():
    r = hvd.rank()
    t = torch.ones((0 if r == 0 else 2, 2))
    out = hvd.allgather(t)
    assert out.shape == (2 * (hvd.size() - 1), 2)


def test_grouped_allgather():
    r = hvd.rank()
    outs = hvd.grouped_allgather([torch.full((1,), float(r)), torch.full((2, 2), r, dtype=torch.int32)])
    assert outs[0].tolist() == [float(i) for i in range(hvd.size())]
    assert outs[1].shape == (2 * hvd.size(), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.bool, torch.float16])
def test_broadcast(dtype):
    n = hvd.size()
    for root in range(n):
        t = torch.full((4, 2), hvd.rank()).to(dtype)
        out = hvd.broadcast(t, root_rank=root)
        assert torch.equal(out, torch.full((4, 2), root).to(dtype))
        assert torch.equal(t, torch.full((4, 2), hvd.rank()).to(dtype))  # out-of-place
        hvd.broadcast_(t, root_rank=root)
        assert torch.equal(t, torch.full((4, 2), root).to(dtype))


def test_alltoall_equal_and_splits():
    r, n = hvd.rank(), hvd.size()
    t = torch.arange(n * 2, dtype=torch.float32) + 100 * r
    out = hvd.alltoall(t)  # without splits, Horovod returns only the tensor
    assert out.tolist() == [float(100 * j + 2 * r + k) for j in range(n) for k in range(2)]
    # rank r sends j+1 rows to rank j
    rows = [j + 1 for j in range(n)]
    t = torch.cat([torch.full((j + 1, 2), float(10 * r + j)) for j in range(n)])
    out, received = hvd.alltoall(t, splits=rows)
    assert received.tolist() == [r + 1] * n
    assert out.shape == ((r + 1) * n, 2)
    assert out[:, 0].tolist() == [float(10 * j + r) for j in range(n) for _ in range(r + 1)]


def test_reducescatter():
    r, n = hvd.rank(), hvd.size()
    rows = 2 * n + 1  # not divisible: the first rank gets one row more
    t = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + r
    out = hvd.reducescatter(t, op=hvd.Sum)
    mine = 3 if r == 0 else 2
    start = 0 if r == 0 else 3 + 2 * (r - 1)
    full = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * n + sum(range(n))
    assert out.shape == (mine, 2)
    torch.testing.assert_close(out, full[start : start + mine])
    avg = hvd.reducescatter(t, op=hvd.Average)
    torch.testing.assert_close(avg, full[start : start + mine] / n)
    outs = hvd.grouped_reducescatter([t, t.double()], op=hvd.Sum)
    torch.testing.assert_close(outs[1], full[start : start + mine].double())


def test_barrier_and_objects():
    hvd.barrier()
    obj = {"rank": hvd.rank(), "list": [1, 2, 3]}
    assert hvd.broadcast_object(obj, root_rank=0) == {"rank": 0, "list": [1, 2, 3]}
    assert hvd.allgather_object(hvd.rank() * 10) == [i * 10 for i in range(hvd.size())]


# ---------------------------------------------------------------- errors
def _expect_mismatch(fn, *fragments):
    start = time.monotonic()
    with pytest.raises(MismatchError) as info:
        fn()
    assert time.monotonic() - start < 10, "the error took too long"
    for frag in fragments:
        assert frag in str(info.value), str(info.value)
    return info.value


def test_error_shape_mismatch():
    r = hvd.rank()
    err = _expect_mismatch(lambda: hvd.allreduce(torch.ones(2 + r), name="bad.shape"), "bad.shape", "shape",
                           "rank 0: (2,)")
    assert isinstance(err, RuntimeError)  # Horovod scripts catch RuntimeError


def test_steady_state_then_changed_shape_on_one_rank():
    """A name reused in a loop runs on its cached id; a later shape change on one rank is still caught."""
    t = torch.full((8,), float(hvd.rank() + 1))
    for i in range(50):
        out = hvd.allreduce(t * (i + 1), op=hvd.Sum, name="steady")
        assert torch.equal(out, torch.full((8,), float(sum(range(1, hvd.size() + 1)) * (i + 1))))
    shape = 8 if hvd.rank() == 0 else 9
    _expect_mismatch(lambda: hvd.allreduce(torch.ones(shape), name="steady"), "steady", "shape")
    out = hvd.allreduce(torch.ones(8), op=hvd.Sum, name="steady")  # the engine is still usable afterwards
    assert torch.equal(out, torch.full((8,), float(hvd.size())))


def test_error_dtype_mismatch():
    dtype = torch.float32 if hvd.rank() == 0 else torch.int32
    _expect_mismatch(lambda: hvd.allreduce(torch.ones(3, dtype=dtype), name="bad.dtype"), "dtype", "float32",
                     "int32")


def test_error_op_mismatch():
    op = hvd.Sum if hvd.rank() == 0 else hvd.Max
    _expect_mismatch(lambda: hvd.allreduce(torch.ones(3), op=op, name="bad.op"), "op", "SUM", "MAX")


def test_error_root_mismatch():
    _expect_mismatch(lambda: hvd.broadcast(torch.ones(3), root_rank=hvd.rank(), name="bad.root"), "root")


def test_error_allgather_trailing_shape():
    _expect_mismatch(lambda: hvd.allgather(torch.ones(2, 1 + hvd.rank()), name="bad.gather"), "shape")


def test_error_kind_mismatch():
    def go():
        if hvd.rank() == 0:
            hvd.allreduce(torch.ones(2), name="bad.kind")
        else:
            hvd.allgather(torch.ones(2), name="bad.kind")

    _expect_mismatch(go, "allreduce", "allgather")


def test_recovers_after_errors():
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


def test_duplicate_name_in_flight():
    t = torch.ones(2)
    if hvd.rank() == 0:
        h = hvd.allreduce_async(t, name="dup")  # cannot finish: the other ranks submit it later
        with pytest.raises(ValueError, match="same name|already in flight|not been synchronized"):
            hvd.allreduce_async(t, name="dup")
        hvd.barrier()
    else:
        hvd.barrier()
        h = hvd.allreduce_async(t, name="dup")
    assert hvd.synchronize(h).tolist() == [1.0, 1.0]


def test_local_argument_errors():
    with pytest.raises(TypeError, match="dtype"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.ones(2), root_rank=hvd.size() + 3)
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(torch.ones(5), splits=[5] + [1] * (hvd.size() - 1))
    with pytest.raises(HoraError, match="Adasum"):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)


# ------------------------------------------------------------- autograd
def test_allreduce_autograd():
    x = torch.ones(3, requires_grad=True)
    y = hvd.allreduce(x * (hvd.rank() + 1), op=hvd.Sum)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), float(hvd.size() * (hvd.rank() + 1))))


def test_allgather_autograd():
    r = hvd.rank()
    x = torch.ones(r + 1, 2, requires_grad=True)
    out = hvd.allgather(x)
    (out * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((r + 1, 2), 2.0))


def test_broadcast_autograd():
    x = torch.ones(3, requires_grad=True)
    hvd.broadcast(x, root_rank=0).sum().backward()
    expected = 1.0 if hvd.rank() == 0 else 0.0
    torch.testing.assert_close(x.grad, torch.full((3,), expected))


# ---------------------------------------------------------- process sets
def test_process_sets():
    n = hvd.size()
    evens = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    try:
        if evens.included():
            out = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=evens)
            assert out.tolist() == [float(len(evens.ranks))] * 2
            g = hvd.allgather(torch.tensor([hvd.rank()]), process_set=evens)
            assert g.tolist() == evens.ranks
            b = hvd.broadcast(torch.tensor([hvd.rank()]), root_rank=evens.ranks[-1], process_set=evens)
            assert b.tolist() == [evens.ranks[-1]]
        else:
            assert evens.rank() is None
        # the global set keeps working alongside
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n
        with pytest.raises(HoraError, match="already registered"):
            hvd.add_process_set(list(evens.ranks))
    finally:
        assert hvd.remove_process_set(evens)


def test_join_uneven_batches():
    r, n = hvd.rank(), hvd.size()
    batches = 3 + r  # the last rank has the most
    for i in range(batches):
        out = hvd.allreduce(torch.ones(4), op=hvd.Sum, name="join.grad")
        active = sum(1 for k in range(n) if i < 3 + k)
        assert out.tolist() == [float(active)] * 4, (i, out)
    last = hvd.join()
    assert last == n - 1
    # everything works normally after join
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n
