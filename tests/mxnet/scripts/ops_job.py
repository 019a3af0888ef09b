"""Every hora.mxnet collective on NDArrays, with its dtypes and its errors; run on 2 and 3 ranks by tests/mxnet.

Each rank prints ``mxnet ops ok`` at the end; any failed check raises, and
``hora run`` then fails the job.
"""

from __future__ import annotations

import itertools
import sys
import time

import mxnet as mx
import numpy as np

import hora.mxnet as hvd
from hora.errors import ArgumentError, MismatchError

DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
SHAPES = [(5,), (4, 3), (2, 3, 4)]  # legacy NDArrays have no 0-d shape


def expect(error: type[BaseException], fn, *args, must_name: str | None = None, **kwargs) -> BaseException:
    start = time.monotonic()
    try:
        out = fn(*args, **kwargs)
        if isinstance(out, mx.nd.NDArray):
            out.wait_to_read()
    except error as e:
        # seconds, not a hang; the bound leaves room for a loaded CI host (one negotiation round is milliseconds)
        assert time.monotonic() - start < 30, f"{fn.__name__} took {time.monotonic() - start:.1f}s to raise"
        if must_name is not None:
            assert must_name in str(e), f"the error does not name {must_name!r}: {e}"
        return e
    raise AssertionError(f"{fn.__name__} did not raise {error.__name__}")


def values(rank: int, shape: tuple[int, ...], dtype: str) -> mx.nd.NDArray:
    n = int(np.prod(shape))
    base = (np.arange(n) % 5 + rank + 1).reshape(shape)
    return mx.nd.array(base, dtype=dtype)


def check_allreduce(rank: int, size: int) -> None:
    ranks = range(size)
    for dtype, shape in itertools.product(DTYPES, SHAPES):
        x = values(rank, shape, dtype)
        every = [values(r, shape, dtype).asnumpy() for r in ranks]
        total = np.sum(every, axis=0, dtype=np.float64)
        got = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}.{len(shape)}")
        assert isinstance(got, mx.nd.NDArray) and got.dtype == x.dtype and got.shape == x.shape
        np.testing.assert_allclose(got.asnumpy(), total.astype(dtype), rtol=1e-3)
        assert (x.asnumpy() == every[rank]).all(), "allreduce changed its input"
        np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Min, name=f"min.{dtype}.{len(shape)}").asnumpy(),
                                      np.min(every, axis=0))
        np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Max, name=f"max.{dtype}.{len(shape)}").asnumpy(),
                                      np.max(every, axis=0))
        if dtype.startswith("float"):
            avg = hvd.allreduce(x, name=f"avg.{dtype}.{len(shape)}")  # Average is the default
            np.testing.assert_allclose(avg.asnumpy(), (total / size).astype(dtype), rtol=1e-3)
            scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                                   name=f"scaled.{dtype}.{len(shape)}")
            np.testing.assert_allclose(scaled.asnumpy(), (total * 1.5).astype(dtype), rtol=1e-3)
            prod = hvd.allreduce(x, op=hvd.Product, name=f"prod.{dtype}.{len(shape)}")
            np.testing.assert_allclose(prod.asnumpy(), np.prod(every, axis=0, dtype=np.float64).astype(dtype),
                                       rtol=1e-2)
        y = x.copy()
        assert hvd.allreduce_(y, average=False, name=f"inplace.{dtype}.{len(shape)}") is y
        np.testing.assert_allclose(y.asnumpy(), total.astype(dtype), rtol=1e-3)
    # integers are scaled in float64 and truncated, as in Horovod
    i = mx.nd.array([7, -7], dtype="int32")
    assert hvd.allreduce(i, op=hvd.Sum, prescale_factor=0.5, name="int.prescale").asnumpy().tolist() == [3 * size,
                                                                                                          -3 * size]
    # bool: Sum is "any", Min is "all"; Average is refused
    flags = mx.nd.array([rank == 0, True, False]).astype("bool")
    assert hvd.allreduce(flags, op=hvd.Sum, name="any").asnumpy().tolist() == [True, True, False]
    assert hvd.allreduce(flags, op=hvd.Min, name="all").asnumpy().tolist() == [size == 1, True, False]
    expect(TypeError, hvd.allreduce, flags, name="bool.avg")
    # grouped, out of place and in place, mixed dtypes
    group = [values(rank, (3,), "float32"), values(rank, (2, 2), "int64"), values(rank, (1,), "float64")]
    sums = [np.sum([values(r, tuple(g.shape), str(np.dtype(g.dtype))).asnumpy() for r in ranks], axis=0)
            for g in group]
    for got, want in zip(hvd.grouped_allreduce(group, op=hvd.Sum, name="group"), sums, strict=True):
        np.testing.assert_allclose(got.asnumpy(), want)
    out = hvd.grouped_allreduce_(group, average=True, name="group_")
    assert out == group
    for got, want in zip(group, sums, strict=True):
        np.testing.assert_allclose(got.asnumpy(), (want / size).astype(got.dtype), rtol=1e-6)
    # MXNet's lazy engine: an input still being computed, and an output read later by MXNet operators
    lazy = mx.nd.ones((64, 64)) * (rank + 1)
    reduced = hvd.allreduce(lazy, op=hvd.Sum, name="lazy")
    assert float((reduced * 2).sum().asscalar()) == 64 * 64 * 2 * sum(r + 1 for r in ranks)
    # argument errors
    expect(ValueError, hvd.allreduce, x, average=True, op=hvd.Sum)
    expect(TypeError, hvd.allreduce, np.ones(3))
    expect(NotImplementedError, hvd.allreduce, x, op=hvd.Adasum)


def check_allgather(rank: int, size: int) -> None:
    for dtype in DTYPES + ["bool"]:
        rows = mx.nd.array(np.full((rank + 1, 2), rank % 2), dtype=dtype)
        got = hvd.allgather(rows, name=f"gather.{dtype}")
        want = np.concatenate([np.full((r + 1, 2), r % 2) for r in range(size)]).astype(dtype)
        assert got.dtype == rows.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.asnumpy(), want)
    a, b = hvd.grouped_allgather([mx.nd.array([rank]), mx.nd.ones((1, 3), dtype="int32") * rank], name="ggather")
    assert a.asnumpy().tolist() == list(range(size))
    assert b.asnumpy()[:, 0].tolist() == list(range(size)) and b.dtype == np.int32
    expect(ValueError, hvd.allgather, mx.nd.array(1.0))


def check_broadcast(rank: int, size: int) -> None:
    root = size - 1
    for dtype in DTYPES + ["bool"]:
        x = mx.nd.array(np.full((2, 3), rank % 2 if dtype == "bool" else rank), dtype=dtype)
        got = hvd.broadcast(x, root_rank=root, name=f"bcast.{dtype}")
        np.testing.assert_array_equal(got.asnumpy(), np.full((2, 3), root % 2 if dtype == "bool" else root))
        assert (x.asnumpy() == (rank % 2 if dtype == "bool" else rank)).all(), "broadcast changed its input"
        assert hvd.broadcast_(x, root_rank=root, name=f"bcast_.{dtype}") is x
        np.testing.assert_array_equal(x.asnumpy(), got.asnumpy())
    expect(ValueError, hvd.broadcast, mx.nd.ones(2), root_rank=size)


def check_alltoall(rank: int, size: int) -> None:
    for dtype in ["int32", "int64", "float16", "float32", "float64"]:
        send = mx.nd.array(np.repeat(np.arange(size), rank + 1), dtype=dtype)  # rank+1 rows for every rank
        got, received = hvd.alltoall(send, splits=mx.nd.array([rank + 1] * size, dtype="int32"),
                                     name=f"a2a.{dtype}")
        assert received.dtype == np.int32 and received.asnumpy().tolist() == [r + 1 for r in range(size)]
        assert got.asnumpy().tolist() == [rank] * sum(r + 1 for r in range(size)) and got.dtype == send.dtype
    even = mx.nd.array(np.repeat(np.arange(size), 2)).reshape((size * 2, 1))
    assert hvd.alltoall(even, name="a2a.even").asnumpy().ravel().tolist() == [rank] * 2 * size
    # splits given as a list; rows past sum(splits) are not sent
    got, received = hvd.alltoall(mx.nd.ones((size + 2, 2)), splits=[1] * size, name="a2a.list")
    assert got.shape == (size, 2) and received.asnumpy().tolist() == [1] * size
    expect(ArgumentError, hvd.alltoall, mx.nd.ones(size + 1))  # not divisible
    expect(ArgumentError, hvd.alltoall, mx.nd.ones(size - 1), mx.nd.ones(size, dtype="int32"))  # too few rows
    expect(ValueError, hvd.alltoall, mx.nd.ones(size), mx.nd.ones(size, dtype="float32"))  # float splits


def check_reducescatter(rank: int, size: int) -> None:
    for dtype in ["int32", "int64", "float16", "float32", "float64"]:
        full = mx.nd.array(np.arange(size * 4 * 3).reshape(size * 4, 3) % 7, dtype=dtype)
        got = hvd.reducescatter(full, op=hvd.Sum, name=f"rs.{dtype}")
        np.testing.assert_allclose(got.asnumpy(), full.asnumpy()[rank * 4:(rank + 1) * 4] * size)
        if dtype.startswith("float"):
            avg = hvd.reducescatter(full, name=f"rs.avg.{dtype}", prescale_factor=2.0)
            np.testing.assert_allclose(avg.asnumpy(), full.asnumpy()[rank * 4:(rank + 1) * 4] * 2, rtol=1e-3)
    a, b = hvd.grouped_reducescatter([mx.nd.ones((size, 2)), mx.nd.ones((size * 2,), dtype="int64")], op=hvd.Sum,
                                     name="grs")
    assert a.asnumpy().tolist() == [[size, size]] and b.asnumpy().tolist() == [size, size]
    expect(ValueError, hvd.reducescatter, mx.nd.array(1.0))
    expect(NotImplementedError, hvd.reducescatter, mx.nd.ones(size), op=hvd.Max)


def check_objects_and_sets(rank: int, size: int) -> None:
    obj = hvd.broadcast_object({"rank": rank, "f": (lambda v: v + 1)} if rank == 0 else None, root_rank=0)
    assert obj["rank"] == 0 and obj["f"](1) == 2
    assert hvd.allgather_object({"r": rank}) == [{"r": r} for r in range(size)]
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    if rank % 2 == 0:
        got = hvd.allreduce(mx.nd.ones(3) * rank, op=hvd.Sum, process_set=evens, name="evens")
        assert got.asnumpy().tolist() == [float(sum(range(0, size, 2)))] * 3
        assert hvd.allgather(mx.nd.array([rank]), process_set=evens).asnumpy().tolist() == list(range(0, size, 2))
        assert hvd.broadcast_object(rank, root_rank=0, process_set=evens) == 0
    hvd.remove_process_set(evens)


def check_mismatches(rank: int, size: int) -> None:
    """Ranks that disagree raise on every rank, naming the tensor, and the next collective works."""
    expect(MismatchError, hvd.allreduce, mx.nd.ones((3 + rank, 2)), name="bad.shape", must_name="bad.shape")
    expect(MismatchError, hvd.allreduce, mx.nd.ones(4, dtype="int32" if rank % 2 else "float32"), name="bad.dtype",
           must_name="bad.dtype")
    expect(MismatchError, hvd.allreduce, mx.nd.ones(4), op=hvd.Max if rank else hvd.Min, name="bad.op",
           must_name="bad.op")
    expect(MismatchError, hvd.broadcast, mx.nd.ones(4), root_rank=rank, name="bad.root", must_name="bad.root")
    expect(MismatchError, hvd.allgather, mx.nd.ones((1, 2 + rank)), name="bad.gather", must_name="bad.gather")
    expect(MismatchError, hvd.alltoall, mx.nd.ones((size, 2 + rank)), name="bad.a2a", must_name="bad.a2a")
    assert hvd.allreduce(mx.nd.ones(2), op=hvd.Sum, name="after").asnumpy().tolist() == [size, size]


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert hvd.mpi_enabled() and not hvd.gloo_enabled() and 0 <= hvd.local_rank() < hvd.local_size()
    assert hvd.cross_size() == 1 and hvd.is_homogeneous()
    check_allreduce(rank, size)
    check_allgather(rank, size)
    check_broadcast(rank, size)
    check_alltoall(rank, size)
    check_reducescatter(rank, size)
    check_objects_and_sets(rank, size)
    if size > 1:
        check_mismatches(rank, size)
    assert "torch" not in sys.modules, "something imported torch"
    hvd.shutdown()
    print("mxnet ops ok")


if __name__ == "__main__":
    main()
