"""What the Spark tests share: why they skip, and a Spark session that leaves no JVM behind.

The tests skip, saying why, when pyspark or a Java 17+ runtime is missing
(``./dev setup`` installs both: pyspark, and Debian's openjdk-17-jre-headless when no java is on PATH).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Small on purpose: two executors of one core each share a 2-core machine with the driver.
SESSION_CONF = {
    "spark.executor.memory": "512m",
    "spark.driver.memory": "512m",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.executorEnv.PYTHONPATH": str(ROOT),
    # stall warnings in 10 s instead of 60, so a rank that waits on a dead peer says so soon
    "spark.executorEnv.HORA_STALL_CHECK_TIME_SECONDS": "10",
}


def _java_version(java: str) -> int | None:
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def java_skip_reason() -> str | None:
    """Why the Spark tests cannot run here, or None; points JAVA_HOME at the first Java 17+ found."""
    if importlib.util.find_spec("pyspark") is None:
        return "pyspark is not installed: pip install 'hora[spark]' (./dev setup installs it)"
    candidates = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(os.path.join(os.environ["JAVA_HOME"], "bin", "java"))
    if shutil.which("java"):
        candidates.append(shutil.which("java"))
    for java in candidates:
        version = _java_version(java)
        if version is not None and version >= 17:
            if not shutil.which("java") or os.path.realpath(shutil.which("java")) != os.path.realpath(java):
                os.environ["JAVA_HOME"] = str(Path(java).parent.parent)
            return None
    return ("no Java 17+ runtime: Spark needs one (./dev setup installs openjdk-17-jre-headless with apt-get as "
            "root; elsewhere install a JDK 17+ and put it on PATH or in JAVA_HOME)")


def skip_without_spark() -> None:
    """Skip the calling module when Spark cannot run here."""
    reason = java_skip_reason()
    if reason:
        pytest.skip(reason, allow_module_level=True)


def _stop_gateway() -> None:
    """End the driver's JVM (pyspark keeps it for the life of the process otherwise)."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return
    with contextlib.suppress(Exception):
        gateway.shutdown()
    proc = getattr(gateway, "proc", None)
    if proc is not None:
        with contextlib.suppress(Exception):
            proc.terminate()
            proc.wait(timeout=20)
    SparkContext._gateway = None
    SparkContext._jvm = None


@contextlib.contextmanager
def spark_session(master: str, **conf: str) -> Iterator[object]:
    """A SparkSession on ``master``; at exit it is stopped, its driver JVM ended and its work files removed."""
    from pyspark.sql import SparkSession

    # Spark's Python workers run PYSPARK_PYTHON, else whatever `python3` is on PATH: point them at this
    # interpreter, so the tests do not depend on the venv being activated.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName("hora-tests")
    for key, value in {**SESSION_CONF, **conf}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    app = session.sparkContext.applicationId
    try:
        session.sparkContext.setLogLevel("ERROR")
        yield session
    finally:
        session.stop()
        _stop_gateway()
        import pyspark

        # local-cluster executors write their logs under SPARK_HOME/work/<app>
        shutil.rmtree(os.path.join(os.path.dirname(pyspark.__file__), "work", app), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(os.path.dirname(pyspark.__file__), "work"))


@contextlib.contextmanager
def local_cluster() -> Iterator[object]:
    """The tests' ``local-cluster[2,1,1024]`` session (2 executors of 1 core), once both executors registered."""
    import time

    from hora.spark.driver import slot_count

    with spark_session("local-cluster[2,1,1024]") as session:
        deadline = time.monotonic() + 120  # executors register a few seconds after the session starts
        while slot_count(session.sparkContext)[0] < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        yield session


@pytest.fixture(scope="module")
def spark():
    """One :func:`local_cluster` session per test module that asks for ``spark``."""
    with local_cluster() as session:
        yield session


def rank_processes() -> list[int]:
    """The PIDs of hora.spark ranks still running on this machine (a function's rank runs ``run_task``)."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "hora.runner.run_task" in cmdline and any("hora-spark-" in part for part in cmdline):
            found.append(process.info["pid"])
    return found


def one_rank_raises(error: BaseException) -> None:
    """A rank's function: the ranks join, then rank 1 prints ``raising at <time>`` and raises ``error`` while
    rank 0 sleeps 120 s, as long as the job would take if the failure did not end it."""
    import time

    import torch

    import hora.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(1))  # both ranks are up and joined
    if hvd.rank() == 1:
        print(f"raising at {time.time()}", flush=True)
        raise error
    time.sleep(120)


def run_raising_job(error: BaseException, **run_kwargs: object) -> tuple[object, float, str]:
    """Run :func:`one_rank_raises` with ``hora.spark.run(**run_kwargs)`` on 2 ranks; return the
    ``RankFailedError`` it raised, the seconds from rank 1's raise to the driver's error, and the stdout."""
    import io
    import time

    import hora.spark
    from hora.errors import RankFailedError

    out = io.StringIO()
    with pytest.raises(RankFailedError) as info:
        hora.spark.run(one_rank_raises, args=(error,), num_proc=2, stdout=out, **run_kwargs)
    raised_at = float(re.search(r"raising at ([\d.]+)", out.getvalue()).group(1))
    return info.value, time.time() - raised_at, out.getvalue()


#: A rank's script: allreduce, then write ``total engine args...`` to ``DIR/rank<r>.txt`` (``DIR`` is argv[1]).
SCRIPT = """
import sys
import torch
import hora.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
with open(f"{sys.argv[1]}/rank{hvd.rank()}.txt", "w") as f:
    f.write(f"{total} {'mpi' if hvd.mpi_enabled() else 'gloo'} {' '.join(sys.argv[2:])}")
"""


def run_script_job(directory: Path, **run_kwargs: object) -> list[str]:
    """Run :data:`SCRIPT` as a 2-rank ``hora.spark.run`` job with ``--epochs 3``; the two ranks' files."""
    import hora.spark

    script = directory / "job.py"
    script.write_text(SCRIPT)
    assert hora.spark.run(str(script), args=(str(directory), "--epochs", "3"), num_proc=2, **run_kwargs) is None
    return [(directory / f"rank{rank}.txt").read_text() for rank in (0, 1)]


@pytest.fixture(autouse=True)
def _functions_by_value(request):
    """The ranks cannot import test modules: ship a test module's functions (and this one's) by value."""
    cloudpickle = pytest.importorskip("cloudpickle")
    modules = [request.module, sys.modules[__name__]]
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    yield
    for module in modules:
        with contextlib.suppress(ValueError):
            cloudpickle.unregister_pickle_by_value(module)
