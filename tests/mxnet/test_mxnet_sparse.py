"""row_sparse NDArrays on hora's parameter-server stores, 2 workers + 2 servers through ``hora run``."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import hora_run
from tests.mxnet.conftest import needs_mxnet

pytestmark = needs_mxnet

JOB = "tests/mxnet/scripts/ps_sparse_job.py"
SPLIT = {"HORA_PS_BIGARRAY_BOUND": "50"}  # the 40 x 3 keys are cut over both servers


@pytest.mark.timeout(200)
@pytest.mark.parametrize("args", [["--kv-store", "hora_dist_sync"], ["--kv-store", "hora_dist_async"],
                                  ["--kv-store", "hora_dist_sync", "--gluon"]],
                         ids=["dist_sync", "dist_async", "gluon"])
def test_row_sparse_keys(args):
    """init/push/pull/row_sparse_pull with repeated, unsorted and never-pushed rows; lazy SGD, Adam, AdaGrad and
    Ftrl bit for bit with MXNet's own updater; gluon's SparseEmbedding and Embedding(sparse_grad=True) train
    through the store (an mx.kv.KVStore) as one process does."""
    proc = hora_run(2, [sys.executable, JOB, *args], timeout=150, extra_args=["-s", "2"], env=SPLIT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    for rank in range(2):
        assert f"[{rank}]<stdout>:ps sparse ok ({args[1]}" in proc.stdout, out[-5000:]
