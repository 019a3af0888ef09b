"""``hora.spark.run(..., use_mpi=True)`` on a ``local-cluster[2,1,1024]`` Spark session: mpirun under Spark.

Rank 0's task runs mpirun; on this one host mpirun forks both ranks itself.
Every test has a timeout.
"""

from __future__ import annotations

import io
import time

import pytest
from conftest import rank_processes, run_raising_job, run_script_job, skip_without_spark

skip_without_spark()

import hora.spark  # noqa: E402
from hora.runner.launchers.mpi import mpi_launch_available  # noqa: E402

pytestmark = [pytest.mark.spark,
              pytest.mark.skipif(not mpi_launch_available(), reason="no mpirun or mpi4py: pip install 'hora[mpi]'")]

ENV = {"HORA_STALL_CHECK_TIME_SECONDS": "10", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "30"}


def _torch_ranks(offset):
    import os

    import torch

    import hora.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + offset)]), op=hvd.Sum).item()
    print(f"rank {hvd.rank()} of {hvd.size()} says hello", flush=True)
    return (hvd.rank(), hvd.local_rank(), hvd.size(), total, hvd.mpi_enabled(),
            os.environ.get("OMPI_COMM_WORLD_RANK"))


@pytest.mark.timeout(300)
def test_mpi_torch_results_come_in_rank_order_with_prefixed_output(spark):
    out = io.StringIO()
    results = hora.spark.run(_torch_ranks, args=(10,), num_proc=2, env=ENV, use_mpi=True, stdout=out)
    assert results == [(0, 0, 2, 21.0, True, "0"), (1, 1, 2, 21.0, True, "1")]
    lines = out.getvalue().splitlines()
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank {rank} of 2 says hello" in lines, lines


@pytest.mark.timeout(300)
def test_mpi_raising_rank_ends_the_job_within_10_s_with_its_traceback(spark):
    error, seconds, out = run_raising_job(ValueError("rank one gives up under MPI"), env=ENV, use_mpi=True)
    assert seconds < 10, out
    assert error.rank == 1 and error.exitcode == 1, str(error)
    assert "ValueError: rank one gives up under MPI" in error.traceback
    assert "one_rank_raises" in error.traceback
    assert isinstance(error.__cause__, ValueError)
    deadline = time.monotonic() + 10
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_processes(), "a rank outlived its job"


def _rows_seen():
    import numpy as np

    import hora.spark
    import hora.torch as hvd

    hvd.init()
    part = hora.spark.data()
    seen = np.concatenate([b["id"] for b in part.batches(64, columns=["id"], even=False)])
    return hvd.rank(), part.rank, sorted(int(i) for i in seen)


@pytest.mark.timeout(300)
def test_mpi_ranks_read_their_own_partitions_of_df(spark):
    df = spark.createDataFrame([(i, float(i)) for i in range(100)], "id long, x double")
    (r0, p0, seen0), (r1, p1, seen1) = hora.spark.run(_rows_seen, num_proc=2, df=df, env=ENV, use_mpi=True)
    assert (r0, p0, r1, p1) == (0, 0, 1, 1)
    assert not set(seen0) & set(seen1) and sorted(seen0 + seen1) == list(range(100))


@pytest.mark.timeout(300)
def test_mpi_runs_a_script_path_with_arguments(spark, tmp_path):
    assert run_script_job(tmp_path, env=ENV, use_mpi=True) == ["2.0 mpi --epochs 3"] * 2
