"""`hora run --mpi`: mpirun starts the ranks through hora's per-rank wrapper."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from hora.errors import LaunchError
from hora.runner.launchers.mpi import find_mpirun

PY = sys.executable

try:
    import mpi4py  # noqa: F401

    find_mpirun(os.environ)
except (ImportError, LaunchError) as e:
    pytest.skip(f"the mpi launcher needs mpi4py and mpirun: {e}", allow_module_level=True)


@pytest.mark.timeout(60)
def test_mpi4py_allreduce_joins_one_job_with_prefixed_output(hora_cli, scripts):
    result = hora_cli("run", "--mpi", "-np", "2", PY, str(scripts / "mpi_allreduce.py"))
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    assert lines == [
        "[0]<stdout>:rank 0 of 2: sum 3 controller mpi",
        "[1]<stdout>:rank 1 of 2: sum 3 controller mpi",
    ]
    assert "__hora_rank_exit__" not in result.stderr  # markers are consumed by the launcher


@pytest.mark.timeout(60)
def test_one_machine_defaults_to_mpirun_and_gloo_flag_opts_out(hora_cli, scripts):
    # As horovodrun does when Horovod has MPI: no flag on one machine means mpirun and the MPI controller.
    result = hora_cli("run", "-np", "2", "--verbose", PY, str(scripts / "mpi_allreduce.py"))
    assert result.returncode == 0, result.stderr
    assert "launcher mpi, controller mpi" in result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "[0]<stdout>:rank 0 of 2: sum 3 controller mpi",
        "[1]<stdout>:rank 1 of 2: sum 3 controller mpi",
    ]
    result = hora_cli("run", "--gloo", "-np", "2", "--verbose", PY, "-c", "import os; print(os.environ['HORA_RANK'])")
    assert result.returncode == 0, result.stderr
    assert "launcher local, controller gloo" in result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:0", "[1]<stdout>:1"]


@pytest.mark.timeout(60)
def test_mpirun_failing_by_default_points_to_gloo(hora_cli):
    result = hora_cli("run", "-np", "2", "--mpi-args=--no-such-mpirun-flag", PY, "-c", "pass")
    assert result.returncode != 0
    assert "mpirun exited with code" in result.stderr and "before any rank failed" in result.stderr
    assert "hora run used mpirun because MPI is installed: pass --gloo" in result.stderr
    result = hora_cli("run", "--mpi", "-np", "2", "--mpi-args=--no-such-mpirun-flag", PY, "-c", "pass")
    assert result.returncode != 0 and "pass --gloo" not in result.stderr  # asked for --mpi: no advice


@pytest.mark.timeout(60)
def test_mpi_env_contract(hora_cli, scripts):
    result = hora_cli("run", "--mpi", "-np", "2", "--cycle-time-ms", "4", PY, str(scripts / "env_dump.py"))
    assert result.returncode == 0, result.stderr
    envs = [line.partition("<stdout>:ENV ")[2] for line in result.stdout.splitlines() if "<stdout>:ENV " in line]
    assert len(envs) == 2
    for raw in envs:
        env = json.loads(raw)
        assert env["HORA_CONTROLLER"] == "mpi" and env["HORA_CYCLE_TIME"] == "4"
        assert env["HORA_RANK"] is None  # under mpirun the ranks read OMPI_COMM_WORLD_*
        assert env["OMPI_COMM_WORLD_RANK"] in ("0", "1")
        assert env["PYTHONUNBUFFERED"] == "1" and env["OMP_NUM_THREADS"] and env["HORA_SECRET"]


@pytest.mark.timeout(60)
def test_mpi_rank_failure_ends_the_job_with_root_cause(hora_cli, scripts):
    start = time.monotonic()
    result = hora_cli("run", "--mpi", "-np", "2", PY, str(scripts / "crash.py"), "exit3")
    elapsed = time.monotonic() - start
    assert result.returncode == 3
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert "rank 0 was not stopped" not in result.stdout
    report = result.stderr[result.stderr.index("hora run: job failed"):]
    assert "root cause: rank 1 on " in report and "exited with code 3" in report
    assert "    rank 1 is failing on purpose" in report


@pytest.mark.timeout(60)
def test_mpi_rank_killed_by_signal(hora_cli, scripts):
    result = hora_cli("run", "--mpi", "-np", "2", PY, str(scripts / "crash.py"), "sigkill")
    assert result.returncode == 128 + signal.SIGKILL
    assert "root cause: rank 1 on " in result.stderr and "killed by signal SIGKILL" in result.stderr


@pytest.mark.timeout(60)
def test_mpi_sigterm_reaches_the_ranks(launcher_bg, scripts, tmp_path):
    job = launcher_bg("--mpi", "-np", "2", PY, str(scripts / "wait_signal.py"), str(tmp_path))
    job.wait_for("<stdout>:ready", 2)
    job.proc.send_signal(signal.SIGTERM)
    stderr = job.finish()
    assert job.proc.returncode == 128 + signal.SIGTERM
    for rank in range(2):  # mpirun turns every stop request into SIGTERM for the ranks
        assert (tmp_path / f"got.{rank}").read_text() == "SIGTERM"
    assert "stopped all workers after receiving SIGTERM" in stderr
