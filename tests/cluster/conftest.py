"""The emulated 3-host cluster the multi-node tests run on (see :mod:`hora.testing.emulate`).

One cluster serves the whole session; it is torn down by the fixture's
finalizer (and, should the process die, by the stale sweep of the next run).
It needs root and ``ip netns``.  The system packages (sshd; Slurm and the grid
engine for their modules) are installed here, on the test path, by
``system-packages.sh`` when missing, since the library never installs
anything.  Without them every test here is skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from hora.testing.emulate import ClusterUnavailable, EmulatedCluster

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]


def install_system_packages(*groups: str) -> None:
    """Install the Debian packages of ``groups`` (``ssh``, ``slurm``, ``sge``) when missing (root and apt-get only)."""
    subprocess.run(["bash", str(Path(__file__).parent / "system-packages.sh"), *groups], timeout=900, check=False)


@pytest.fixture(scope="session")
def cluster():
    """Three hosts h1, h2, h3 with sshd, on one bridge; commands run on them with ``cluster.run``."""
    install_system_packages("ssh")
    try:
        emulated = EmulatedCluster(3).start()
    except ClusterUnavailable as e:
        pytest.skip(f"no emulated cluster on this machine: {e}")
    yield emulated
    emulated.close()


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment without job variables that would leak into the launched job."""
    prefixes = ("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "DMLC_", "SLURM_", "GLOO_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = str(REPO)  # the hosts share the file system: the same checkout everywhere
    env.update(extra or {})
    return env


def hora_argv(cluster: EmulatedCluster, args: Sequence[str]) -> list[str]:
    """``hora run`` with the cluster's ssh config, then ``args``."""
    return [sys.executable, "-m", "hora.runner.cli", "run", "--ssh-config-file", cluster.ssh_config, *args]


@pytest.fixture
def job_env() -> dict[str, str]:
    """The environment to start a launcher with (see :func:`clean_env`)."""
    return clean_env()


@pytest.fixture
def popen_on_h1(cluster):
    """Start ``hora run ARGS`` on h1 in the background (text pipes); killed at the end if still running."""
    started: list[subprocess.Popen] = []

    def start(*args: str, **kwargs) -> subprocess.Popen:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        started.append(cluster.popen("h1", hora_argv(cluster, args), text=True, env=clean_env(), cwd=str(REPO),
                                     **kwargs))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def leftovers(cluster):
    """A function that waits (up to 15 s) for every host to run nothing but sshd, and returns what is left."""

    def wait(timeout: float = 15.0) -> dict[str, list[int]]:
        deadline = time.monotonic() + timeout
        while True:
            left = netns_pids(cluster)
            if not any(left.values()) or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    return wait


@pytest.fixture
def hora_on_h1(cluster):
    """Run ``hora run ARGS`` on h1 (as a user logged in there would) and return the finished process."""

    def run(*args: str, cwd: str | os.PathLike = REPO, timeout: float = 90,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        try:
            return cluster.run("h1", hora_argv(cluster, args), cwd=str(cwd), timeout=timeout, env=clean_env(env))
        except subprocess.TimeoutExpired as e:
            raise AssertionError(
                f"hora run {' '.join(args)} did not end in {timeout} s\nstdout: {e.stdout!r}\nstderr: {e.stderr!r}"
            ) from None

    return run


def netns_pids(cluster: EmulatedCluster) -> dict[str, list[int]]:
    """The processes in each host's network namespace, other than its sshd."""
    found = {}
    for host in cluster.hosts:
        out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=30).stdout
        found[host.name] = sorted(int(p) for p in out.split() if int(p) != host.pid)
    return found
