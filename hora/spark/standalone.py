"""A real Spark standalone cluster on this machine (one master, one worker), for tests and benchmarks.

``spark-class`` starts the master and the worker as this process's children,
on free ports, with the master's REST submission server off and small JVM
heaps; :meth:`StandaloneCluster.stop` ends them by their PIDs (the worker
ends its executors) and waits until they are gone::

    with StandaloneCluster(cores=2, memory_mb=1024) as cluster:
        spark = SparkSession.builder.master(cluster.url).getOrCreate()
        ...
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping

from hora.errors import LaunchError
from hora.runner.env import free_port

#: Heap of the master and worker daemons themselves (executors get their own ``spark.executor.memory``).
DAEMON_MEMORY = "256m"


def spark_home() -> str:
    """The Spark installation: ``$SPARK_HOME``, else the one inside the pyspark package."""
    home = os.environ.get("SPARK_HOME")
    if home:
        return home
    import pyspark

    return os.path.dirname(pyspark.__file__)


class StandaloneCluster:
    """One standalone master and one worker with ``cores`` and ``memory_mb``, started by :meth:`start`."""

    def __init__(self, cores: int = 2, memory_mb: int = 1024, host: str = "127.0.0.1",
                 start_timeout: float = 120.0, env: Mapping[str, str] | None = None) -> None:
        self.cores = cores
        self.memory_mb = memory_mb
        self.host = host
        self.start_timeout = start_timeout
        self.env = dict(env or {})
        self.directory = ""
        self.port = 0
        self.master: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The master's URL, ``spark://host:port``."""
        return f"spark://{self.host}:{self.port}"

    @property
    def pids(self) -> list[int]:
        """The PIDs of the master and the worker started (their JVMs)."""
        return [p.pid for p in (self.master, self.worker) if p is not None]

    def _spawn(self, name: str, args: list[str], opts: str) -> subprocess.Popen:
        env = {**os.environ, **self.env, "SPARK_DAEMON_MEMORY": DAEMON_MEMORY, "SPARK_NO_DAEMONIZE": "1",
               "SPARK_LOG_DIR": self.directory, "SPARK_MASTER_OPTS": opts, "SPARK_WORKER_OPTS": opts}
        log = open(os.path.join(self.directory, f"{name}.log"), "wb")
        try:
            return subprocess.Popen([os.path.join(spark_home(), "bin", "spark-class"), *args], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def start(self) -> StandaloneCluster:
        """Start the master, wait until it listens, start the worker; return self.

        Raises:
            LaunchError: a daemon exited, or the master did not listen within ``start_timeout``.
        """
        self.directory = tempfile.mkdtemp(prefix="hora-spark-standalone-")
        self.port = free_port(self.host)
        opts = "-Dspark.master.rest.enabled=false -Dspark.ui.enabled=false"
        try:
            self.master = self._spawn("master", [
                "org.apache.spark.deploy.master.Master", "--host", self.host, "--port", str(self.port),
                "--webui-port", str(free_port(self.host))], opts)
            self._wait_listening()
            self.worker = self._spawn("worker", [
                "org.apache.spark.deploy.worker.Worker", self.url, "--host", self.host,
                "--cores", str(self.cores), "--memory", f"{self.memory_mb}m", "--webui-port",
                str(free_port(self.host)), "--work-dir", os.path.join(self.directory, "work")], opts)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            assert self.master is not None
            if self.master.poll() is not None:
                raise LaunchError(f"the Spark master exited with code {self.master.returncode}: {self.log('master')}")
            try:
                with socket.create_connection((self.host, self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise LaunchError(f"the Spark master did not listen on {self.url} within {self.start_timeout:g} s")

    def log(self, name: str) -> str:
        """The last lines of the master's or worker's log."""
        try:
            with open(os.path.join(self.directory, f"{name}.log"), encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-20:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the worker, then the master, by PID; SIGKILL what is left after ``timeout``; safe twice."""
        for process in (self.worker, self.master):
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
