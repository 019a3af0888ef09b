"""The sge launcher's logic without a grid engine: $PE_HOSTFILE, placement, quoting, detection, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hora import envvars
from hora.errors import ConfigError, LaunchError
from hora.placement import HostSlots
from hora.runner.keys import SCHEDULER, SERVER
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers import sge
from hora.runner.launchers.registry import detect_launcher
from hora.runner.plan import plan_slots

REPO = Path(__file__).resolve().parents[2]
PE_HOSTFILE = """\
node-b.example 2 all.q@node-b.example UNDEFINED
node-a.example 1 all.q@node-a.example UNDEFINED
node-b.example 1 long.q@node-b.example UNDEFINED

"""


def config(np: int, servers: int = 0, **fields) -> LaunchConfig:
    return LaunchConfig(command=["python", "train.py"], num_proc=np, num_servers=servers, launcher="sge", **fields)


def test_pe_hostfile_keeps_the_grid_engines_order_and_sums_a_hosts_queues():
    hosts = sge.parse_pe_hostfile(PE_HOSTFILE)
    assert hosts == [HostSlots("node-b.example", 3), HostSlots("node-a.example", 1)]


@pytest.mark.parametrize("text", ["node-a\n", "node-a two all.q UNDEFINED\n", "\n", "node-a 0 all.q UNDEFINED\n"])
def test_a_malformed_or_empty_pe_hostfile_is_named(text):
    with pytest.raises(LaunchError, match=r"\$PE_HOSTFILE"):
        sge.parse_pe_hostfile(text)


@pytest.fixture
def in_job(monkeypatch, tmp_path):
    """This process inside a parallel job whose $PE_HOSTFILE is :data:`PE_HOSTFILE`."""
    path = tmp_path / "pe_hostfile"
    path.write_text(PE_HOSTFILE)
    monkeypatch.setenv(envvars.PE_HOSTFILE, str(path))
    monkeypatch.setenv(envvars.JOB_ID, "42")
    monkeypatch.setenv(envvars.PE, "hora-pe")


def test_workers_fill_the_granted_slots_and_servers_take_slots_of_their_own(in_job):
    slots = plan_slots(config(3, servers=1))
    workers = [(s.rank, s.host, s.local_rank, s.local_size, s.cross_rank) for s in slots if s.role == "worker"]
    assert workers == [(0, "node-b.example", 0, 3, 0), (1, "node-b.example", 1, 3, 0), (2, "node-b.example", 2, 3, 0)]
    assert [(s.role, s.host) for s in slots if s.role != "worker"] == [
        (SCHEDULER, "node-b.example"), (SERVER, "node-a.example")]


def test_fewer_granted_slots_than_workers_and_servers_names_the_qsub_request(in_job):
    with pytest.raises(LaunchError, match=r"granted this job 4 slots, but -np 4 and 1 servers need 5: "
                                          r"submit with 'qsub -pe hora-pe 5'"):
        plan_slots(config(4, servers=1))


def test_the_agents_command_survives_the_remote_shell_unchanged():
    argv = sge.qrsh_command("/usr/bin/qrsh", "node-a", "/opt/my env/bin:/usr/bin")
    assert argv[:3] == ["/usr/bin/qrsh", "-inherit", "node-a"] and len(argv) == 4
    # qrsh hands the command to sh on the host: what sh would run is the detached agent's source, intact
    probe = argv[3].replace('exec "$p" -c', 'exec printf %s')
    result = subprocess.run(["sh", "-c", probe], capture_output=True, text=True, timeout=30)
    assert result.stdout == sge._DETACHED_AGENT
    assert "'/opt/my env/bin:/usr/bin'" in argv[3]
    compile(sge._DETACHED_AGENT, "<agent>", "exec")  # the prelude sits after the __future__ import


def test_the_submitted_job_gets_its_configuration_intact(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    original = config(2, servers=1, env={"LIST": "a,b,c", "QUOTED": "it's \"here\" $HOME"}, verbose=True,
                      sge_pe="mpi-pe", sge_queue="gpu.q")
    command = sge.submit_command(original, "/usr/bin/qsub", sge.encode_config(original), "o", "e")
    assert command[:3] == ["/usr/bin/qsub", "-sync", "y"]
    assert command[command.index("-pe") + 1:command.index("-pe") + 3] == ["mpi-pe", "3"]  # workers + servers
    assert command[command.index("-q") + 1] == "gpu.q"
    assert "-v" not in command  # values never go through qsub -v, which splits them on commas
    back = sge.decode_config(command[-1])
    assert back.env == original.env and back.num_servers == 1 and back.command == original.command
    assert back.launcher == "sge" and back.verbose


def test_sge_is_chosen_inside_a_parallel_job_only(tmp_path):
    qrsh = tmp_path / "qrsh"
    qrsh.write_text("#!/bin/sh\n")
    qrsh.chmod(0o755)
    job = {envvars.PE_HOSTFILE: "/x/pe_hostfile", envvars.JOB_ID: "7", "PATH": str(tmp_path)}
    assert detect_launcher(None, None, job, mpi=True) == "sge"
    assert detect_launcher(None, None, {**job, envvars.JOB_ID: ""}, mpi=False) == "local"
    assert detect_launcher((HostSlots("elsewhere", 2),), None, job) == "ssh"  # an explicit host list wins
    assert sge.inside_job(job) and not sge.inside_job({"PATH": str(tmp_path)})


def test_configurations_sge_cannot_serve_are_refused():
    with pytest.raises(ConfigError, match=r"\$PE_HOSTFILE; drop -H"):
        config(2, hosts="h1:2")
    with pytest.raises(ConfigError, match="hosts are fixed"):
        config(2, min_np=1)
    with pytest.raises(ConfigError, match="granted slots .* drop --server-hosts"):
        config(2, servers=1, server_hosts="h3")
    with pytest.raises(ConfigError, match="--mpi needs"):
        config(2, controller="mpi")
    with pytest.raises(ConfigError, match="--launcher sge only"):
        LaunchConfig(command=["python"], num_proc=1, launcher="local", sge_pe="hora")


def test_missing_grid_engine_tools_say_how_to_get_them(tmp_path):
    with pytest.raises(LaunchError, match=r"qsub on PATH.*settings\.sh.*gridengine-client"):
        sge.find_tool("qsub", {"PATH": str(tmp_path)})
    with pytest.raises(LaunchError, match=r"no parallel job here .*qsub -pe PE N"):
        sge.job_hosts({"PATH": str(tmp_path)})


def test_hora_run_outside_a_job_without_qsub_fails_with_the_fix(tmp_path):
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "hora.runner.cli", "run", "--launcher", "sge", "-n", "2",
                             "python", "train.py"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0
    assert "needs the grid engine's qsub on PATH" in result.stderr, result.stderr
