"""Unit tests of the launcher's parsing and validation: no processes are started."""

from __future__ import annotations

import io
import os
import socket
import sys

import pytest

from hora.errors import ConfigError, LaunchError
from hora.placement import HostSlots, place_ranks
from hora.runner.cli import build_parser, config_from_args
from hora.runner.env import available_cpus, build_env
from hora.runner.hostlist import is_local_host, parse_hostfile, parse_hosts
from hora.runner.launch import check_command, plan_slots
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers import get_launcher
from hora.runner.launchers.base import exit_status
from hora.runner.launchers.mpi import mpi_launch_available, mpirun_command
from hora.runner.mpi_child import marker_line, parse_marker
from hora.runner.output import OutputSink


def parse(*argv: str) -> LaunchConfig:
    return config_from_args(build_parser().parse_args(["run", *argv]))


# --- hora run flags -------------------------------------------------------


def test_command_keeps_its_own_flags():
    config = parse("-np", "2", "python", "train.py", "-np", "3", "--verbose")
    assert config.num_proc == 2
    assert config.command == ("python", "train.py", "-np", "3", "--verbose")
    assert config.verbose is False
    expected = ("mpi", "mpi") if mpi_launch_available() else ("gloo", "local")  # horovodrun's default
    assert (config.controller, config.launcher) == expected
    gloo = parse("-np", "2", "--gloo", "python")
    assert (gloo.controller, gloo.launcher) == ("gloo", "local")


def test_double_dash_separator_is_dropped():
    assert parse("-np", "2", "--", "python", "-c", "pass").command == ("python", "-c", "pass")


def test_mxnet_spellings():
    assert parse("-n", "3", "python", "x.py").num_proc == 3
    config = parse("-n", "2", "--launcher", "mpi", "python", "x.py")
    assert (config.controller, config.launcher) == ("mpi", "mpi")
    with pytest.raises(ConfigError, match=r"-np 2 and -n 3 disagree"):
        parse("-np", "2", "-n", "3", "python")


def test_server_counts(monkeypatch):
    monkeypatch.delenv("DMLC_NUM_SERVER", raising=False)
    assert parse("-n", "2", "python", "x.py").num_servers == 0
    assert parse("-n", "2", "-s", "0", "python", "x.py").num_servers == 0
    assert parse("-n", "2", "-s", "3", "python", "x.py").num_servers == 3
    assert parse("-n", "4", "-s", "--", "python", "x.py").num_servers == 4  # -s alone: as many as workers
    monkeypatch.setenv("DMLC_NUM_SERVER", "2")
    assert parse("-n", "3", "python", "x.py").num_servers == 2
    assert parse("-n", "3", "-s", "1", "python", "x.py").num_servers == 1
    with pytest.raises(ConfigError, match=r"-s -2 must be >= 0"):
        LaunchConfig(command=["python"], num_proc=2, num_servers=-2)
    with pytest.raises(ConfigError, match=r"parameter servers are started by the local.* and ssh launchers"):
        parse("-n", "2", "-s", "1", "--mpi", "python", "x.py")


def test_mpi_flag_selects_mpi_launcher_and_conflicts_are_reported():
    config = parse("--mpi", "-np", "2", "python")
    assert (config.controller, config.launcher) == ("mpi", "mpi")
    with pytest.raises(ConfigError, match="--mpi needs the mpi launcher"):
        parse("--mpi", "--launcher", "local", "-np", "2", "python")
    with pytest.raises(ConfigError, match="drop --gloo"):
        parse("--gloo", "--launcher", "mpi", "-np", "2", "python")


def test_gloo_and_mpi_are_mutually_exclusive(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["run", "--gloo", "--mpi", "-np", "2", "python"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_hosts_give_the_default_process_count():
    config = parse("-H", "localhost:2,127.0.0.1:3", "python")
    assert config.num_proc == 5
    assert config.hosts == (HostSlots("localhost", 2), HostSlots("127.0.0.1", 3))


def test_missing_process_count_and_command():
    with pytest.raises(ConfigError, match="give -np N"):
        parse("python", "x.py")
    with pytest.raises(ConfigError, match="no command given"):
        parse("-np", "2")
    with pytest.raises(ConfigError, match="no command given"):
        parse("-np", "2", "--")


def test_hostfile_via_dash_h_and_hostfile_flag(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# comment\nlocalhost slots=2\n\n127.0.0.1:1\n")
    assert parse("-H", str(path), "python").hosts == (HostSlots("localhost", 2), HostSlots("127.0.0.1", 1))
    assert parse("--hostfile", str(path), "-np", "3", "python").num_proc == 3
    path.write_text("localhost slots two\n")
    with pytest.raises(ConfigError, match=r"hosts:1: cannot parse"):
        parse("--hostfile", str(path), "python")


def test_knob_flags_are_parsed(tmp_path):
    config = parse(
        "-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5", "--timeline-filename", "tl.json",
        "--output-filename", "logs", "--start-timeout", "20", "--network-interface", "lo",
        "--mpi-args", "--mca btl self,vader", "--mpi", "python",
    )
    assert config.fusion_threshold_mb == 32 and config.cycle_time_ms == 2.5 and config.start_timeout == 20
    assert config.timeline_filename == os.path.abspath("tl.json")
    assert config.output_filename == os.path.abspath("logs")
    assert config.mpi_args == ("--mca", "btl", "self,vader")


# --- LaunchConfig validation --------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_proc=0), r"-np 0 must be at least 1"),
        (dict(num_proc=3, hosts="localhost:2"), r"-np 3 is more than the 2 slots in -H localhost:2"),
        (dict(num_proc=2, command=[]), r"no command to run"),
        (dict(num_proc=2, fusion_threshold_mb=-1), r"--fusion-threshold-mb -1 must be >= 0"),
        (dict(num_proc=2, cycle_time_ms=0), r"--cycle-time-ms 0 must be > 0"),
        (dict(num_proc=2, start_timeout=0), r"--start-timeout 0 must be > 0"),
        (dict(num_proc=2, controller="nccl"), r"controller 'nccl' is not one of gloo, mpi"),
        (dict(num_proc=2, launcher="k8s"), r"--launcher 'k8s' is not one of"),
        (dict(num_proc=2, controller="gloo", mpi_args=["-v"]), r"mpi_args only apply to the mpi launcher"),
        (dict(num_proc=True), r"must be an integer"),
    ],
)
def test_launch_config_rejects(kwargs, message):
    kwargs.setdefault("command", ["python"])
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(**kwargs)


def test_parse_hosts():
    assert parse_hosts("a:2,b") == (HostSlots("a", 2), HostSlots("b", 1))
    assert parse_hosts("[::1]:2") == (HostSlots("::1", 2),)
    with pytest.raises(ConfigError, match="must be >= 1"):
        parse_hosts("a:0")
    with pytest.raises(ConfigError, match="is not an integer"):
        parse_hosts("a:x")
    with pytest.raises(ConfigError, match="empty host entry"):
        parse_hosts("a:1,,b:1")
    with pytest.raises(ConfigError, match="cannot read hostfile"):
        parse_hostfile("/nonexistent/hosts")


def test_local_host_detection():
    for name in ("localhost", "127.0.0.1", "::1", socket.gethostname()):
        assert is_local_host(name), name
    assert not is_local_host("node-that-does-not-exist.example")


def test_remote_hosts_choose_the_ssh_launcher():
    config = LaunchConfig(command=["python"], num_proc=2, hosts="localhost:1,node1:1")
    assert (config.launcher, config.controller) == ("ssh", "gloo")
    with pytest.raises(ConfigError, match="--launcher local only starts processes on this machine.*'node1'"):
        LaunchConfig(command=["python"], num_proc=2, hosts="localhost:1,node1:1", launcher="local")
    for name in ("local", "ssh", "mpi", "slurm"):
        assert get_launcher(name).name == name
    with pytest.raises(LaunchError, match="unknown launcher"):
        get_launcher("k8s")


def test_local_names_share_one_host():
    slots = plan_slots(LaunchConfig(command=["python"], num_proc=3, hosts="localhost:2,127.0.0.1:2"))
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 0, 3, 0, 1), (1, 1, 3, 0, 1), (2, 2, 3, 0, 1),
    ]


def test_assign_ranks_over_hosts():
    slots = place_ranks([HostSlots("a", 2), HostSlots("b", 2), HostSlots("c", 4)], 3)
    assert [(s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        ("a", 0, 2, 0, 2), ("a", 1, 2, 0, 2), ("b", 0, 1, 1, 2),
    ]
    assert slots[2].env()["HORA_RANK"] == "2" and slots[2].env()["HORA_SIZE"] == "3"


def test_exit_status():
    assert [exit_status(c) for c in (0, 3, -9, -15, 300)] == [0, 3, 137, 143, 1]


# --- the workers' environment -------------------------------------------------


def test_build_env_contract():
    config = LaunchConfig(
        command=["python"], num_proc=2, controller="gloo", fusion_threshold_mb=32, cycle_time_ms=5,
        start_timeout=20, timeline_filename="tl.json", env={"EXTRA": "1"},
    )
    base = {"PATH": "/bin", "HORA_RANK": "7", "HORA_FUSION_THRESHOLD_MB": "8"}
    env, notice = build_env(config, local_size=2, base=base)
    assert env["HORA_CONTROLLER"] == "gloo"
    assert env["HORA_RENDEZVOUS_ADDR"] == "127.0.0.1"
    assert 0 < int(env["HORA_RENDEZVOUS_PORT"]) < 65536
    assert len(env["HORA_SECRET"]) == 32 and int(env["HORA_SECRET"], 16) >= 0
    assert env["HORA_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert "HORA_FUSION_THRESHOLD_MB" not in env  # the flag wins over the inherited MB value
    assert env["HORA_CYCLE_TIME"] == "5" and env["HORA_START_TIMEOUT"] == "20"
    assert env["HORA_TIMELINE"] == os.path.abspath("tl.json")
    assert env["PYTHONUNBUFFERED"] == "1" and env["EXTRA"] == "1" and env["PATH"] == "/bin"
    assert "HORA_RANK" not in env  # rank variables are per worker, never inherited
    assert env["OMP_NUM_THREADS"] == str(max(1, available_cpus() // 2))
    assert notice is not None and f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}" in notice
    other, _ = build_env(config, local_size=2, base=base)
    assert other["HORA_SECRET"] != env["HORA_SECRET"]


def test_build_env_respects_user_threads_and_interface():
    config = LaunchConfig(command=["python"], num_proc=2, network_interface="lo")
    env, notice = build_env(config, local_size=2, base={"OMP_NUM_THREADS": "7"})
    assert notice is None and env["OMP_NUM_THREADS"] == "7"
    assert env["HORA_NETWORK_INTERFACE"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["HORA_RENDEZVOUS_ADDR"] == "127.0.0.1"
    with pytest.raises(LaunchError, match=r"--network-interface 'nope0' does not exist here; interfaces: .*lo"):
        build_env(LaunchConfig(command=["python"], num_proc=1, network_interface="nope0"), local_size=1)
    with pytest.raises(LaunchError, match=r"--network-interface 'nope1' does not exist here"):
        build_env(LaunchConfig(command=["python"], num_proc=1, network_interface="lo,nope1"), local_size=1)
    env, _ = build_env(LaunchConfig(command=["python"], num_proc=2, network_interface="lo,lo"), local_size=2)
    assert env["GLOO_SOCKET_IFNAME"] == "lo,lo" and env["HORA_RENDEZVOUS_ADDR"] == "127.0.0.1"


def test_check_command(tmp_path):
    check_command([sys.executable], os.environ)
    check_command(["python3"], {"PATH": os.path.dirname(sys.executable)})
    with pytest.raises(LaunchError, match=r"cannot run 'nonexistent_cmd_xyz': command not found on PATH"):
        check_command(["nonexistent_cmd_xyz"], os.environ)
    with pytest.raises(LaunchError, match="no such file"):
        check_command([str(tmp_path / "missing")], os.environ)
    with pytest.raises(LaunchError, match="not an executable file"):
        check_command([str(tmp_path)], os.environ)


def test_mpirun_command_line():
    config = LaunchConfig(command=["python", "x.py"], num_proc=2, controller="mpi", network_interface="lo",
                          mpi_args=["--mca", "btl", "self,vader"])
    env = {"HORA_SECRET": "s3cret", "HORA_CONTROLLER": "mpi", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    many = available_cpus() + 1
    command = mpirun_command(config, many, env, "/x/mpirun")
    assert command[:3] == ["/x/mpirun", "-np", str(many)]
    assert "--oversubscribe" in command
    assert command[command.index("--bind-to") + 1] == "none" and "-bind-to" not in command
    exported = {command[i + 1] for i, arg in enumerate(command) if arg == "-x"}
    assert exported == {"HORA_SECRET", "HORA_CONTROLLER", "OMP_NUM_THREADS", "PYTHONUNBUFFERED"}
    assert "s3cret" not in " ".join(command)  # values travel in the environment, not on the command line
    assert command[-5:] == ["-m", "hora.runner.mpi_child", "--", "python", "x.py"]
    assert "btl_tcp_if_include" in command and "self,vader" in command
    assert "--oversubscribe" not in mpirun_command(config, 1, env, "/x/mpirun")


# --- output -------------------------------------------------------------------


def test_output_sink_prefixes_keeps_tails_and_logs(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    sink = OutputSink(out, err, str(tmp_path))
    sink.emit(0, "stdout", b"hello\n")
    sink.emit(1, "stdout", b"no newline")
    for i in range(25):
        sink.emit(1, "stderr", f"line {i}\n".encode())
    sink.emit_raw("stderr", b"from mpirun")
    sink.close()
    assert out.getvalue() == "[0]<stdout>:hello\n[1]<stdout>:no newline\n"
    assert err.getvalue().splitlines()[0] == "[1]<stderr>:line 0"
    assert err.getvalue().endswith("[1]<stderr>:line 24\nfrom mpirun\n")
    assert sink.tail(1) == [f"line {i}" for i in range(5, 25)]
    assert sink.tail(0) == []
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b"hello\n"
    assert (tmp_path / "rank.1" / "stderr").read_text().count("\n") == 25


def test_output_sink_passes_bytes_through():
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    sink = OutputSink(stream, stream)
    sink.emit(2, "stdout", "héllo\n".encode())
    assert raw.getvalue() == "[2]<stdout>:héllo\n".encode()


def test_exit_marker_round_trip():
    line = marker_line(3, -9, True)
    record = parse_marker(line)
    assert record is not None and (record["rank"], record["returncode"], record["stopped"]) == (3, -9, True)
    assert parse_marker(b"[3]<stderr>:__hora_rank_exit__ {}\n") is None
    assert parse_marker(b"\0" + line) == record  # after the NUL byte that ends mpirun's abort banner
    assert parse_marker(b"__hora_rank_exit__ not json\n") is None
