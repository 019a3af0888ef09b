"""`hora run` inside a Slurm allocation: slurmctld on h1 and slurmd on h1..h3 of the emulated cluster.

The allocation comes from ``salloc -N 3 -n 6``; inside it, ``hora run`` picks
the slurm launcher by itself and starts the ranks with srun.  Debian's
slurm-wlm is installed by the test set-up when missing (see
``system-packages.sh``); where that fails the tests are skipped with the
reason.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from hora.testing.emulate import ClusterUnavailable
from tests.cluster.conftest import install_system_packages

pytestmark = [pytest.mark.netns, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CRASH = REPO / "tests" / "runner" / "scripts" / "crash.py"


@pytest.fixture(scope="module")
def slurm(cluster):
    """The environment (``SLURM_CONF``) of a 3-node Slurm cluster running on the emulated hosts."""
    install_system_packages("slurm")
    try:
        env = cluster.start_slurm(cpus_per_host=2)
    except ClusterUnavailable as e:
        pytest.skip(f"no Slurm on the emulated cluster: {e}")
    yield env
    cluster.stop_slurm()


def in_allocation(cluster, slurm, *hora_args: str, timeout: float = 120):
    env = {k: v for k, v in slurm.items() if not k.startswith(("HORA_", "OMPI_", "PMIX_", "SLURM_JOB"))}
    env["SLURM_CONF"] = slurm["SLURM_CONF"]
    env["PYTHONPATH"] = str(REPO)
    env.pop("OMP_NUM_THREADS", None)
    command = ["salloc", "-N", "3", "-n", "6", sys.executable, "-m", "hora.runner.cli", "run", *hora_args]
    return cluster.run("h1", command, env=env, cwd=str(REPO), timeout=timeout)


@pytest.mark.timeout(180)
def test_ranks_start_with_srun_on_every_node_of_the_allocation(cluster, slurm):
    result = in_allocation(cluster, slurm, "--verbose", "-np", "6", "python", "-m", "hora.runner.check")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "launcher slurm, controller gloo" in result.stderr  # chosen automatically inside the allocation
    assert "srun --ntasks 6 --kill-on-bad-exit=1" in result.stderr
    hosts = {}
    for line in result.stdout.splitlines():
        if ": allreduce ok, hosts h1,h1,h2,h2,h3,h3" in line:
            rank = int(line[1:line.index("]")])
            hosts[rank] = line.split(" on ", 1)[1].split()[0]
    assert hosts == {0: "h1", 1: "h1", 2: "h2", 3: "h2", 4: "h3", 5: "h3"}, result.stdout


@pytest.mark.timeout(180)
def test_a_failing_rank_ends_the_srun_job_with_the_root_cause(cluster, slurm):
    start = time.monotonic()
    result = in_allocation(cluster, slurm, "-np", "6", "python", str(CRASH), "exit3")
    elapsed = time.monotonic() - start
    assert result.returncode == 3, result.stderr[-3000:]
    assert elapsed < 40, f"took {elapsed:.1f} s"
    assert "root cause: rank 1 on h1 exited with code 3" in result.stderr
    assert "    rank 1 is failing on purpose" in result.stderr
    assert "was not stopped" not in result.stdout
