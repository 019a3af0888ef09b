"""Every collective on 2 and 3 ranks, under gloo and MPI, through `hora run`.

Each case launches one job in which every rank runs the rank-level tests in
tests/parallel/ (values, dtypes, shapes, autograd, process sets, join, and
errors raised on every rank when ranks disagree).
"""

from __future__ import annotations

import sys

import pytest

CASES = [(2, "gloo"), (3, "gloo"), (2, "mpi"), (3, "mpi")]


@pytest.mark.parametrize(("np", "controller"), CASES, ids=[f"{c}-np{n}" for n, c in CASES])
def test_rank_level_suite(run_job, np, controller):
    proc = run_job(np, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/parallel"],
                   mpi=controller == "mpi", timeout=300)
    tail = (proc.stdout[-4000:] + proc.stderr[-4000:])
    assert proc.returncode == 0, tail
    for rank in range(np):
        assert any(line.startswith(f"[{rank}]<stdout>:") and " passed" in line for line in proc.stdout.splitlines()), (
            f"rank {rank} did not report its tests passing:\n{tail}")


@pytest.mark.parametrize(("controller", "overlap"), [("mpi", "1"), ("mpi", "0"), ("gloo", "1")])
def test_training_with_and_without_overlap(run_job, controller, overlap):
    """DistributedOptimizer's two schedules: eager per-gradient allreduces from the hooks (overlap, the
    default with two or more cores per rank or on GPUs) and one grouped allreduce at step() (without)."""
    proc = run_job(2, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                       "tests/parallel/test_training.py", "tests/parallel/test_optimizer_schedule.py"],
                   mpi=controller == "mpi", timeout=300, env={"HORA_OVERLAP": overlap, "EXPECT_OVERLAP": overlap})
    tail = (proc.stdout[-4000:] + proc.stderr[-4000:])
    assert proc.returncode == 0, tail
    assert sum(" passed" in line for line in proc.stdout.splitlines()) == 2, tail
