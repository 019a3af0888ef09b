"""row_sparse keys through real parameter servers (``hora run -np 2 -s 2``), and their server-side merge."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from hora.kvstore.ps.placement import place
from hora.kvstore.ps.rows import merge_rows
from tests.conftest import hora_run

JOB = "tests/kvstore/ps_sparse_job.py"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_row_pushes_and_pulls_through_two_servers(mode):
    """Repeated and empty row pushes merge as dense pushes would; row pulls dedupe ids and return rows nobody
    pushed; lazy SGD and Adam move only the pushed rows; the key is cut over both servers."""
    proc = hora_run(2, [sys.executable, JOB, mode], timeout=150, extra_args=["-s", "2"],
                    env={"HORA_PS_BIGARRAY_BOUND": "50"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    for rank in range(2):
        assert f"[{rank}]<stdout>:SPARSE OK {mode}" in proc.stdout, out[-5000:]


@pytest.mark.timeout(200)
def test_torch_sparse_embedding_trains_as_dense():
    """nn.Embedding(sparse=True) through DistributedOptimizer(kvstore=dist_sync): row pushes, same weights as a
    dense embedding and as one process; pull_rows/row_sparse_pull with a tensor of row ids."""
    proc = hora_run(2, [sys.executable, "tests/kvstore/torch_sparse_job.py"], timeout=150, extra_args=["-s", "2"],
                    env={"HORA_PS_BIGARRAY_BOUND": "100"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    for rank in range(2):
        assert f"[{rank}]<stdout>:TORCH SPARSE OK" in proc.stdout, out[-5000:]


def test_merge_rows_sums_repeats_and_sorts():
    ids, rows = merge_rows([(np.array([5, 1, 5]), np.arange(6.0)), (np.array([1]), np.array([10.0, 20.0])),
                            (np.empty(0, np.int64), np.empty(0))], 2, np.dtype(np.float64))
    assert ids.tolist() == [1, 5]
    assert rows.tolist() == [[12.0, 23.0], [4.0, 6.0]]
    ids, rows = merge_rows([], 3, np.dtype(np.float32))
    assert ids.size == 0 and rows.shape == (0, 3) and rows.dtype == np.float32


def test_row_keys_are_cut_on_row_boundaries():
    shards = place("emb", 7 * 3, 2, 10, unit=3)
    assert [(s.lo, s.hi) for s in shards] == [(0, 9), (9, 21)]
    assert all(s.lo % 3 == 0 for s in shards)
    assert place("flat", 21, 2, 10) == place("flat", 21, 2, 10, unit=1)
