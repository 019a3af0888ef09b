"""``hora.spark.run(..., use_mpi=True)`` across two emulated hosts: MPI crosses hosts through the rsh agent.

A standalone Spark master runs on this machine's bridge address; one worker
(1 core) runs inside each of two network namespaces (``h1``, ``h2``, own
hostnames) of :class:`hora.testing.emulate.EmulatedCluster`.  Rank 0's task
runs mpirun, which starts Open MPI's daemon on the other host through that
host's Spark task, with no ssh.  Everything is stopped by PID at teardown and
the namespaces are removed.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from conftest import run_raising_job, skip_without_spark, spark_session

skip_without_spark()

import hora.spark  # noqa: E402
from hora.runner.env import free_port  # noqa: E402
from hora.runner.launchers.mpi import mpi_launch_available  # noqa: E402
from hora.spark.driver import slot_count  # noqa: E402
from hora.spark.standalone import DAEMON_MEMORY, spark_home  # noqa: E402
from hora.testing.emulate import ClusterUnavailable, EmulatedCluster  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.netns, pytest.mark.slow,
              pytest.mark.skipif(not mpi_launch_available(), reason="no mpirun or mpi4py: pip install 'hora[mpi]'")]


ENV = {"HORA_STALL_CHECK_TIME_SECONDS": "10", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "30"}


def _spawn(argv, log_path, env, cluster=None, host=None):
    log = open(log_path, "wb")
    try:
        if cluster is not None:
            return cluster.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        log.close()


def _stop(processes):
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    try:
        cluster = EmulatedCluster(2).start()
    except ClusterUnavailable as e:
        pytest.skip(f"no emulated cluster on this machine: {e}")
    logs = tmp_path_factory.mktemp("spark-logs")
    processes = []
    try:
        opts = "-Dspark.master.rest.enabled=false -Dspark.ui.enabled=false"
        env = {**os.environ, "SPARK_DAEMON_MEMORY": DAEMON_MEMORY, "SPARK_NO_DAEMONIZE": "1",
               "SPARK_LOG_DIR": str(logs), "SPARK_MASTER_OPTS": opts, "SPARK_WORKER_OPTS": opts}
        spark_class = os.path.join(spark_home(), "bin", "spark-class")
        bridge = cluster.bridge_addr
        port = free_port(bridge)
        processes.append(_spawn([spark_class, "org.apache.spark.deploy.master.Master", "--host", bridge, "--port",
                                 str(port), "--webui-port", str(free_port(bridge))], logs / "master.log", env))
        url = f"spark://{bridge}:{port}"
        for host in cluster.hosts:
            worker_env = {**env, "SPARK_LOCAL_IP": host.addr}
            processes.append(_spawn([spark_class, "org.apache.spark.deploy.worker.Worker", url, "--host", host.addr,
                                     "--cores", "1", "--memory", "1024m", "--webui-port", "0", "--work-dir",
                                     str(logs / f"work-{host.name}")], logs / f"worker-{host.name}.log",
                                    worker_env, cluster, host.name))
        conf = {"spark.driver.host": cluster.bridge_addr, "spark.driver.bindAddress": cluster.bridge_addr,
                "spark.executor.cores": "1", "spark.cores.max": "2"}
        with spark_session(url, **conf) as spark:
            deadline = time.monotonic() + 240
            while slot_count(spark.sparkContext)[0] < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            yield spark
    finally:
        _stop(processes[1:])  # the workers end their executors
        _stop(processes[:1])
        cluster.close()


def _where():
    import socket

    import psutil
    import torch

    import hora.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    ancestors = [" ".join(p.cmdline()[:3]) for p in psutil.Process().parents()]
    return hvd.rank(), hvd.size(), hvd.mpi_enabled(), socket.gethostname(), total, ancestors


@pytest.mark.timeout(600)
def test_mpi_job_spans_two_hosts_through_the_spark_tasks(two_hosts):
    results = hora.spark.run(_where, num_proc=2, use_mpi=True, env=ENV)
    assert [r[:3] for r in results] == [(0, 2, True), (1, 2, True)]
    assert sorted(r[3] for r in results) == ["h1", "h2"], results  # one rank per host
    assert [r[4] for r in results] == [3.0, 3.0]
    # rank 0 is a child of its task's mpirun; rank 1 of the Open MPI daemon its own host's task started
    assert any("prterun" in a for a in results[0][5]), results[0][5]
    chain = results[1][5]
    daemon = next(i for i, a in enumerate(chain) if "prted" in a)
    assert any("pyspark.daemon" in a for a in chain[daemon:]), chain


@pytest.mark.timeout(600)
def test_a_rank_raising_on_the_other_host_ends_the_job_with_its_traceback(two_hosts):
    error, seconds, out = run_raising_job(KeyError("the second host gives up"), use_mpi=True, env=ENV)
    assert seconds < 15, out
    assert error.rank == 1 and "KeyError: 'the second host gives up'" in error.traceback
    assert isinstance(error.__cause__, KeyError)
