"""dist_sync_allreduce: one process here, and 2 ranks over gloo and MPI through `hora run`.

The rank-level checks live in tests/parallel/test_kvstore_allreduce.py; every
rank of the launched job runs them.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import hora.kvstore as kvs
from hora.core import runtime
from hora.errors import ConfigError


@pytest.fixture(scope="module")
def engine():
    """A one-rank engine for this module (left running if something else started it)."""
    started = not runtime.is_initialized()
    runtime.init()
    yield
    if started:
        runtime.shutdown()


def test_single_rank_store_behaves_like_local(engine):
    kv = kvs.create("dist_sync_allreduce")
    assert (kv.rank, kv.num_workers) == (0, 1)
    kv.init([1, 2], [torch.zeros(3), np.zeros(2, np.float64)])
    kv.set_optimizer({"type": "sgd", "learning_rate": 1.0})
    kv.push([1, 2], [[torch.ones(3), torch.ones(3)], np.full(2, 0.5)])
    a, b = torch.zeros(3), np.zeros(2)
    kv.pull([1, 2], out=[a, b])
    assert a.tolist() == [-2.0] * 3 and b.tolist() == [-0.5] * 2
    kv.barrier()
    kv.close()
    kv.close()  # idempotent


def test_single_rank_errors(engine):
    kv = kvs.create("dist_sync_allreduce")
    with pytest.raises(ConfigError, match="has not been initialised"):
        kv.push("x", np.zeros(1))
    with pytest.raises(ConfigError, match="no optimizer"):
        kv.save_optimizer_states("unused")
    with pytest.raises(ConfigError, match="valid types are: none, 2bit"):
        kv.set_gradient_compression({"type": "4bit"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_single_rank_cuda_values(engine):
    kv = kvs.create("dist_sync_allreduce")
    kv.init("w", torch.ones(6, device="cuda:0"))
    kv.set_optimizer(kvs.SGD(learning_rate=0.5, momentum=0.9))
    for _ in range(2):
        kv.push("w", [torch.ones(6, device="cuda:0"), torch.ones(6)])
    outs = [torch.zeros(6), torch.zeros(6, device="cuda:0")]
    kv.pull("w", out=outs)
    # mom = -0.5*2 = -1 -> w = 0; mom = 0.9*-1 - 1 = -1.9 -> w = -1.9
    torch.testing.assert_close(outs[0], torch.full((6,), -1.9))
    torch.testing.assert_close(outs[1].cpu(), torch.full((6,), -1.9))
    kv.close()


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_two_ranks(run_job, controller):
    proc = run_job(2, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                       "tests/parallel/test_kvstore_allreduce.py"], mpi=controller == "mpi", timeout=240)
    tail = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    for rank in range(2):
        assert any(line.startswith(f"[{rank}]<stdout>:") and " passed" in line and "failed" not in line
                   for line in proc.stdout.splitlines()), f"rank {rank} did not report its tests passing:\n{tail}"
