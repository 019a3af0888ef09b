"""CUDA tensors through `hora run`: one rank on NCCL, and two ranks sharing one GPU.

Skipped without CUDA; the rank-level checks live in tests/parallel/test_cuda.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_single_rank_cuda_suite(run_job):
    proc = run_job(1, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                       "tests/parallel/test_cuda.py"], timeout=240)
    tail = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, tail


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_rank_cuda_suite(run_job):
    proc = run_job(2, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                       "tests/parallel/test_cuda.py"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("mpi", [False, True], ids=["gloo", "mpi"])
def test_two_ranks_on_one_gpu_fail_clearly(run_job, mpi):
    """NCCL refuses two ranks on one GPU: every rank gets hora's error naming the fix, and nothing hangs."""
    proc = run_job(2, [sys.executable, "tests/scripts/cuda_same_gpu.py"], mpi=mpi, timeout=120)
    output = proc.stdout + proc.stderr
    if mpi and "before any rank failed" in output:
        pytest.skip(f"mpirun could not start a job here: {output[-600:]}")
    assert proc.returncode != 0, output[-4000:]
    assert "BackendError" in output and "same GPU" in output and "set_device(hvd.local_rank())" in output, (
        output[-4000:])
