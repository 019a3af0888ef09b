"""A job that never imports torch: every collective on NumPy arrays through the core's entry point.

Run by tests/test_numpy_job.py under `hora run --mpi` with torch made unimportable.
Each rank prints ``numpy job ok`` at the end.
"""

from __future__ import annotations

import sys

import numpy as np

from hora.core import collectives, runtime
from hora.core.ops import CollectiveType as Kind
from hora.core.ops import ReduceOp
from hora.errors import MismatchError


def run(kind: Kind, tensors: list[np.ndarray], name: str, **kwargs) -> list:
    return collectives.submit(kind, tensors, name=name, **kwargs).wait()


def main() -> None:
    runtime.init()
    engine = runtime.current().engine
    rank, size = engine.rank, engine.size
    factors = np.arange(1, size + 1)

    # allreduce: average, in-place sum, an upcast dtype, bool, and a fused group of small arrays
    x = np.arange(6, dtype=np.float32).reshape(2, 3) * (rank + 1)
    out = run(Kind.ALLREDUCE, [x], "avg", op=ReduceOp.AVERAGE)[0]
    np.testing.assert_allclose(out, np.arange(6).reshape(2, 3) * factors.mean())
    assert x[0, 1] == rank + 1, "out-of-place allreduce changed its input"
    y = np.full(5, rank + 1, np.int64)
    run(Kind.ALLREDUCE, [y], "sum_inplace", inplace=True)
    assert y.tolist() == [int(factors.sum())] * 5, y
    h = np.full(4, 0.5 * (rank + 1), np.float16)
    np.testing.assert_allclose(run(Kind.ALLREDUCE, [h], "half", postscale=2.0)[0], np.full(4, factors.sum()))
    flags = np.array([rank == 0, False, True])
    assert run(Kind.ALLREDUCE, [flags], "any")[0].tolist() == [True, False, True]
    group = [np.full(n, float(rank), np.float64) for n in (1, 7, 100)]
    for g in run(Kind.ALLREDUCE, group, "fused", op=ReduceOp.MAX):
        assert (g == size - 1).all()

    # allgather with a different first dimension per rank
    rows = np.full((rank + 1, 2), rank, np.int32)
    gathered = run(Kind.ALLGATHER, [rows], "gather")[0]
    expected = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(size)])
    assert gathered.dtype == np.int32 and (gathered == expected).all(), gathered

    # broadcast from the last rank, out of place and in place
    b = np.full(3, float(rank), np.float32)
    assert run(Kind.BROADCAST, [b], "bcast", root=size - 1)[0].tolist() == [size - 1.0] * 3
    run(Kind.BROADCAST, [b], "bcast_", root=size - 1, inplace=True)
    assert b.tolist() == [size - 1.0] * 3

    # alltoall with uneven splits: rank r sends r + 1 rows to every rank
    send = np.full(((rank + 1) * size, 2), rank, np.float32)
    received, splits = run(Kind.ALLTOALL, [send], "a2a", splits=[[rank + 1] * size])[0]
    assert splits.tolist() == [r + 1 for r in range(size)], splits
    assert received.shape == (sum(r + 1 for r in range(size)), 2)

    # reducescatter: rank r keeps block r of the sum
    full = np.arange(size * 2, dtype=np.float32).reshape(size, 2)
    block = run(Kind.REDUCESCATTER, [full], "rs", op=ReduceOp.SUM)[0]
    np.testing.assert_allclose(block, full[rank : rank + 1] * size)

    # ranks that disagree on a shape: every rank raises, naming the tensor, and the job goes on
    bad = np.ones(3 + rank, np.float32)
    try:
        run(Kind.ALLREDUCE, [bad], "mismatched_tensor")
    except MismatchError as e:
        assert "mismatched_tensor" in str(e), e
        print(f"rank {rank} raised: {str(e).splitlines()[0]}")
    else:
        raise AssertionError("a shape mismatch across ranks did not raise")
    assert run(Kind.ALLREDUCE, [np.ones(2)], "after")[0].tolist() == [size, size]

    assert "torch" not in sys.modules, "something imported torch"
    runtime.shutdown()
    print("numpy job ok")


if __name__ == "__main__":
    main()
