"""`hora run --gloo`: the local launcher, as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hora.runner.env import available_cpus

PY = sys.executable


def env_lines(stdout: str) -> dict[int, dict[str, str]]:
    """The ENV lines of env_dump.py by rank, checking each is prefixed with the rank that printed it."""
    found = {}
    for line in stdout.splitlines():
        prefix, sep, rest = line.partition("<stdout>:ENV ")
        if sep:
            values = json.loads(rest)
            assert prefix == f"[{values['HORA_RANK']}]"
            found[int(values["HORA_RANK"])] = values
    return found


@pytest.mark.timeout(60)
def test_output_prefix_and_env_per_rank(hora_cli, scripts):
    result = hora_cli("run", "--gloo", "-np", "3", PY, str(scripts / "env_dump.py"))
    assert result.returncode == 0, result.stderr
    ranks = env_lines(result.stdout)
    assert sorted(ranks) == [0, 1, 2]
    for rank, env in ranks.items():
        assert env["HORA_SIZE"] == "3" and env["HORA_LOCAL_SIZE"] == "3"
        assert env["HORA_LOCAL_RANK"] == str(rank)
        assert (env["HORA_CROSS_RANK"], env["HORA_CROSS_SIZE"]) == ("0", "1")
        assert env["HORA_CONTROLLER"] == "gloo" and env["HORA_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert env["PYTHONUNBUFFERED"] == "1" and env["HORA_HOSTNAME"]
        assert env["HORA_FUSION_THRESHOLD"] is None  # knobs only when their flag is given
    # one job: one rendezvous port and one secret shared by every rank
    assert len({env["HORA_RENDEZVOUS_PORT"] for env in ranks.values()}) == 1
    assert len({env["HORA_SECRET"] for env in ranks.values()}) == 1
    for rank in range(3):
        assert f"[{rank}]<stderr>:hello from rank {rank} on stderr" in result.stderr.splitlines()


@pytest.mark.timeout(60)
def test_horovodrun_log_level_flag(hora_cli):
    """horovodrun's --log-level is accepted: DEBUG shows hora run's own log, WARNING keeps it quiet."""
    code = "import os; print(os.environ['HORA_RANK'])"
    result = hora_cli("run", "--gloo", "-np", "2", "--log-level", "DEBUG", PY, "-c", code)
    assert result.returncode == 0, result.stderr
    assert "hora run: rank 1 started as pid" in result.stderr
    result = hora_cli("run", "--gloo", "-np", "2", "--log-level", "warning", PY, "-c", code)
    assert result.returncode == 0, result.stderr
    assert "started as pid" not in result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:0", "[1]<stdout>:1"]
    result = hora_cli("run", "--gloo", "-np", "1", "--log-level", "LOUD", PY, "-c", "pass")
    assert result.returncode == 2 and "--log-level" in result.stderr


@pytest.mark.timeout(60)
def test_omp_num_threads_notice_and_value(hora_cli, scripts):
    result = hora_cli("run", "--gloo", "-np", "2", PY, str(scripts / "env_dump.py"))
    expected = str(max(1, available_cpus() // 2))
    assert {env["OMP_NUM_THREADS"] for env in env_lines(result.stdout).values()} == {expected}
    assert result.stderr.count("hora run: setting OMP_NUM_THREADS") == 1
    assert f"setting OMP_NUM_THREADS={expected} for each process" in result.stderr
    assert "set OMP_NUM_THREADS yourself to override" in result.stderr

    result = hora_cli("run", "--gloo", "-np", "2", PY, str(scripts / "env_dump.py"), env={"OMP_NUM_THREADS": "7"})
    assert {env["OMP_NUM_THREADS"] for env in env_lines(result.stdout).values()} == {"7"}
    assert "OMP_NUM_THREADS" not in result.stderr


@pytest.mark.timeout(60)
def test_knob_flags_reach_the_workers(hora_cli, scripts, tmp_path):
    result = hora_cli(
        "run", "--gloo", "-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "5", "--start-timeout", "20",
        "--timeline-filename", str(tmp_path / "tl.json"), "--network-interface", "lo",
        "--output-filename", str(tmp_path / "logs"), PY, str(scripts / "env_dump.py"),
        env={"HORA_TEST_EXTRA": "kept"},
    )
    assert result.returncode == 0, result.stderr
    for env in env_lines(result.stdout).values():
        assert env["HORA_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
        assert env["HORA_CYCLE_TIME"] == "5" and env["HORA_START_TIMEOUT"] == "20"
        assert env["HORA_TIMELINE"] == str(tmp_path / "tl.json")
        assert env["HORA_NETWORK_INTERFACE"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
        assert env["HORA_TEST_EXTRA"] == "kept"
    for rank in range(2):
        assert (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text().startswith("ENV {")
        assert (tmp_path / "logs" / f"rank.{rank}" / "stderr").read_text() == f"hello from rank {rank} on stderr\n"


@pytest.mark.timeout(60)
def test_worker_crash_stops_the_job_and_names_the_root_cause(hora_cli, scripts):
    start = time.monotonic()
    result = hora_cli("run", "--gloo", "-np", "2", PY, str(scripts / "crash.py"), "exit3")
    elapsed = time.monotonic() - start
    assert result.returncode == 3
    assert elapsed < 10, f"the launcher took {elapsed:.1f} s to stop the job"
    assert "rank 0 was not stopped" not in result.stdout
    report = result.stderr[result.stderr.index("hora run: job failed"):]
    assert "  root cause: rank 1 on " in report and " exited with code 3" in report
    assert "  last stderr lines of rank 1:\n    rank 1 is failing on purpose" in report
    assert "stopped by hora run: rank 0" in report
    assert "[1]<stderr>:rank 1 is failing on purpose" in result.stderr


@pytest.mark.timeout(60)
def test_rank_killed_by_sigkill(hora_cli, scripts):
    start = time.monotonic()
    result = hora_cli("run", "--gloo", "-np", "2", PY, str(scripts / "crash.py"), "sigkill")
    assert time.monotonic() - start < 10
    assert result.returncode == 128 + signal.SIGKILL
    assert "root cause: rank 1 on " in result.stderr
    assert "was killed by signal SIGKILL (9)" in result.stderr
    assert "rank 1 wrote nothing to stderr" in result.stderr


@pytest.mark.timeout(60)
def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(hora_cli, scripts):
    start = time.monotonic()
    result = hora_cli("run", "--gloo", "-np", "2", PY, str(scripts / "crash.py"), "stubborn")
    elapsed = time.monotonic() - start
    assert result.returncode == 3
    assert 2.5 < elapsed < 12, f"expected SIGKILL after the ~3 s grace period, took {elapsed:.1f} s"
    assert "root cause: rank 1 on " in result.stderr


@pytest.mark.timeout(30)
def test_nonexistent_command_fails_fast_with_its_name(hora_cli):
    start = time.monotonic()
    result = hora_cli("run", "--gloo", "-np", "2", "nonexistent_cmd")
    assert time.monotonic() - start < 10
    assert result.returncode == 1
    assert "hora run: error: cannot run 'nonexistent_cmd': command not found on PATH" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-np", "2", "--bogus", "python"], "hora run: error: unrecognized arguments: --bogus"),
        (["-np", "2"], "hora run: error: no command given"),
        (["-np", "0", "python"], "hora run: error: -np 0 must be at least 1"),
        (["-np", "3", "-H", "localhost:2", "python"], "-np 3 is more than the 2 slots in -H localhost:2"),
        (["-np", "two", "python"], "argument -np/--num-proc: invalid int value: 'two'"),
        (["--gloo", "--mpi", "-np", "2", "python"], "argument --mpi: not allowed with argument --gloo"),
    ],
)
def test_usage_errors_exit_2_without_traceback(hora_cli, args, message):
    result = hora_cli("run", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "usage: hora run" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(30)
def test_slurm_launcher_outside_an_allocation_is_a_clear_error(hora_cli):
    result = hora_cli("run", "-np", "2", "--launcher", "slurm", "python")
    assert result.returncode == 1
    assert "--launcher slurm runs inside a Slurm allocation (SLURM_JOB_ID is not set)" in result.stderr


@pytest.mark.timeout(30)
def test_console_script_and_no_subcommand(hora_cli, clean_env):
    hora = os.path.join(os.path.dirname(PY), "hora")
    if not os.path.exists(hora):
        pytest.skip("the hora console script is not installed next to this Python")
    result = subprocess.run([hora, "run", "-np", "1", PY, "-c", "print('ok')"], capture_output=True, text=True,
                            timeout=30, env=clean_env())
    assert result.returncode == 0 and result.stdout == "[0]<stdout>:ok\n"
    result = hora_cli()
    assert result.returncode == 2 and "a command is required" in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_all_workers(launcher_bg, scripts, tmp_path, signum):
    job = launcher_bg("--gloo", "-np", "2", PY, str(scripts / "wait_signal.py"), str(tmp_path))
    job.wait_for("<stdout>:ready", 2)
    start = time.monotonic()
    job.proc.send_signal(signum)
    stderr = job.finish()
    assert time.monotonic() - start < 10
    assert job.proc.returncode == 128 + signum
    name = signal.Signals(signum).name
    for rank in range(2):
        assert (tmp_path / f"got.{rank}").read_text() == name
        assert f"[{rank}]<stdout>:rank {rank} got {name}\n" in job.stdout
    assert f"hora run: stopped all workers after receiving {name}" in stderr
