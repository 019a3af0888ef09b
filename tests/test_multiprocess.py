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


@pytest.mark.parametrize("np", [2, 3])
def test_float16_and_bfloat16_travel_16_bit_on_mpi_when_asked(run_job, np):
    # On one host the default keeps the float32 upcast (shared memory); HORA_MPI_HALF_OPS=1 forces 16-bit words,
    # as a job across hosts gets by default.
    proc = run_job(np, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rs",
                        "tests/parallel/test_half_wire.py"], mpi=True, timeout=300, env={"HORA_MPI_HALF_OPS": "1"})
    tail = (proc.stdout[-4000:] + proc.stderr[-4000:])
    assert proc.returncode == 0, tail
    assert "skipped" not in proc.stdout, tail
    check = ("import hora.torch as hvd; from hora.core import runtime; hvd.init(); "
             "print('half on wire', runtime.current().engine._backend_for('cpu').half_on_wire)")
    proc = run_job(2, [sys.executable, "-c", check], mpi=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("half on wire False") == 2, proc.stdout
