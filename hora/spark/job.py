"""What a ``hora.spark.run`` job ships to its barrier tasks, and the rank's files in a task's directory.

:class:`TaskJob` travels in the stage's closure.  In a task's own directory
the rank finds its payload (``hora.runner.run_task``'s files), its partition
of ``df=`` and, at the end, its result; the functions here name and read
them, for the gloo path (:mod:`hora.spark.task`) and the MPI one
(:mod:`hora.spark.mpi`) alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence

from hora.placement import Placement
from hora.runner.run_task import PATH_FILE, TASK_FILE, result_file
from hora.spark.partition import rank_file, write_meta
from hora.spark.plan import TaskInfo


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
