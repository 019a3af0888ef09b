"""hora.spark's pure decisions: ranks from the barrier tasks' reports, GPUs, slot checks, the job's environment.

Nothing here talks to Spark, so the rank layout and the environment each rank
gets are tested without a cluster (``tests/spark/test_spark_plan.py``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping, Sequence

from hora import envvars
from hora.errors import ConfigError
from hora.placement import Placement, place_groups
from hora.runner.env import build_env
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import Endpoints

#: What the job's command is called where a launcher would print it.
COMMAND = ("hora.spark",)
#: The variable the task sets for a child whose rank has a partition of ``df=``: the directory of its Arrow file.
HORA_SPARK_DATA = envvars.HORA_SPARK_DATA
#: Where the GPUs Spark gave a task are named for the rank (a process sees only these).
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TaskInfo:
    """What one barrier task reports about itself in the address exchange.

    Attributes:
        partition: the task's partition id (its index in the barrier stage).
        host: the executor's host, as Spark names it (tasks on one host share it).
        addr: the address the task would host the rendezvous on.
        port: a TCP port that was free on ``addr`` when the task looked.
        gpus: the GPU addresses of ``resources()['gpu']`` (empty without GPU scheduling).
        rows: how many rows of ``df=`` the task holds (0 without a DataFrame).
    """

    partition: int
    host: str
    addr: str
    port: int
    gpus: tuple[str, ...] = ()
    rows: int = 0

    def to_dict(self) -> dict[str, object]:
        """The JSON-able form the tasks exchange through ``allGather``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> TaskInfo:
        """The inverse of :meth:`to_dict`."""
        return cls(partition=int(data["partition"]), host=str(data["host"]), addr=str(data["addr"]),  # type: ignore[arg-type]
                   port=int(data["port"]), gpus=tuple(str(g) for g in data.get("gpus") or ()),  # type: ignore[arg-type, union-attr]
                   rows=int(data.get("rows") or 0))  # type: ignore[arg-type]


def _gpu_key(gpu: str) -> tuple[int, int | str]:
    return (0, int(gpu)) if gpu.isdigit() else (1, gpu)


def _host_key(host: str) -> tuple[int, object]:
    try:
        return (0, int(ipaddress.ip_address(host)))
    except ValueError:
        return (1, host)


def plan_ranks(infos: Sequence[TaskInfo]) -> list[Placement]:
    """Each task's place in the job: ``slots[i]`` belongs to ``infos[i]``.

    Tasks on one host get consecutive ranks, as ``hora run -H`` gives them;
    hosts are ordered by address (then name).  On a host, the tasks are
    ordered by their first GPU (so local rank ``k`` holds the host's
    ``k``-th GPU in :func:`visible_devices`), then by partition id.
    """
    by_host: dict[str, list[int]] = {}
    for index, info in enumerate(infos):
        by_host.setdefault(info.host, []).append(index)
    order = sorted(by_host, key=_host_key)
    for host in order:
        by_host[host].sort(key=lambda i: (tuple(_gpu_key(g) for g in infos[i].gpus[:1]), infos[i].partition))
    return place_groups([(host, by_host[host]) for host in order], len(infos))


def visible_devices(infos: Sequence[TaskInfo], slots: Sequence[Placement], index: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for task ``index``, or None when Spark gave it no GPU.

    Every rank of a host sees the GPUs of all the job's tasks on that host,
    ordered so that device ``local_rank`` is its own first GPU (the way
    scripts written for Horovod pick theirs: ``set_device(hvd.local_rank())``);
    a task's further GPUs follow after every task's first.  Seeing the
    peers' GPUs lets NCCL use peer-to-peer copies between them.
    """
    if not infos[index].gpus:
        return None
    host = infos[index].host
    local = sorted((slots[i].local_rank, i) for i in range(len(infos)) if infos[i].host == host)
    firsts = [infos[i].gpus[0] for _, i in local if infos[i].gpus]
    rest = [g for _, i in local for g in infos[i].gpus[1:]]
    if len(firsts) != len(local):
        raise ConfigError(f"on host {host}, some tasks of the job have GPUs and some have none: give every task "
                          "the same spark.task.resource.gpu.amount")
    if len(set(firsts + rest)) != len(firsts + rest):
        # Tasks share GPUs (a fractional spark.task.resource.gpu.amount): no order puts each rank's own GPU at
        # its local rank, so a rank sees only its own, as device 0.
        return ",".join(infos[index].gpus)
    return ",".join(firsts + rest)


def rendezvous(infos: Sequence[TaskInfo], slots: Sequence[Placement]) -> tuple[str, int]:
    """Rank 0's task's address and port: where the job's rendezvous store listens."""
    for info, slot in zip(infos, slots, strict=True):
        if slot.rank == 0:
            return info.addr, info.port
    raise ConfigError("no task got rank 0")  # cannot happen with a non-empty plan


def check_slots(num_proc: int, slots: int, detail: str) -> None:
    """Refuse a job that asks for more barrier tasks than the application can run at once.

    Spark runs a barrier stage only when all of its tasks fit; otherwise it
    retries its own check for minutes.  ``detail`` says how ``slots`` was counted.

    Raises:
        ConfigError: ``num_proc`` exceeds ``slots``; the message names both.
    """
    if num_proc > slots:
        raise ConfigError(
            f"num_proc={num_proc} asks for more ranks than the Spark application has task slots: {slots} "
            f"({detail}). A barrier stage needs all of its tasks running at once: lower num_proc, or add "
            "executors or cores"
        )


def choose_controller(use_mpi: bool | None, use_gloo: bool | None, env: Mapping[str, str],
                      driver_env: Mapping[str, str]) -> str:
    """The engine of a job: ``"gloo"`` (the default) or ``"mpi"``, as ``horovod.spark.run`` picks it.

    ``use_mpi``/``use_gloo`` win; without them ``HORA_CONTROLLER`` or
    ``HOROVOD_CONTROLLER`` in ``env``, then in the driver's environment,
    decides; without those, gloo.

    Raises:
        ConfigError: both flags are True, or a controller variable names neither engine.
    """
    if use_mpi and use_gloo:
        raise ConfigError("use_mpi=True and use_gloo=True contradict each other: set one (gloo is the default)")
    if use_mpi:
        return "mpi"
    if use_gloo or use_mpi is False:
        return "gloo"
    for where, values in (("env", env), ("the driver's environment", driver_env)):
        for name in (envvars.HORA_CONTROLLER, envvars.HOROVOD_CONTROLLER):
            value = str(values.get(name, "") or "").lower()
            if value in ("gloo", "mpi"):
                return value
            if value:
                raise ConfigError(f"{name}={values[name]!r} in {where}: hora.spark runs 'gloo' or 'mpi'; set one of "
                                  "those, or pass use_gloo=True / use_mpi=True")
    return "gloo"


def job_env(
    *,
    num_proc: int,
    start_timeout: float | None,
    nics: Sequence[str] | None,
    env: Mapping[str, str],
    controller: str = "gloo",
) -> dict[str, str]:
    """The variables every rank gets, built on the driver once (one job secret for all).

    The same variables ``hora run --gloo`` (or ``--mpi`` for ``controller="mpi"``)
    gives its workers, built by the same code (:func:`hora.runner.env.build_env`).  The rendezvous address
    and port are placeholders here: each task fills in rank 0's task's after
    the address exchange.  ``OMP_NUM_THREADS`` is set only when the user
    set it; otherwise a rank keeps the one Spark gives its task (the task's
    CPUs, ``spark.task.cpus``).
    """
    config = LaunchConfig(
        command=COMMAND, num_proc=num_proc, launcher="mpi" if controller == "mpi" else "local", controller=controller,
        start_timeout=start_timeout,
        network_interface=",".join(nics) if nics else None, env={str(k): str(v) for k, v in env.items()},
    )
    base = {envvars.OMP_NUM_THREADS: "-"}  # keeps build_env from choosing threads for the driver's machine
    result, _ = build_env(config, local_size=1, base=base, endpoints=Endpoints(addr="", port=0))
    if result.get(envvars.OMP_NUM_THREADS) == "-":
        del result[envvars.OMP_NUM_THREADS]
    return result


def rank_env(job: Mapping[str, str], slot: Placement, rendezvous_at: tuple[str, int],
             devices: str | None) -> dict[str, str]:
    """The variables of one rank: the job's, its rank variables, rank 0's rendezvous, its GPUs."""
    env = dict(job)
    env.update(slot.env())
    env[envvars.HORA_RENDEZVOUS_ADDR] = rendezvous_at[0]
    env[envvars.HORA_RENDEZVOUS_PORT] = str(rendezvous_at[1])
    if devices is not None:
        env[CUDA_VISIBLE_DEVICES] = devices
    return env


_PY4J_LINE = re.compile(r"^(?:\S+Exception|\S+Error): (.*)$")


def spark_error_summary(text: str) -> str:
    """The first meaningful line of a Spark/Py4J error (its Java stack trace left out), and, when a task's
    Python code raised, that exception's last line (e.g. an executor that cannot import hora)."""
    first = _first_line(text)
    python = _python_error(text)
    return f"{first}; a task's Python error: {python}" if python and python not in first else first


def _python_error(text: str) -> str:
    marker = text.find("PythonException:")
    if marker < 0:
        return ""
    last = ""
    for line in text[marker:].splitlines()[1:]:
        if line.startswith(("\tat ", "\t", "\tat")) or line.startswith("Caused by"):
            break
        if line.strip() and not line.startswith(" "):
            last = line.strip()
    return last[:500]


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        line = line.strip().lstrip(": ")
        if not line or line.startswith(("at ", "Traceback", "File ", "py4j", "An error occurred")):
            continue
        match = _PY4J_LINE.match(line)
        return (match.group(1) if match else line)[:500]
    return text.strip()[:500] or "no message"


def last_traceback(lines: Sequence[str]) -> str:
    """The last Python traceback in a process's stderr lines (empty when there is none)."""
    for start in range(len(lines) - 1, -1, -1):
        if lines[start].startswith("Traceback (most recent call last)"):
            return "\n".join(lines[start:])
    return ""
