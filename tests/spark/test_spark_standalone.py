"""A 2-rank ``hora.spark.run`` job on a real standalone Spark cluster that the test starts and stops itself.

``spark-class`` starts a master and a worker on free ports (REST server off);
teardown stops them by their PIDs and checks that they, and the executors
the worker started, are gone.
"""

from __future__ import annotations

import time

import pytest
from conftest import skip_without_spark, spark_session

skip_without_spark()

import psutil  # noqa: E402

import hora.spark  # noqa: E402
from hora.spark.driver import slot_count  # noqa: E402
from hora.spark.standalone import StandaloneCluster  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _children(pids):
    found = []
    for pid in pids:
        try:
            found += [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return found


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ranks():
    import torch

    import hora.torch as hvd

    hvd.init()
    return hvd.rank(), hvd.size(), hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()


@pytest.mark.timeout(600)
def test_two_ranks_on_a_standalone_master_and_worker():
    cluster = StandaloneCluster(cores=2, memory_mb=1024)
    cluster.start()
    pids = list(cluster.pids)
    executors = []
    try:
        with spark_session(cluster.url, **{"spark.executor.cores": "1", "spark.cores.max": "2"}) as spark:
            deadline = time.monotonic() + 180
            while slot_count(spark.sparkContext)[0] < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            executors = _children(pids)
            assert hora.spark.run(_ranks, num_proc=2, env={"HORA_STALL_CHECK_TIME_SECONDS": "10"}) == [
                (0, 2, 3.0), (1, 2, 3.0)]
    finally:
        cluster.stop()
    assert len(pids) == 2 and all(_gone(pid) for pid in pids), "the master or the worker is still running"
    deadline = time.monotonic() + 20
    while not all(_gone(pid) for pid in executors) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(_gone(pid) for pid in executors), "an executor outlived its worker"
