"""hora.spark's MPI mode without Spark: mpirun's command line, the rank table, the rsh agent's protocol,
the refusals, and mpirun failing to reach a host (a real mpirun, ended in seconds)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hora.errors import ConfigError, LaunchError
from hora.runner.launchers.mpi import mpi_launch_available
from hora.spark import mpi, rsh
from hora.spark.job import TaskJob
from hora.spark.mpi import RANKS_VAR, decode_table, encode_table
from hora.spark.plan import TaskInfo, job_env, plan_ranks

pytestmark = [pytest.mark.spark]

needs_mpi = pytest.mark.skipif(not mpi_launch_available(), reason="no mpirun or mpi4py: pip install 'hora[mpi]'")


def _job(**kw):
    values = dict(payload=b"x", command=None, sys_path=(), env=job_env(num_proc=3, start_timeout=None, nics=None,
                  env={}, controller="mpi"), driver=("127.0.0.1", 1), token="secret-token", nics=None,
                  with_data=False, controller="mpi", mpi_args=())
    values.update(kw)
    return TaskJob(**values)


def _two_hosts():
    # partition 0 and 2 on host b (10.0.0.2), partition 1 on host a (10.0.0.1): a sorts first
    infos = [TaskInfo(partition=0, host="b", addr="10.0.0.2", port=1), TaskInfo(partition=1, host="a",
             addr="10.0.0.1", port=2), TaskInfo(partition=2, host="b", addr="10.0.0.2", port=3, gpus=())]
    extras = [{"agent": 100 + i, "dir": f"/d{i}", "argv": ["py", "-m", "hora.runner.run_task", f"/d{i}"]}
              for i in range(3)]
    return infos, plan_ranks(infos), extras


def test_hosts_in_rank_order_and_one_serving_task_per_host():
    infos, slots, _ = _two_hosts()
    assert [s.rank for s in slots] == [1, 0, 2]
    assert mpi.mpirun_hosts(infos, slots) == [("10.0.0.1", 1), ("10.0.0.2", 2)]
    assert mpi.serving_tasks(infos, slots) == {"a": 1, "b": 0}


def test_the_rank_table_gives_each_rank_its_task_directory_and_placement():
    infos, slots, extras = _two_hosts()
    table = decode_table(encode_table(mpi.rank_table(_job(with_data=True), infos, slots, extras)))
    assert [entry["dir"] for entry in table] == ["/d1", "/d0", "/d2"]
    assert table[2]["argv"] == ["py", "-m", "hora.runner.run_task", "/d2"]
    assert table[2]["env"]["HORA_RANK"] == "2" and table[2]["env"]["HORA_LOCAL_RANK"] == "1"
    assert table[2]["env"]["HORA_CROSS_RANK"] == "1" and table[2]["env"]["HORA_HOSTNAME"] == "b"
    assert table[0]["env"]["HORA_SPARK_DATA"] == "/d1"
    # hundreds of ranks stay far below the kernel's 128 kB limit on one variable
    many = [{"dir": f"/local/dir/hora-spark-{i:04d}", "argv": ["python", "-m", "hora.runner.run_task"],
             "env": {"HORA_RANK": str(i), "HORA_SIZE": "512"}} for i in range(512)]
    assert len(encode_table(many)) < 32_000


def test_ranks_run_through_mpi4py_so_a_failing_rank_aborts_the_job():
    assert mpi.mpi_argv(["/py", "-m", "hora.runner.run_task", "/d"]) == ["/py", "-m", "mpi4py", "-m",
                                                                         "hora.runner.run_task", "/d"]
    assert mpi.mpi_argv(["/py", "train.py", "--epochs", "3"]) == ["/py", "-m", "mpi4py", "train.py", "--epochs", "3"]


def test_mpirun_command_on_one_host_and_across_hosts(tmp_path):
    env = {"HORA_CONTROLLER": "mpi", RANKS_VAR: "abc", "PATH": "/bin", "SECRET_OF_THE_TASK": "x"}
    one = mpi.build_mpirun(_job(mpi_args=("--mca", "btl", "self,tcp")), 2, env, [("10.0.0.1", 2)],
                           "/w/agents.json", "/venv/bin/mpirun")
    assert one[:3] == ["/venv/bin/mpirun", "-np", "2"] and "-H" not in one and "plm_ssh_agent" not in one
    assert one[one.index("--mca"):one.index("--mca") + 3] == ["--mca", "btl", "self,tcp"]
    assert one[-7:-3] == [sys.executable, "-m", "hora.runner.mpi_child", "--"]
    assert one[-3:] == [sys.executable, "-m", "hora.spark.mpi_rank"]
    assert "-x" in one and RANKS_VAR in one and "SECRET_OF_THE_TASK" not in one
    two = mpi.build_mpirun(_job(nics=("eth1",)), 3, env, [("10.0.0.1", 1), ("10.0.0.2", 2)], "/w/agents.json",
                           "/venv/bin/mpirun")
    assert two[two.index("-H") + 1] == "10.0.0.1:1,10.0.0.2:2"
    agent = two[two.index("plm_ssh_agent") + 1]
    assert agent == f"{sys.executable} -m hora.spark.rsh_agent /w/agents.json"
    assert two[two.index("plm_ssh_no_tree_spawn") + 1] == "1"
    assert "--leave-session-attached" in two  # the daemons stay the serving tasks' children
    assert two[two.index("--prefix") + 1] == "/venv"
    assert two[two.index("btl_tcp_if_include") + 1] == "eth1"
    assert "plm_ssh_args" not in two
    with pytest.raises(LaunchError, match="MPICH's mpirun; hora.spark starts MPI across hosts with Open MPI's"):
        mpi.build_mpirun(_job(), 3, env, [("a", 1), ("b", 2)], "/w/agents.json", "/usr/bin/mpirun", "mpich")


def test_agent_arguments_are_parsed_like_ssh():
    assert rsh.parse_agent_args(["/f", "h2", "PATH=x;", "prted", "--a", '"b"']) == ("/f", "h2", 'PATH=x; prted --a "b"')
    assert rsh.parse_agent_args(["/f", "-x", "h2", "cmd"]) == ("/f", "h2", "cmd")
    with pytest.raises(ValueError, match="usage"):
        rsh.parse_agent_args(["/f", "h2"])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_the_serving_task_runs_the_command_and_relays_output_and_exit_code(capfdbinary):
    server = rsh.AgentServer("127.0.0.1", "tok")
    try:
        code = rsh.run_remote("127.0.0.1", server.port, "tok", "echo out; echo err >&2; exit 3", "h2")
    finally:
        server.close()
    captured = capfdbinary.readouterr()
    assert code == 3 and server.exits == [3]
    assert captured.out == b"out\n" and captured.err == b"err\n"


@pytest.mark.timeout(60)
def test_a_wrong_token_starts_nothing(tmp_path, capfdbinary):
    marker = tmp_path / "ran"
    server = rsh.AgentServer("127.0.0.1", "right")
    try:
        code = rsh.run_remote("127.0.0.1", server.port, "wrong", f"touch {marker}", "h2")
    finally:
        server.close()
    assert code == rsh.UNREACHABLE and not marker.exists() and server.exits == []
    assert b"ended the connection before the command did" in capfdbinary.readouterr().err


@pytest.mark.timeout(60)
def test_an_unreachable_task_is_named_at_once(capfdbinary):
    started = time.monotonic()
    assert rsh.run_remote("127.0.0.1", _closed_port(), "tok", "true", "h9") == rsh.UNREACHABLE
    assert time.monotonic() - started < 5
    assert b"cannot reach the Spark task serving host h9" in capfdbinary.readouterr().err


@pytest.mark.timeout(60)
def test_the_command_dies_when_its_agent_goes_away(tmp_path):
    pid_file = tmp_path / "pid"
    server = rsh.AgentServer("127.0.0.1", "tok")
    try:
        agents = tmp_path / "agents.json"
        rsh.write_agents_file(str(agents), "tok", {"h2": ("127.0.0.1", server.port)})
        assert oct(os.stat(agents).st_mode & 0o777) == "0o600"
        agent = subprocess.Popen([sys.executable, "-m", "hora.spark.rsh_agent", str(agents), "h2",
                                  f"echo $$ > {pid_file}; exec sleep 60"])
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the command outlived its agent"
    finally:
        server.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_the_agent_refuses_a_host_outside_the_job(tmp_path, capfdbinary):
    agents = tmp_path / "agents.json"
    rsh.write_agents_file(str(agents), "tok", {"h2": ("127.0.0.1", 1)})
    assert rsh.main([str(agents), "h7", "true"]) == rsh.UNREACHABLE
    assert b"host 'h7' has no Spark task of this job (hosts: h2)" in capfdbinary.readouterr().err


def test_the_rank_wrapper_refuses_a_rank_on_another_host(tmp_path):
    table = encode_table([{"dir": str(tmp_path), "argv": [sys.executable, "-c", "print('zero')"], "env": {}},
                          {"dir": str(tmp_path / "elsewhere"), "argv": [sys.executable, "-c", "pass"], "env": {}}])
    env = {**os.environ, RANKS_VAR: table, "OMPI_COMM_WORLD_RANK": "1"}
    out = subprocess.run([sys.executable, "-m", "hora.spark.mpi_rank"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "mpirun's rank mapping differs from hora's" in out.stderr
    env["OMPI_COMM_WORLD_RANK"] = "0"
    code = "import os; print(os.environ['HORA_RANK'], 'HORA_SPARK_MPI_RANKS' in os.environ)"
    table = encode_table([{"dir": str(tmp_path), "argv": [sys.executable, "-c", code], "env": {"HORA_RANK": "0"}}])
    env[RANKS_VAR] = table
    out = subprocess.run([sys.executable, "-m", "hora.spark.mpi_rank"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stdout) == (0, "0 False\n"), out.stderr


def test_a_rank_exit_comes_from_mpirun_or_else_from_the_result_file():
    import cloudpickle

    shared = {"exits": {"0": [0, False, []]}, "tails": {"1": ["Traceback", "ValueError: x"]}, "root": None,
              "failure": "mpirun exited with code 1"}
    assert mpi.rank_exit(shared, 0, b"") == (0, False, [])
    error = cloudpickle.dumps(("error", ValueError("x"), "Traceback\nValueError: x"))
    assert mpi.rank_exit(shared, 1, error) == (1, False, ["Traceback", "ValueError: x"])
    assert mpi.rank_exit(shared, 2, b"") == (mpi.NO_EXIT, True, [])  # stopped with the job
    assert mpi.rank_exit(shared, 2, cloudpickle.dumps(("ok", 5)))[:2] == (0, False)


def _raise_if_called(*a, **k):
    raise AssertionError("nothing may start")


def test_mpi_asked_where_it_cannot_run_is_refused_before_anything_starts(monkeypatch):
    import hora.spark
    from hora.runner.launchers import mpi as launcher

    monkeypatch.setattr(launcher, "mpirun_path", lambda environ=None: None)
    monkeypatch.setattr("hora.spark.driver._run_local", _raise_if_called)
    with pytest.raises(LaunchError, match=r"asked for MPI .* no mpirun or no mpi4py: pip install 'hora\[mpi\]'"):
        hora.spark.run(print, num_proc=2, use_mpi=True)
    with pytest.raises(LaunchError, match="asked for MPI"):
        hora.spark.run(print, num_proc=2, env={"HOROVOD_CONTROLLER": "mpi"})
    with pytest.raises(ConfigError, match="use_mpi=True and use_gloo=True contradict"):
        hora.spark.run(print, num_proc=2, use_mpi=True, use_gloo=True)
    with pytest.raises(ConfigError, match="extra_mpi_args=.* is for the MPI engine"):
        hora.spark.run(print, num_proc=2, extra_mpi_args="--mca btl self")


def _mpirun_over_two_hosts(tmp_path, second: str, agent_port: int, argv: list[str]):
    """mpirun as rank 0's task runs it, for a job with a task here and one on ``second``, whose serving task
    listens on ``agent_port``; returns the job's result and what rank 0's task would share."""
    from hora.runner.launchers.mpi import find_mpirun
    from hora.spark.channel import DriverChannel, TaskChannel

    driver = DriverChannel("127.0.0.1", "tok")
    channel = TaskChannel("127.0.0.1", driver.port, "tok", 0)
    try:
        agents = str(tmp_path / "agents.json")
        rsh.write_agents_file(agents, "tok", {second: ("127.0.0.1", agent_port)})
        infos = [TaskInfo(partition=0, host="here", addr="127.0.0.1", port=1),
                 TaskInfo(partition=1, host="there", addr=second, port=2)]
        slots = plan_ranks(infos)
        extras = [{"agent": 0, "dir": str(tmp_path), "argv": argv}] * 2
        table = encode_table(mpi.rank_table(_job(), infos, slots, extras))
        env = mpi.mpirun_env(_job(), infos, slots, table, os.environ)
        command = mpi.build_mpirun(_job(), 2, env, mpi.mpirun_hosts(infos, slots), agents, find_mpirun(env))
        sink = mpi._ChannelSink(channel)
        result = mpi.run_mpirun(command, env, slots, sink)
        return result, mpi.summary(result, sink)
    finally:
        channel.close()
        driver.close()


@needs_mpi
@pytest.mark.timeout(120)
def test_mpirun_that_cannot_reach_a_host_fails_in_seconds_with_the_reason(tmp_path):
    started = time.monotonic()
    result, shared = _mpirun_over_two_hosts(tmp_path, "hora-unreachable-host", _closed_port(),
                                            [sys.executable, "-c", "pass"])
    assert time.monotonic() - started < 60
    assert result.exit_code != 0 and result.root_cause is None
    assert "cannot reach the Spark task serving host hora-unreachable-host" in shared["failure"], shared
    json.dumps(shared)  # it travels through allGather


@needs_mpi
@pytest.mark.timeout(120)
def test_mpirun_starts_its_daemon_through_a_serving_task(tmp_path):
    # Both "hosts" are this machine, so Open MPI places both ranks on mpirun's own; the daemon it starts
    # through the agent must still have run, as the serving task's child, and ended cleanly.
    server = rsh.AgentServer("127.0.0.1", "tok")
    try:
        result, shared = _mpirun_over_two_hosts(tmp_path, "hora-second-host", server.port,
                                                [sys.executable, "-c", "print('ran')"])
    finally:
        server.close()
    assert result.exit_code == 0 and shared["failure"] is None, result
    assert server.exits == [0]
    assert sorted(result.exits) == [0, 1]


def _engine():
    import torch

    import hora.torch as hvd

    hvd.init()
    return hvd.rank(), hvd.mpi_enabled(), hvd.allreduce(torch.ones(1), op=hvd.Sum).item()


@needs_mpi
@pytest.mark.timeout(180)
def test_without_a_spark_session_mpi_runs_through_hora_run():
    import hora.spark

    assert hora.spark.run(_engine, num_proc=2, use_mpi=True, extra_mpi_args="--mca btl self,vader,tcp") == [
        (0, True, 2.0), (1, True, 2.0)]
