"""`hora run -np W -s S`: a scheduler and S parameter servers beside the workers, on this machine.

The servers are hora's real ones (``python -m hora.kvstore.ps.node``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

PY = sys.executable
SCRIPTS = Path(__file__).parent / "scripts"
pytest.importorskip("zmq", reason="parameter servers need pyzmq (pip install 'hora[ps]')")


@pytest.mark.timeout(90)
def test_dist_sync_workers_with_a_scheduler_and_servers(hora_cli):
    result = hora_cli("run", "-np", "2", "-s", "1", "--verbose", PY, str(SCRIPTS / "ps_sum.py"), timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(line for line in result.stdout.splitlines() if "sums ok" in line) == [
        f"[{r}]<stdout>:worker {r} of 2 on {line_host(result.stdout, r)}: dist_sync sums ok" for r in range(2)
    ]
    assert "hora run: scheduler on " in result.stderr and ", server 0 on " in result.stderr
    assert re.search(r"^\[scheduler\]<stderr>:.*scheduler listening on tcp://127\.0\.0\.1:\d+", result.stderr, re.M)
    assert re.search(r"^\[server 0\]<stderr>:.*serving at tcp://127\.0\.0\.1:\d+", result.stderr, re.M)


def line_host(stdout: str, rank: int) -> str:
    match = re.search(rf"^\[{rank}\]<stdout>:worker {rank} of 2 on (\S+):", stdout, re.M)
    assert match, stdout
    return match.group(1)


@pytest.mark.timeout(90)
def test_servers_stop_after_the_workers_succeed_and_the_job_exits_0(hora_cli):
    start = time.monotonic()
    result = hora_cli("run", "-np", "2", "--verbose", "-s", PY, str(SCRIPTS / "ps_env.py"), timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    assert "job failed" not in result.stderr
    assert "server 0 on" in result.stderr and "server 1 on" in result.stderr  # -s alone: as many as workers
    # The workers never joined the servers; they get 5 s to exit on their own, then are stopped.
    assert 4.5 < elapsed < 30, f"took {elapsed:.1f} s"
    envs = [json.loads(line.split("DMLC ", 1)[1]) for line in result.stdout.splitlines() if "<stdout>:DMLC " in line]
    assert len(envs) == 2
    for env in envs:
        assert (env["DMLC_ROLE"], env["DMLC_NUM_SERVER"], env["DMLC_NUM_WORKER"]) == ("worker", "2", "2")
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1" and env["DMLC_PS_ROOT_PORT"].isdigit()


@pytest.mark.timeout(90)
def test_a_dying_server_ends_the_job_with_the_root_cause(tmp_path, clean_env):
    proc = subprocess.Popen(
        [PY, "-m", "hora.runner.cli", "run", "-np", "2", "-s", "1", PY, str(SCRIPTS / "wait_signal.py"),
         str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        server = find_server(proc.pid)
        ready = 0
        while ready < 2:  # both workers are up before the server dies
            ready += "ready" in proc.stdout.readline()  # type: ignore[union-attr]
        start = time.monotonic()
        os.kill(server, signal.SIGKILL)
        proc.wait(timeout=30)
        elapsed = time.monotonic() - start
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(lines)
    assert proc.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    assert elapsed < 10
    assert re.search(r"root cause: server 0 on \S+ was killed by signal SIGKILL \(9\)", stderr), stderr[-3000:]
    assert "stopped by hora run: scheduler" in stderr  # the workers exit 0 on SIGTERM, so they are not listed
    for rank in range(2):  # but they were stopped
        assert (tmp_path / f"got.{rank}").read_text() == "SIGTERM"


def find_server(launcher_pid: int, timeout: float = 30) -> int:
    """The pid of the launcher's child that runs the parameter server."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher_pid).children(recursive=True):
            try:
                if "hora.kvstore.ps.node" in child.cmdline() and child.environ().get("DMLC_ROLE") == "server":
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise AssertionError("no server process found")


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_server_hosts_put_the_servers_on_a_host_without_workers(clean_env):
    """On an emulated 3-host cluster: 2 workers on h1 and h2, ``--server-hosts h3`` puts both servers on h3."""
    from hora.testing import emulate
    try:
        cluster = emulate.EmulatedCluster(3).start()
    except emulate.ClusterUnavailable as e:
        pytest.skip(f"no emulated cluster on this machine: {e}")
    try:
        env = clean_env({"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        argv = [PY, "-m", "hora.runner.cli", "run", "--ssh-config-file", cluster.ssh_config, "-np", "2",
                "-H", "h1,h2", "-s", "2", "--server-hosts", "h3", "--verbose", PY, str(SCRIPTS / "ps_sum.py")]
        result = cluster.run("h1", argv, timeout=120, env=env)
    finally:
        cluster.close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "scheduler on h1, server 0 on h3, server 1 on h3" in result.stderr
    h3 = re.escape(cluster.host("h3").addr)
    assert len(re.findall(rf"^\[server \d\]<stderr>:.*serving at tcp://{h3}:\d+", result.stderr, re.M)) == 2
    oks = sorted(line.split(":", 1)[1] for line in result.stdout.splitlines() if "sums ok" in line)
    assert oks == [f"worker {r} of 2 on h{r + 1}: dist_sync sums ok" for r in range(2)]
