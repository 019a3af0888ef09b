"""What each barrier task of a ``hora.spark.run`` job does, on its executor.

1. With ``df=``, it writes its partition's Arrow batches to a local file.
2. It reports where it runs (host, a rendezvous address and free port, its
   GPUs, its rows) and receives every task's report through the barrier
   context's ``allGather``; every task then computes the same rank layout
   (:func:`hora.spark.plan.plan_ranks`).
3. It starts its rank as a child process (``python -m hora.runner.run_task``,
   or the user's script), so a crash or CUDA state never stays in Spark's
   reused Python worker.  The child dies with the task (``PR_SET_PDEATHSIG``).
4. It sends the child's output lines and, at the end, its outcome (the
   pickled return value or exception, the exit code, the stderr tail) to the
   driver over :class:`~hora.spark.channel.TaskChannel`.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from hora.runner.env import NOT_INHERITED, free_port, interface_address
from hora.runner.output import TAIL_LINES, pump
from hora.spark.channel import TaskChannel
from hora.spark.job import TaskJob, place_data, rank_command, read_result, task_result
from hora.spark.mpi import run_mpi_task
from hora.spark.partition import spill
from hora.spark.plan import HORA_SPARK_DATA, TaskInfo, plan_ranks, rank_env, rendezvous, visible_devices
from hora.spark.rsh import die_with_parent


def rdd_task(job: TaskJob, iterator: Iterable[Any]) -> Iterator[int]:
    """The function of a barrier stage without data (``rdd.barrier().mapPartitions``): yields the rank."""
    for _ in iterator:
        pass
    yield run_rank(job, None)


def arrow_task(job: TaskJob, batches: Iterable[Any]) -> Iterator[Any]:
    """The function of ``df.mapInArrow(..., barrier=True)``: yields one record batch holding the rank."""
    import pyarrow as pa

    rank = run_rank(job, batches)
    yield pa.RecordBatch.from_arrays([pa.array([rank], pa.int32())], names=["rank"])


def run_rank(job: TaskJob, batches: Iterable[Any] | None) -> int:
    """Place this task's rank, run it to the end, report it to the driver; return the rank.

    Raises:
        RuntimeError: the rank failed (its outcome has reached the driver
            already; this makes Spark fail the stage too).
    """
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    partition = ctx.partitionId()
    # Under the executor's own local directory (Spark hands it to its Python workers), which the executor
    # deletes when it stops: the task's files go even when Spark kills this worker before the finally below.
    local = (os.environ.get("SPARK_LOCAL_DIRS") or "").split(",")[0]
    workdir = tempfile.mkdtemp(prefix="hora-spark-", dir=local if local and os.path.isdir(local) else None)
    try:
        rows = spill(batches, os.path.join(workdir, "data.arrow")) if batches is not None else 0
        host = ctx.getTaskInfos()[partition].address.rsplit(":", 1)[0]
        addr = interface_address(",".join(job.nics)) if job.nics else _address(host)
        gpus: tuple[str, ...] = ()
        resources = ctx.resources()
        if "gpu" in resources:
            gpus = tuple(str(a) for a in resources["gpu"].addresses)
        me = TaskInfo(partition=partition, host=host, addr=addr, port=free_port(addr), gpus=gpus, rows=rows)
        if job.controller == "mpi":
            return run_mpi_task(job, ctx, me, workdir)
        infos = [TaskInfo.from_dict(json.loads(m)) for m in ctx.allGather(json.dumps(me.to_dict()))]
        infos.sort(key=lambda info: info.partition)
        slots = plan_ranks(infos)
        slot = slots[partition]
        env = rank_env(job.env, slot, rendezvous(infos, slots), visible_devices(infos, slots, partition))
        if batches is not None:
            place_data(workdir, infos, slots, slot.rank)
            env[HORA_SPARK_DATA] = workdir
        channel = TaskChannel(job.driver[0], job.driver[1], job.token, slot.rank)
        try:
            returncode, tail = _run_child(job, workdir, env, channel)
            channel.outcome(returncode, host, read_result(job, workdir, slot.rank), tail)
        finally:
            channel.close()
        return task_result(slot.rank, host, returncode)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _address(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _run_child(job: TaskJob, workdir: str, env: Mapping[str, str], channel: TaskChannel) -> tuple[int, list[str]]:
    """Start the rank, forward its output, wait for it; ``(returncode, last stderr lines)``."""
    child_env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    child_env.update(env)
    command = rank_command(job, workdir)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def forward(stream: str):
        def on_line(line: bytes) -> None:
            if stream == "stderr":
                tail.append(line.decode("utf-8", errors="replace").rstrip("\r\n"))
            try:
                channel.output(stream, line)
            except OSError:
                pass  # the driver went away: the job is being cancelled
        return on_line

    process = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, preexec_fn=die_with_parent, start_new_session=True)
    pumps = [pump(process.stdout, forward("stdout")), pump(process.stderr, forward("stderr"))]  # type: ignore[arg-type]
    try:
        returncode = process.wait()
    except BaseException:
        # The task is being stopped (Spark interrupts it on cancel): take the rank down with it.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        raise
    for thread in pumps:
        thread.join(timeout=5)
    return returncode, list(tail)
