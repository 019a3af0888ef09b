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
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from hora.placement import Placement
from hora.runner.env import NOT_INHERITED, free_port, interface_address
from hora.runner.output import TAIL_LINES, pump
from hora.runner.run_task import PATH_FILE, TASK_FILE, result_file
from hora.spark.channel import TaskChannel
from hora.spark.partition import rank_file, spill, write_meta
from hora.spark.plan import HORA_SPARK_DATA, TaskInfo, plan_ranks, rank_env, rendezvous, visible_devices
from hora.spark.rsh import die_with_parent


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TaskJob:
    """Everything a task needs, shipped in the stage's closure.

    Attributes:
        payload: the cloudpickled ``(fn, args, kwargs)``, or None for a script.
        command: the script and its arguments (run with the executor's Python), or None.
        sys_path: the driver's import path entries outside its interpreter, for ``fn`` pickled by reference.
        env: the job's variables (:func:`hora.spark.plan.job_env`).
        driver: the driver channel's address and port.
        token: the channel's token.
        nics: interfaces for the rendezvous and gloo, or None for the executor's Spark address.
        with_data: the stage reads ``df=``'s partitions.
        controller: ``"gloo"`` (each task starts its rank) or ``"mpi"`` (rank 0's task runs mpirun,
            :mod:`hora.spark.mpi`).
        mpi_args: extra mpirun arguments (``extra_mpi_args``).
    """

    payload: bytes | None
    command: tuple[str, ...] | None
    sys_path: tuple[str, ...]
    env: Mapping[str, str]
    driver: tuple[str, int]
    token: str
    nics: tuple[str, ...] | None
    with_data: bool
    controller: str = "gloo"
    mpi_args: tuple[str, ...] = ()


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
            from hora.spark.mpi import run_mpi_task

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


def place_data(workdir: str, infos: Sequence[TaskInfo], slots: Sequence[Placement], rank: int) -> None:
    """Name the task's spilled partition as rank ``rank``'s file and record every rank's row count beside it."""
    os.replace(os.path.join(workdir, "data.arrow"), rank_file(workdir, rank))
    rows_by_rank = [0] * len(slots)
    for info, s in zip(infos, slots, strict=True):
        rows_by_rank[s.rank] = info.rows
    write_meta(workdir, rows_by_rank)


def read_result(job: TaskJob, workdir: str, rank: int) -> bytes:
    """The rank's ``hora.runner.run_task`` result file, or empty for a script or a rank that wrote none."""
    path = result_file(workdir, rank)
    if job.payload is None or not os.path.exists(path):
        return b""
    with open(path, "rb") as f:
        return f.read()


def task_result(rank: int, host: str, returncode: int) -> int:
    """What the task yields once its rank's outcome reached the driver: the rank, or, when the rank failed,
    a RuntimeError that makes Spark fail the stage too (the driver reports the traceback)."""
    if returncode != 0:
        raise RuntimeError(f"hora.spark: rank {rank} on {host} exited with code {returncode}; "
                           "the driver reports its traceback")
    return rank


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


def rank_command(job: TaskJob, workdir: str) -> list[str]:
    """The rank's command line; for a function, writes its payload and import path into ``workdir`` first."""
    if job.payload is not None:
        with open(os.path.join(workdir, TASK_FILE), "wb") as f:
            f.write(job.payload)
        with open(os.path.join(workdir, PATH_FILE), "w", encoding="utf-8") as f:
            json.dump(list(job.sys_path), f)
        return [sys.executable, "-m", "hora.runner.run_task", workdir]
    assert job.command is not None
    return [sys.executable, _script(job.command[0]), *job.command[1:]]


def _script(path: str) -> str:
    """The script's path on this executor: as given, or the copy ``SparkContext.addFile`` shipped."""
    if os.path.exists(path):
        return path
    from pyspark import SparkFiles

    shipped = SparkFiles.get(os.path.basename(path))
    return shipped if os.path.exists(shipped) else path
