"""hora.spark's MPI mode (``run(..., use_mpi=True)``): rank 0's Spark task runs mpirun over the job's tasks.

What each barrier task does, after :func:`hora.spark.task.run_rank` has
spilled its partition and described itself:

1. It opens an :class:`~hora.spark.rsh.AgentServer` and exchanges its
   report (plus the agent's port, its directory and its rank's command)
   through ``allGather``; every task computes the same ranks
   (:func:`hora.spark.plan.plan_ranks`, the layout gloo uses).
2. The task of each host's local rank 0 keeps serving agents; the others
   close theirs.  Every task writes its rank's files (the pickled function,
   its partition of ``df=``) into its own directory, then all meet at a
   barrier.
3. Rank 0's task runs mpirun: ``-H addr:ranks,...`` in rank order, with
   :mod:`hora.spark.rsh` as Open MPI's ``plm_ssh_agent``, so the daemon of
   every other host is started by that host's serving task, as its child.
   On a single host mpirun forks every rank itself: all ranks are then
   children of rank 0's task's mpirun, not of their own tasks.  Each rank
   runs :mod:`hora.spark.mpi_rank`, which takes its own variables, directory
   and command from a table mpirun forwards to all.
4. Rank 0's task relays the ranks' prefixed output lines to the driver and
   supervises mpirun as ``hora run --mpi`` does
   (:class:`hora.runner.launchers.mpi.ToolSupervisor`): a failing rank ends
   the job.  At the end it shares every rank's exit through ``allGather``;
   each task then reports its own rank's outcome (its result file is in the
   task's directory) to the driver.  When mpirun fails before any rank
   does (a host unreachable, no mpirun), it sends the driver mpirun's own
   message instead.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from hora import envvars
from hora.errors import LaunchError
from hora.placement import Placement
from hora.runner.env import NOT_INHERITED
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import Interrupt, JobResult, Slot
from hora.runner.launchers.mpi import ToolSupervisor, find_mpirun, mpi_flavour, mpirun_command
from hora.runner.output import TAIL_LINES, OutputSink
from hora.spark.channel import TaskChannel
from hora.spark.job import TaskJob, place_data, rank_command, read_result, task_result
from hora.spark.plan import (
    CUDA_VISIBLE_DEVICES,
    HORA_SPARK_DATA,
    TaskInfo,
    plan_ranks,
    rendezvous,
    visible_devices,
)
from hora.spark.rsh import AgentServer, agent_command, die_with_parent, write_agents_file

log = logging.getLogger(__name__)

#: The per-rank table, compressed JSON (``encode_table``); mpirun forwards it to every rank.
RANKS_VAR = "HORA_SPARK_MPI_RANKS"


def encode_table(entries: Sequence[Mapping[str, Any]]) -> str:
    """The value of :data:`RANKS_VAR`: ``entries[r]`` is rank ``r``'s ``{"dir", "argv", "env"}``, zlib'd and
    base64'd (the entries repeat the same paths, so a table of hundreds of ranks stays a few kB)."""
    return base64.b64encode(zlib.compress(json.dumps(list(entries)).encode(), 9)).decode("ascii")


def decode_table(text: str) -> list[dict[str, Any]]:
    """The inverse of :func:`encode_table`."""
    return json.loads(zlib.decompress(base64.b64decode(text)))


#: Seconds between SIGTERM and SIGKILL when rank 0's task stops mpirun.
MPIRUN_GRACE_S = 3.0
#: The exit code reported for a rank that mpirun never reported on (it was never started, or killed with it).
NO_EXIT = 255


def mpi_argv(argv: Sequence[str]) -> list[str]:
    """A rank's command run through ``python -m mpi4py``, which calls ``MPI_Abort`` when the rank raises or
    exits non-zero.  Without it a failing rank would wait in ``MPI_Finalize`` (Open MPI's closing fence)
    for peers that are still busy, and the job would not end until they did."""
    return [argv[0], "-m", "mpi4py", *argv[1:]]


def serving_tasks(infos: Sequence[TaskInfo], slots: Sequence[Placement]) -> dict[str, int]:
    """For each host, the index of the task whose rank is the host's local rank 0: it serves the agents."""
    return {slot.host: index for index, slot in enumerate(slots) if slot.local_rank == 0}


def mpirun_hosts(infos: Sequence[TaskInfo], slots: Sequence[Placement]) -> list[tuple[str, int]]:
    """mpirun's ``-H`` entries in rank order: each host by its serving task's address, with its rank count.

    Open MPI fills each host's slots in this order, so rank ``r`` lands on
    the host hora placed it on (:mod:`hora.spark.mpi_rank` checks it).
    """
    serving = serving_tasks(infos, slots)
    counts: dict[str, int] = {}
    for slot in sorted(slots, key=lambda s: s.rank):
        counts[slot.host] = counts.get(slot.host, 0) + 1
    return [(infos[serving[host]].addr, count) for host, count in counts.items()]


def rank_table(job: TaskJob, infos: Sequence[TaskInfo], slots: Sequence[Placement],
               extras: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's entry for :mod:`hora.spark.mpi_rank`, by rank: its task's directory and command, and the
    variables that differ between ranks (placement, GPUs, the partition's directory)."""
    table: list[dict[str, Any]] = [{}] * len(slots)
    for index, slot in enumerate(slots):
        env = slot.env()
        devices = visible_devices(infos, slots, index)
        if devices is not None:
            env[CUDA_VISIBLE_DEVICES] = devices
        if job.with_data:
            env[HORA_SPARK_DATA] = str(extras[index]["dir"])
        table[slot.rank] = {"dir": extras[index]["dir"], "argv": list(extras[index]["argv"]), "env": env}
    return table


def mpirun_env(job: TaskJob, infos: Sequence[TaskInfo], slots: Sequence[Placement], table: str,
               base: Mapping[str, str]) -> dict[str, str]:
    """mpirun's environment: the task's (less any rank variables), the job's, rank 0's rendezvous, the table."""
    env = {k: v for k, v in base.items() if k not in NOT_INHERITED}
    env.update(job.env)
    addr, port = rendezvous(infos, slots)
    env[envvars.HORA_RENDEZVOUS_ADDR] = addr
    env[envvars.HORA_RENDEZVOUS_PORT] = str(port)
    env[RANKS_VAR] = table
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


def build_mpirun(job: TaskJob, num_proc: int, env: Mapping[str, str], hosts: Sequence[tuple[str, int]],
                 agents_file: str, mpirun: str, flavour: str = "openmpi") -> list[str]:
    """The mpirun command line of the job, by :func:`hora.runner.launchers.mpi.mpirun_command` (one host: no
    ``-H``, mpirun forks every rank; several: ``-H`` and the rsh agent).

    Raises:
        LaunchError: the job spans hosts and mpirun is MPICH's (only Open MPI's takes the agent).
    """
    spans = len(hosts) > 1
    if spans and flavour != "openmpi":
        raise LaunchError(f"{mpirun} is MPICH's mpirun; hora.spark starts MPI across hosts with Open MPI's only "
                          "(pip install 'hora[mpi]' installs it), or use gloo (use_mpi=False)")
    config = LaunchConfig(command=[sys.executable, "-m", "hora.spark.mpi_rank"], num_proc=num_proc, launcher="mpi",
                          controller="mpi", network_interface=",".join(job.nics) if job.nics else None,
                          env={k: env[k] for k in (RANKS_VAR,)}, mpi_args=job.mpi_args)
    return mpirun_command(config, num_proc, env, mpirun, hosts=hosts if spans else (), flavour=flavour,
                          rsh_agent=agent_command(agents_file) if spans else None)


class _ChannelSink(OutputSink):
    """Where :class:`ToolSupervisor` puts the lines mpirun relays: to the driver, each rank's as its own."""

    def __init__(self, channel: TaskChannel) -> None:
        super().__init__(sys.stdout, sys.stderr)
        self.channel = channel
        self.tails: dict[Any, list[str]] = {}
        self.lines: list[str] = []  # mpirun's own lines, for a launch failure's message

    def emit(self, rank: Any, stream: str, payload: bytes) -> None:
        """Send one line of rank ``rank`` to the driver, keeping its stderr tail."""
        if stream == "stderr":
            tail = self.tails.setdefault(rank, [])
            tail.append(payload.decode("utf-8", errors="replace").rstrip("\r\n"))
            del tail[:-TAIL_LINES]
        self._send(stream, payload, rank)

    def emit_raw(self, stream: str, line: bytes) -> None:
        """Send a line of mpirun's own to the driver (printed without a rank prefix)."""
        text = line.decode("utf-8", errors="replace").rstrip("\r\n")
        if text.strip():
            self.lines.append(text)
        self._send(stream, line, None)

    def tail(self, rank: Any) -> list[str]:
        """The last stderr lines of rank ``rank``."""
        return list(self.tails.get(rank, ()))

    def _send(self, stream: str, payload: bytes, rank: int | None) -> None:
        try:
            self.channel.output(stream, payload, rank)
        except OSError:
            pass  # the driver went away: the job is being cancelled


def run_mpirun(command: Sequence[str], env: Mapping[str, str], slots: Sequence[Placement],
               sink: _ChannelSink) -> JobResult:
    """Run mpirun to its end, relaying through ``sink``; stop it (and its ranks) if this task is interrupted."""
    try:
        process = subprocess.Popen(list(command), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_parent)
    except OSError as e:
        raise LaunchError(f"cannot start mpirun {command[0]!r}: {e.strerror or e}") from e
    try:
        return ToolSupervisor(process, [Slot.worker(s) for s in slots], sink, Interrupt(), MPIRUN_GRACE_S,
                              tool="mpirun").run()
    except BaseException:
        # Spark stops the task (the job was cancelled): take mpirun and, through it, the ranks down too.
        for signum in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, signum)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=MPIRUN_GRACE_S)
                break
            except subprocess.TimeoutExpired:
                continue
        raise


def summary(result: JobResult, sink: _ChannelSink) -> dict[str, Any]:
    """What rank 0's task shares at the end: each rank's exit, and mpirun's failure when no rank failed."""
    exits = {str(rank): [e.returncode, bool(e.stopped), list(e.stderr_tail)] for rank, e in result.exits.items()}
    tails = {str(rank): tail for rank, tail in sink.tails.items() if isinstance(rank, int)}
    failure = None
    if result.root_cause is None and result.exit_code != 0:
        lines = list(result.details) or sink.lines[-TAIL_LINES:]
        failure = (f"hora.spark (MPI): {result.message or f'mpirun failed with exit code {result.exit_code}'}"
                   + ("; mpirun said:\n" + "\n".join(lines) if lines else ""))
    return {"exits": exits, "tails": tails, "root": None if result.root_cause is None else result.root_cause.rank,
            "failure": failure}


def rank_exit(shared: Mapping[str, Any], rank: int, result: bytes) -> tuple[int, bool, list[str]]:
    """``(returncode, stopped, stderr tail)`` of ``rank`` from what rank 0's task shared and its result file.

    mpirun reports a rank's exit through the rank's wrapper; a rank that
    called ``MPI_Abort`` (it raised, under ``python -m mpi4py``) takes its
    wrapper down with the job, so then the result file tells: an error
    there is the rank's own failure, no file means mpirun stopped the rank.
    """
    tail = list(shared.get("tails", {}).get(str(rank), []))
    if str(rank) in shared["exits"]:
        returncode, stopped, tail = shared["exits"][str(rank)]
        return int(returncode), bool(stopped), list(tail)
    if result:
        try:
            import cloudpickle

            ok = cloudpickle.loads(result)[0] == "ok"
        except Exception:  # an exception class that does not load here: still the rank's own error
            ok = False
        return (0, False, tail) if ok else (1, False, tail)
    if shared["failure"] or shared["root"] is not None:
        return NO_EXIT, True, tail
    return NO_EXIT, False, [*tail, f"hora.spark: mpirun never reported how rank {rank} ended"]


def run_mpi_task(job: TaskJob, ctx: Any, me: TaskInfo, workdir: str) -> int:
    """One barrier task of an MPI job (see the module's docstring); returns its rank.

    Raises:
        RuntimeError: its rank failed, or mpirun did (the driver has been told why already).
    """
    server_env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    server = AgentServer(me.addr, job.token, server_env)
    try:
        argv = mpi_argv(rank_command(job, workdir))
        mine = {**me.to_dict(), "mpi": {"agent": server.port, "dir": workdir, "argv": argv}}
        gathered = sorted((json.loads(m) for m in ctx.allGather(json.dumps(mine))), key=lambda d: d["partition"])
        infos = [TaskInfo.from_dict(d) for d in gathered]
        extras = [d["mpi"] for d in gathered]
        slots = plan_ranks(infos)
        index = next(i for i, info in enumerate(infos) if info.partition == me.partition)
        slot = slots[index]
        serving = serving_tasks(infos, slots)
        if serving.get(slot.host) != index:
            server.close()  # another task of this host serves it
        if job.with_data:
            place_data(workdir, infos, slots, slot.rank)
        ctx.barrier()  # every task's files are in place before any rank starts
        channel = TaskChannel(job.driver[0], job.driver[1], job.token, slot.rank)
        try:
            if slot.rank == 0:
                shared = _run_job(job, infos, slots, extras, workdir, channel)
                ctx.allGather(json.dumps(shared))
            else:
                shared = next(json.loads(m) for m in ctx.allGather("") if m)
            if shared["failure"] and slot.rank == 0:
                channel.failed(shared["failure"])
            result = read_result(job, workdir, slot.rank)
            returncode, stopped, tail = rank_exit(shared, slot.rank, result)
            channel.outcome(returncode, me.host, result, tail, stopped=stopped)
        finally:
            channel.close()
        return task_result(slot.rank, me.host, returncode)
    finally:
        server.close()


def _run_job(job: TaskJob, infos: Sequence[TaskInfo], slots: Sequence[Placement], extras: Sequence[Mapping[str, Any]],
             workdir: str, channel: TaskChannel) -> dict[str, Any]:
    """Rank 0's task: run mpirun over every task and return what :func:`summary` shares."""
    sink = _ChannelSink(channel)
    try:
        table = encode_table(rank_table(job, infos, slots, extras))
        env = mpirun_env(job, infos, slots, table, os.environ)
        mpirun = find_mpirun(env)
        hosts = mpirun_hosts(infos, slots)
        serving = serving_tasks(infos, slots)
        agents_file = os.path.join(workdir, "agents.json")
        write_agents_file(agents_file, job.token, {
            infos[i].addr: (infos[i].addr, int(extras[i]["agent"])) for i in serving.values()})
        command = build_mpirun(job, len(slots), env, hosts, agents_file, mpirun,
                               flavour=mpi_flavour(mpirun) if len(hosts) > 1 else "openmpi")
        log.debug("hora.spark: %s", shlex.join(command))
        result = run_mpirun(command, env, slots, sink)
    except LaunchError as e:
        return {"exits": {}, "tails": {}, "root": None, "failure": f"hora.spark (MPI) on rank 0's executor: {e}"}
    return summary(result, sink)
