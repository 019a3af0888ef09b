"""``hora.spark.run``: one barrier-mode Spark job places the ranks, hora's rendezvous and collectives join them.

The driver checks the slots, builds the job's environment once (one secret),
opens a channel the tasks report to, and submits one barrier stage: over
``num_proc`` dummy partitions, or over ``df.repartition(num_proc)`` with
``mapInArrow(..., barrier=True)`` when ``df=`` is given.  Each task starts
its rank as a child process (:mod:`hora.spark.task`); with MPI, rank 0's
task runs mpirun over all of them instead (:mod:`hora.spark.mpi`).  The driver prints
the ranks' output with ``[rank]`` prefixes as it arrives and, at the first
rank that fails, cancels the job and raises
:class:`hora.errors.RankFailedError` with that rank's traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import secrets
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from hora.errors import (
    ConfigError,
    HoraError,
    LaunchError,
    RankFailedError,
    UnsupportedError,
    WorkerFailedError,
)
from hora.runner.output import prefix, write_bytes
from hora.spark.channel import DriverChannel
from hora.spark.job import TaskJob
from hora.spark.partition import check_schema, rank_file, spill, write_meta
from hora.spark.plan import HORA_SPARK_DATA, check_slots, choose_controller, job_env, last_traceback
from hora.spark.plan import spark_error_summary as _summary
from hora.spark.task import arrow_task, rdd_task

log = logging.getLogger(__name__)

#: How long the driver waits for executors to register before it counts the slots as final.
SLOT_WAIT_S = 5.0
#: After the first failing rank, how long to collect the others' outcomes before naming the root cause
#: (a rank that raises breaks its peers' collectives, and they report too).
FAILURE_GRACE_S = 1.0
#: After mpirun failed (MPI mode), how long to wait for every rank's outcome, which may name the rank to blame.
LAUNCH_GRACE_S = 5.0
#: After a cancel, how long to wait for Spark to end the job before raising anyway.
CANCEL_WAIT_S = 15.0
#: After the job ends, how long to wait for outcomes still in flight on the channel.
DRAIN_S = 10.0


def run(
    fn: Callable[..., Any] | str | Sequence[str],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    verbose: int = 1,
    nics: Sequence[str] | str | None = None,
    prefix_output_with_timestamp: bool = False,
    *,
    df: Any = None,
    max_retries: int = 0,
    local_mode: bool | None = None,
) -> list[Any] | None:
    """Run ``fn(*args, **kwargs)`` as ``num_proc`` hora ranks inside one barrier-mode Spark job.

    Horovod's ``horovod.spark.run`` signature; inside ``fn`` any hora binding
    (``hora.torch``, ``hora.tensorflow``, ``hora.keras``, ``hora.tensorflow.keras``)
    joins the job with ``hvd.init()``.  Ranks are consecutive on a host; the
    engine is gloo, or MPI with ``use_mpi=True`` (rank 0's task then runs
    mpirun, whose daemons the other hosts' tasks start: :mod:`hora.spark.mpi`).
    A task that Spark gave GPUs (``resources()['gpu']``) sees them as
    ``CUDA_VISIBLE_DEVICES`` with its own first at index ``local_rank``.

    Args:
        fn: the function each rank runs, or the path of a Python script
            (then ``args`` are its command-line arguments; it must exist on the
            executors, or be shipped with ``SparkContext.addFile``).
        args: positional arguments of ``fn`` (the script's arguments).
        kwargs: keyword arguments of ``fn``.
        num_proc: ranks; None takes every task slot of the application.
        start_timeout: seconds the ranks may take to meet at the rendezvous.
        use_mpi: run the ranks under mpirun with the MPI engine (Open MPI's
            mpirun and mpi4py on every executor: ``pip install 'hora[mpi]'``).
        use_gloo: run the gloo engine (the default).  With neither flag,
            ``HORA_CONTROLLER``/``HOROVOD_CONTROLLER`` (in ``env``, then the
            driver's environment) may pick ``mpi``.
        extra_mpi_args: more mpirun arguments (a string or a list), MPI only.
        env: extra environment variables for every rank.
        stdout: where the ranks' stdout lines go (default ``sys.stdout``).
        stderr: where their stderr lines go (default ``sys.stderr``).
        verbose: 0 quiet, 1 notices, 2 also the placement of every rank (logged).
        nics: network interfaces for the rendezvous and gloo (each executor must have them).
        prefix_output_with_timestamp: prefix each output line with the time it reached the driver.
        df: a DataFrame to share out: repartitioned into ``num_proc`` parts,
            each rank reads its own with :func:`hora.spark.data`.
        max_retries: resubmit the job this many times when a rank fails
            (Spark never retries a barrier stage itself).
        local_mode: True runs ``hora.run`` on the driver's machine instead of
            Spark tasks; None does so when the master is ``local[...]`` or no
            Spark session is active.

    Returns:
        ``fn``'s return values in rank order; None for a script.

    Raises:
        RankFailedError: a rank raised or died (after ``max_retries``
            resubmissions); carries the rank, its host and its traceback.
        ConfigError: bad arguments, or more ranks than task slots (both numbers named).
        LaunchError: the Spark job failed before any rank reported; MPI asked
            where mpirun or mpi4py is missing; mpirun could not start the ranks.
    """
    command, payload_fn = _what_to_run(fn, args, kwargs)
    if not isinstance(max_retries, int) or max_retries < 0:
        raise ConfigError(f"max_retries={max_retries!r} must be a non-negative integer")
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
        raise ConfigError(f"num_proc={num_proc!r} must be a positive integer or None (every slot)")
    env = {str(k): str(v) for k, v in (env or {}).items()}
    controller = choose_controller(use_mpi, use_gloo, env, os.environ)
    mpi_args = _mpi_args(controller, extra_mpi_args)
    nic_list = _nics(nics)
    session = df.sparkSession if df is not None else _active_session()
    if session is None:
        if local_mode is False:
            raise LaunchError("local_mode=False but no Spark session is active: create one first "
                              "(SparkSession.builder...getOrCreate())")
        if num_proc is None:
            raise ConfigError("no Spark session is active, so there are no slots to count: give num_proc")
        return _run_local(command, payload_fn, args, kwargs, num_proc, start_timeout, env, nic_list, verbose, None,
                          controller, mpi_args)
    try:
        sc = session.sparkContext
    except Exception as e:  # Spark Connect sessions have no SparkContext
        raise UnsupportedError("hora.spark.run needs a classic Spark session with a SparkContext; Spark Connect "
                               "sessions cannot run barrier jobs from Python") from e
    master = sc.master or ""
    local = local_mode if local_mode is not None else (master.startswith("local") and
                                                       not master.startswith("local-cluster"))
    if local:
        count = num_proc or sc.defaultParallelism
        return _run_local(command, payload_fn, args, kwargs, count, start_timeout, env, nic_list, verbose, df,
                          controller, mpi_args)
    num_proc = _check_slots(sc, num_proc)
    if df is not None:
        check_schema(df.schema)
        env, df = _share_out(df, num_proc, env)
    job = TaskJob(
        payload=_payload(payload_fn, args, kwargs) if payload_fn is not None else None,
        command=command, sys_path=_import_path(), env=job_env(num_proc=num_proc, start_timeout=start_timeout,
                                                                nics=nic_list, env=env, controller=controller),
        driver=("", 0), token=secrets.token_hex(16), nics=nic_list, with_data=df is not None,
        controller=controller, mpi_args=mpi_args,
    )
    output = _Output(stdout or sys.stdout, stderr or sys.stderr, prefix_output_with_timestamp)
    for attempt in range(max_retries + 1):
        try:
            return _run_once(sc, job, num_proc, df, output, verbose)
        except RankFailedError as e:
            if attempt == max_retries:
                raise
            log.warning("hora.spark: %s; resubmitting the job (retry %d of %d)", str(e).splitlines()[0],
                        attempt + 1, max_retries)
    raise AssertionError("unreachable")


def _share_out(df: Any, num_proc: int, env: dict[str, str]) -> tuple[dict[str, str], Any]:
    """How ``df`` reaches the ranks: ``(env, None)`` when they read its Parquet files themselves
    (:mod:`hora.spark.files`), else ``(env, df.repartition(num_proc))`` for the barrier stage."""
    from hora.spark.files import HORA_SPARK_FILES, manifest, scan_files

    files = scan_files(df)
    text = manifest(files, df.columns, num_proc) if files else None
    if text is None:
        return env, df.repartition(num_proc)
    log.debug("hora.spark: the ranks read df='s %d Parquet files directly", len(files or ()))
    return {**env, HORA_SPARK_FILES: text}, None


def _what_to_run(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> tuple[
        tuple[str, ...] | None, Callable[..., Any] | None]:
    """``(script command, None)`` for a script path, ``(None, fn)`` for a function."""
    if isinstance(fn, (str, os.PathLike)) or (isinstance(fn, (list, tuple)) and fn and isinstance(fn[0], str)):
        parts = [os.fspath(fn)] if isinstance(fn, (str, os.PathLike)) else [str(p) for p in fn]
        if kwargs:
            raise ConfigError(f"kwargs={dict(kwargs)!r}: a script takes command-line arguments only; pass them in args")
        return (*parts, *(str(a) for a in args)), None
    if not callable(fn):
        raise ConfigError(f"fn={fn!r} is neither a function nor the path of a script")
    return None, fn


def _mpi_args(controller: str, extra_mpi_args: str | Sequence[str] | None) -> tuple[str, ...]:
    """``extra_mpi_args`` as a list; checks that MPI was asked and can start here.

    Raises:
        ConfigError: ``extra_mpi_args`` without MPI.
        LaunchError: MPI asked but this machine has no mpirun or mpi4py.
    """
    args = tuple(shlex.split(extra_mpi_args) if isinstance(extra_mpi_args, str) else extra_mpi_args or ())
    if controller != "mpi":
        if args:
            raise ConfigError(f"extra_mpi_args={extra_mpi_args!r} is for the MPI engine: pass use_mpi=True, or drop "
                              "them (the job runs on gloo)")
        return ()
    from hora.runner.launchers.mpi import mpi_launch_available

    if not mpi_launch_available():
        raise LaunchError("hora.spark.run was asked for MPI (use_mpi=True or HORA_CONTROLLER=mpi), but this machine "
                          "has no mpirun or no mpi4py: pip install 'hora[mpi]' on the driver and every executor, "
                          "or run on gloo (use_gloo=True, the default)")
    return args


def _nics(nics: Sequence[str] | str | None) -> tuple[str, ...] | None:
    if nics is None:
        return None
    names = tuple(sorted({n for n in ([nics] if isinstance(nics, str) else nics) if n}))
    if not names:
        raise ConfigError(f"nics={nics!r} names no interface: give e.g. {{'eth0'}} or leave it None")
    return names


def _active_session() -> Any:
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return None
    return SparkSession.getActiveSession()


def _payload(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as e:
        raise ConfigError(f"cannot serialize {getattr(fn, '__name__', fn)!r} or its arguments: {e}") from e


def _import_path() -> tuple[str, ...]:
    """The driver's import path less its interpreter's own directories (an executor has its own)."""
    own = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    keep = []
    for entry in sys.path:
        path = os.path.abspath(entry) if entry else os.getcwd()
        real = os.path.realpath(path)
        if any(real == o or real.startswith(o + os.sep) for o in own):
            continue
        keep.append(path)
    return tuple(keep)


def slot_count(sc: Any) -> tuple[int, str]:
    """The task slots the application has now, and how they were counted (for messages)."""
    jsc = sc._jsc.sc()
    cpus = sc.getConf().get("spark.task.cpus", "1")
    try:
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        slots = int(jsc.maxNumConcurrentTasks(profile))
        executors = max(0, int(jsc.getExecutorIds().size()))
        return slots, f"{executors} executors registered, spark.task.cpus={cpus}"
    except Exception as e:  # an older or a remote (Connect) Spark: fall back on its default parallelism
        log.debug("hora.spark: counting slots through the scheduler failed: %s", e)
        return int(sc.defaultParallelism), f"the application's default parallelism, spark.task.cpus={cpus}"


def _check_slots(sc: Any, num_proc: int | None) -> int:
    """``num_proc``, or every slot for None; waits up to :data:`SLOT_WAIT_S` for executors to register."""
    deadline = time.monotonic() + SLOT_WAIT_S
    while True:
        slots, detail = slot_count(sc)
        enough = slots >= num_proc if num_proc is not None else slots > 0
        if enough or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if num_proc is None:
        if slots < 1:
            raise ConfigError(f"the Spark application has no task slots ({detail}) after {SLOT_WAIT_S:g} s: "
                              "start executors, or give num_proc")
        return slots
    check_slots(num_proc, slots, detail)
    return num_proc


class _Output:
    """Writes the ranks' lines to the driver's streams: ``[rank]<stdout>:text``, optionally timestamped."""

    def __init__(self, stdout: TextIO, stderr: TextIO, timestamps: bool) -> None:
        self._targets = {"stdout": stdout, "stderr": stderr}
        self._timestamps = timestamps
        self._lock = threading.Lock()

    def line(self, rank: int | None, stream: str, payload: bytes) -> None:
        """Write one line of ``rank`` (None: mpirun's own line, printed without a prefix)."""
        if not payload.endswith(b"\n"):
            payload += b"\n"
        stamp = time.strftime("%a %b %d %H:%M:%S %Y").encode() if self._timestamps else b""
        head = prefix(rank, stream) if rank is not None else b""
        with self._lock:
            try:
                write_bytes(self._targets.get(stream, self._targets["stderr"]), stamp + head + payload)
            except (BrokenPipeError, ValueError):
                pass


class _Outcome:
    """How one rank ended, as its task reported it."""

    def __init__(self, rank: int, returncode: int, host: str, result: bytes, tail: list[str],
                 stopped: bool = False) -> None:
        self.rank, self.returncode, self.host, self.result, self.tail = rank, returncode, host, result, tail
        self.stopped = stopped  # ended by its launcher because another rank failed first (MPI mode)
        self.at = time.monotonic()

    def loaded(self) -> tuple[Any, ...] | None:
        """The rank's ``hora.runner.run_task`` outcome: ``("ok", value)`` or ``("error", exc, text)``."""
        if not self.result:
            return None
        import cloudpickle

        return cloudpickle.loads(self.result)

    def error(self) -> RankFailedError:
        outcome = None
        try:
            outcome = self.loaded()
        except Exception as e:  # e.g. the exception's class does not exist on the driver
            log.debug("hora.spark: rank %d's exception could not be loaded: %s", self.rank, e)
        traceback = outcome[2] if outcome and outcome[0] == "error" else last_traceback(self.tail)
        error = RankFailedError(self.rank, self.returncode, self.host, "\n".join(self.tail), traceback)
        if outcome and outcome[0] == "error" and isinstance(outcome[1], BaseException):
            error.__cause__ = outcome[1]
        return error

    def consequence(self) -> bool:
        """Whether the rank failed because a peer did (a broken collective or a shut-down engine)."""
        if self.stopped:
            return True
        try:
            outcome = self.loaded()
        except Exception:
            return False
        return bool(outcome and outcome[0] == "error" and isinstance(outcome[1], HoraError)
                    and not isinstance(outcome[1], ConfigError))


def _run_once(sc: Any, job: TaskJob, num_proc: int, df: Any, output: _Output, verbose: int) -> list[Any] | None:
    """Submit the barrier job once; return the results or raise the root cause."""
    channel = DriverChannel(_driver_address(sc), job.token)
    job = dataclasses.replace(job, driver=(channel.address, channel.port))
    group = f"hora-spark-{secrets.token_hex(6)}"
    box: dict[str, Any] = {}

    def submit() -> None:
        sc.setJobGroup(group, f"hora.spark.run: {num_proc} ranks", interruptOnCancel=True)
        try:
            if df is not None:
                box["ranks"] = df.mapInArrow(functools.partial(arrow_task, job), "rank int", barrier=True).collect()
            else:
                rdd = sc.parallelize(range(num_proc), num_proc).barrier()
                box["ranks"] = rdd.mapPartitions(functools.partial(rdd_task, job)).collect()
        except BaseException as e:  # reported by the loop below
            box["error"] = e

    started = time.monotonic()
    thread = threading.Thread(target=submit, name="hora-spark-job", daemon=True)
    thread.start()
    outcomes: dict[int, _Outcome] = {}
    first_failure: float | None = None
    ended_at: float | None = None
    launch_failure: str | None = None  # MPI mode: mpirun could not start the ranks, in its own words
    try:
        while True:
            try:
                message = channel.messages.get(timeout=0.05)
            except queue.Empty:
                message = None
            now = time.monotonic()
            if message is not None:
                if message[0] == "out":
                    output.line(message[1], message[2], message[3])
                elif message[0] == "outcome":
                    outcome = _Outcome(message[1], *message[2:])
                    outcomes[outcome.rank] = outcome
                    if outcome.returncode != 0 and first_failure is None:
                        first_failure = now
                        log.debug("hora.spark: rank %d failed; cancelling the job", outcome.rank)
                        sc.cancelJobGroup(group)
                elif message[0] == "failed":
                    # mpirun ended the job without a rank exit to blame (an aborting rank takes its wrapper
                    # along): a rank's own error, reported next by its task, still wins over mpirun's words.
                    launch_failure = str(message[2])
                    first_failure = first_failure or now
                    sc.cancelJobGroup(group)
                continue
            if first_failure is not None and now - first_failure >= FAILURE_GRACE_S and launch_failure is None:
                break
            if launch_failure is not None and (len(outcomes) >= num_proc or now - first_failure >= LAUNCH_GRACE_S):
                break
            if not thread.is_alive():
                ended_at = ended_at or now
                if "error" in box and now - ended_at >= FAILURE_GRACE_S:
                    break
                if len(outcomes) >= num_proc or now - ended_at >= DRAIN_S:
                    break
        if verbose >= 2:
            for rank in sorted(outcomes):
                log.info("hora.spark: rank %d ran on %s (exit code %d)", rank, outcomes[rank].host,
                         outcomes[rank].returncode)
        if first_failure is not None:
            thread.join(timeout=CANCEL_WAIT_S)
            failed = sorted((o for o in outcomes.values() if o.returncode != 0), key=lambda o: o.at)
            root = next((o for o in failed if not o.consequence()), None)
            if root is None and launch_failure is not None:
                raise LaunchError(launch_failure)
            raise (root or failed[0]).error()
        if "error" in box:
            raise LaunchError(f"the Spark job of hora.spark.run failed before any rank reported: "
                              f"{_summary(str(box['error']))}") from None
        missing = sorted(set(range(num_proc)) - set(outcomes))
        if missing:
            raise LaunchError(f"the Spark job ended but ranks {missing} never reported their outcome to the driver")
        if verbose >= 1:
            log.info("hora.spark: %d ranks finished in %.1f s", num_proc, time.monotonic() - started)
        if job.payload is None:
            return None
        return [outcomes[r].loaded()[1] for r in range(num_proc)]  # type: ignore[index]
    finally:
        channel.close()
        if thread.is_alive():
            sc.cancelJobGroup(group)


def _driver_address(sc: Any) -> str:
    """The address executors reach the driver on: Spark's ``spark.driver.host``, as an IPv4 address."""
    import socket

    host = sc.getConf().get("spark.driver.host", None) or socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _run_local(
    command: tuple[str, ...] | None,
    fn: Callable[..., Any] | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    num_proc: int,
    start_timeout: float | None,
    env: dict[str, str],
    nics: tuple[str, ...] | None,
    verbose: int,
    df: Any,
    controller: str = "gloo",
    mpi_args: tuple[str, ...] = (),
) -> list[Any] | None:
    """No Spark cluster: the ranks run on this machine through ``hora.run`` (``hora run`` for a script)."""
    from hora.runner.api import run as hora_run

    directory = None
    try:
        if df is not None:
            check_schema(df.schema)
            directory = tempfile.mkdtemp(prefix="hora-spark-local-")
            rows = df.repartition(num_proc).mapInArrow(
                functools.partial(_spill_partition, directory), "partition int, rows long").collect()
            counts = [0] * num_proc
            for row in rows:
                counts[row.partition] = row.rows
            write_meta(directory, counts)
            env = {**env, HORA_SPARK_DATA: directory}
        network_interface = ",".join(nics) if nics else None
        if fn is not None:
            return hora_run(fn, args=args, kwargs=kwargs, np=num_proc, start_timeout=start_timeout,
                            controller=controller, mpi_args=mpi_args, network_interface=network_interface, env=env,
                            verbose=verbose >= 2)
        from hora.runner.launch import run_job
        from hora.runner.launch_config import LaunchConfig

        assert command is not None
        result = run_job(LaunchConfig(command=[sys.executable, *command], num_proc=num_proc, controller=controller,
                                      launcher="mpi" if controller == "mpi" else None, mpi_args=mpi_args,
                                      start_timeout=start_timeout, network_interface=network_interface, env=env))
        if result.exit_code != 0:
            cause = result.root_cause
            if cause is None:
                raise LaunchError(result.message or f"the job failed with exit code {result.exit_code}")
            raise WorkerFailedError(cause.rank, cause.returncode, cause.host, "\n".join(cause.stderr_tail))
        return None
    finally:
        if directory is not None:
            import shutil

            shutil.rmtree(directory, ignore_errors=True)


def _spill_partition(directory: str, batches: Any) -> Any:
    """Local mode's spill: partition ``p`` becomes rank ``p``'s file in the driver's temporary directory."""
    import pyarrow as pa
    from pyspark import TaskContext

    partition = TaskContext.get().partitionId()
    rows = spill(batches, rank_file(directory, partition))
    yield pa.RecordBatch.from_arrays([pa.array([partition], pa.int32()), pa.array([rows], pa.int64())],
                                     names=["partition", "rows"])
