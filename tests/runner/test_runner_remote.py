"""Unit tests of the multi-host launch logic: host specs, launcher choice, placement, ssh/mpirun/srun lines.

No process is started here except ``ssh -G`` (which only reads ssh's configuration).
"""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import sys

import pytest

from hora.errors import ConfigError, LaunchError
from hora.placement import HostSlots
from hora.runner.cli import build_parser, config_from_args, parse_env_flags
from hora.runner.env import Endpoints, build_env, forwarded_names
from hora.runner.hostlist import parse_hostfile, parse_hosts
from hora.runner.keys import SCHEDULER, SERVER, WORKER
from hora.runner.launch import report
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import JobResult, RankExit, Slot
from hora.runner.launchers.mpi import mpi_launch_available, mpirun_command, mpirun_path
from hora.runner.launchers.registry import detect_launcher
from hora.runner.launchers.slurm import allocation_hosts, expand_counts, srun_command
from hora.runner.output import OutputSink, log_directory, split_prefixed
from hora.runner.plan import PS_NODE_MODULE, plan_slots, slot_command
from hora.runner.ssh import SshOptions, agent_command


def parse(*argv: str) -> LaunchConfig:
    return config_from_args(build_parser().parse_args(["run", *argv]))


def config(**kwargs) -> LaunchConfig:
    kwargs.setdefault("command", ["python", "train.py"])
    return LaunchConfig(**kwargs)


# --- host specs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("a b:2", r"host 'a b' in 'a b:2' is malformed"),
        ("node/1:2", r"host 'node/1' .* is malformed"),
        ("-oProxyCommand=x:1", r"host '-oProxyCommand=x' .* is malformed"),  # never reaches ssh as an option
        ("a:2,b:1,a:1", r"host 'a' is listed twice \(a:2 and a:1\); list each host once"),
        ("A:1,a:1", r"host 'a' is listed twice"),
        ("a:0", r"slot count 0 .* must be >= 1"),
        ("a:two", r"slot count 'two' .* is not an integer"),
    ],
)
def test_malformed_and_duplicate_hosts_are_config_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        config(num_proc=1, hosts=spec)


def test_more_processes_than_slots_names_the_numbers():
    with pytest.raises(ConfigError, match=r"-np 5 is more than the 4 slots in -H a:2,b:2; lower -np or add slots"):
        config(num_proc=5, hosts="a:2,b:2")


def test_hostfile_formats(tmp_path):
    horovod = tmp_path / "horovod"
    horovod.write_text("server1 slots=4\nserver2 slots=2  # comment\n")
    assert parse_hostfile(str(horovod)) == (HostSlots("server1", 4), HostSlots("server2", 2))
    mxnet = tmp_path / "mxnet"
    mxnet.write_text("10.0.0.1\n10.0.0.2\n\n10.0.0.3\n")
    hosts = parse_hostfile(str(mxnet))
    assert [h.host for h in hosts] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"] and not any(h.fixed for h in hosts)
    dup = tmp_path / "dup"
    dup.write_text("a slots=1\na slots=2\n")
    with pytest.raises(ConfigError, match="host 'a' is listed twice"):
        parse("--hostfile", str(dup), "python")
    bad = tmp_path / "bad"
    bad.write_text("a slots=1\nb&c slots=2\n")
    with pytest.raises(ConfigError, match=r"host 'b&c' in '.*bad:2' is malformed"):
        parse_hostfile(str(bad))


def test_mxnet_hostfile_spreads_the_workers_evenly(tmp_path):
    mxnet = tmp_path / "hosts"
    mxnet.write_text("a\nb\nc\n")
    cfg = parse("-n", "7", "-H", str(mxnet), "python")
    assert cfg.hosts == (HostSlots("a", 3), HostSlots("b", 2), HostSlots("c", 2))
    assert cfg.launcher == "ssh"
    few = parse("-n", "2", "-s", "3", "-H", str(mxnet), "python")
    slots = plan_slots(few)
    assert [(s.role, s.host) for s in slots if s.role != WORKER] == [
        (SCHEDULER, "a"), (SERVER, "a"), (SERVER, "b"), (SERVER, "c"),  # servers use every listed host
    ]
    assert [s.host for s in slots if s.role == WORKER] == ["a", "b"]
    assert parse_hosts("a,b") == (HostSlots("a", 1), HostSlots("b", 1))  # horovodrun's -H a,b: one slot each


# --- choosing the launcher -----------------------------------------------------------------


def test_launcher_is_chosen_when_unambiguous(tmp_path):
    local = (HostSlots("localhost", 2),)
    remote = (HostSlots("localhost", 1), HostSlots("node7", 1))
    # One machine: mpirun when MPI is installed (as horovodrun does), else the local launcher.
    assert detect_launcher(None, None, {}, mpi=True) == "mpi"
    assert detect_launcher(local, None, {}, mpi=True) == "mpi"
    assert detect_launcher(None, None, {}, mpi=False) == "local"
    assert detect_launcher(local, None, {}, mpi=False) == "local"
    assert detect_launcher(local, "gloo", {}, mpi=True) == "local"  # --gloo
    assert detect_launcher(None, None, {}, servers=2, mpi=True) == "local"  # -s: hora starts the servers
    assert detect_launcher(remote, None, {}, mpi=True) == "ssh"
    assert detect_launcher(remote, "mpi", {}) == "mpi"
    fake_srun = tmp_path / "srun"
    fake_srun.write_text("#!/bin/sh\n")
    fake_srun.chmod(0o755)
    allocation = {"SLURM_JOB_ID": "7", "PATH": str(tmp_path)}
    assert detect_launcher(None, None, allocation) == "slurm"
    assert detect_launcher(None, None, {"SLURM_JOB_ID": "7", "PATH": "/nonexistent"}, mpi=False) == "local"  # no srun
    assert detect_launcher(remote, None, allocation) == "ssh"  # an explicit host list wins


def test_mpi_is_available_only_with_an_mpirun_to_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))  # no mpirun beside it
    assert mpirun_path({"PATH": str(tmp_path)}) is None
    assert not mpi_launch_available({"PATH": str(tmp_path)})
    assert detect_launcher(None, None, {"PATH": str(tmp_path)}) == "local"
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert mpirun_path({"PATH": str(tmp_path)}) == str(fake)
    assert mpi_launch_available({"PATH": str(tmp_path)}) == (importlib.util.find_spec("mpi4py") is not None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(controller="mpi", launcher="ssh"), r"--mpi needs the mpi launcher .* not --launcher ssh"),
        (dict(launcher="slurm", hosts="a:2"), r"--launcher slurm takes its hosts from the Slurm allocation"),
        (dict(num_servers=1, controller="mpi"), r"parameter servers are started by the local.* and ssh launchers"),
        (dict(sync_dst_dir="/tmp/x"), r"--sync-dst-dir copies files to other hosts over ssh; it needs the ssh"),
        (dict(hosts="a:2", sync_dst_dir="relative/dir"), r"--sync-dst-dir 'relative/dir' must be an absolute path"),
        (dict(hosts="a:2", ssh_port=70000), r"--ssh-port 70000 is not a TCP port"),
        (dict(hosts="a:2", ssh_identity_file="/nonexistent/key"), r"--ssh-identity-file '/nonexistent/key' does not"),
        (dict(hosts="a:2", ssh_connect_timeout=0), r"--ssh-connect-timeout 0 must be > 0"),
    ],
)
def test_contradictory_launch_settings_are_config_errors(kwargs, message):
    kwargs.setdefault("num_proc", 2)
    with pytest.raises(ConfigError, match=message):
        config(**kwargs)


def test_ssh_and_sync_flags(tmp_path, monkeypatch):
    key = tmp_path / "key"
    key.write_text("secret")
    monkeypatch.setenv("DMLC_INTERFACE", "eth3")
    cfg = parse("-np", "2", "-H", "n1,n2", "-p", "2222", "-i", str(key), "--ssh-config-file", str(key),
                "--sync-dir", "/srv/job", "--ssh-connect-timeout", "3", "--env", "A=1", "--env", "B:x=y", "python")
    assert (cfg.ssh_port, cfg.ssh_identity_file, cfg.ssh_config_file) == (2222, str(key), str(key))
    assert (cfg.sync_dst_dir, cfg.ssh_connect_timeout, cfg.launcher) == ("/srv/job", 3.0, "ssh")
    assert cfg.network_interface == "eth3"  # DMLC_INTERFACE when --network-interface is not given
    assert cfg.env == {"A": "1", "B": "x=y"}
    assert parse("-np", "1", "--network-interface", "lo", "python").network_interface == "lo"
    with pytest.raises(ConfigError, match="--env 'oops': use NAME=VALUE"):
        parse_env_flags(["oops"])


# --- placement and environment ---------------------------------------------------------------


def test_servers_round_robin_and_scheduler_on_rank_zero_host():
    slots = plan_slots(config(num_proc=5, hosts="a:2,b:2,c:2", num_servers=4, launcher="ssh"))
    assert [(s.role, s.rank, s.host) for s in slots] == [
        (SCHEDULER, 0, "a"),
        (SERVER, 0, "a"), (SERVER, 1, "b"), (SERVER, 2, "c"), (SERVER, 3, "a"),
        (WORKER, 0, "a"), (WORKER, 1, "a"), (WORKER, 2, "b"), (WORKER, 3, "b"), (WORKER, 4, "c"),
    ]
    keys = [s.key for s in slots]
    assert keys[:5] == ["scheduler", "server 0", "server 1", "server 2", "server 3"] and keys[5:] == [0, 1, 2, 3, 4]
    server, worker = slots[1], slots[5]
    assert server.env() == {"DMLC_ROLE": "server", "HORA_PS_SERVER_INDEX": "0"}
    assert slots[0].env() == {"DMLC_ROLE": "scheduler"}
    assert worker.env()["HORA_RANK"] == "0" and "DMLC_ROLE" not in worker.env()
    cfg = config(num_proc=2, num_servers=1, command=["/opt/py/bin/python3.11", "x.py"])
    assert slot_command(cfg, server) == ["/opt/py/bin/python3.11", "-m", PS_NODE_MODULE]
    assert slot_command(config(num_proc=2, command=["./train.sh"]), server)[1:] == ["-m", PS_NODE_MODULE]
    assert slot_command(cfg, worker) == ["/opt/py/bin/python3.11", "x.py"]
    assert plan_slots(config(num_proc=2, num_servers=-1))[1:3] == [
        s for s in plan_slots(config(num_proc=2, num_servers=2)) if s.role == SERVER
    ]  # -s alone: as many servers as workers


def test_server_hosts_place_the_servers_on_hosts_of_their_own():
    slots = plan_slots(config(num_proc=4, hosts="a:2,b:2", num_servers=3, server_hosts="c,d"))
    assert [(s.role, s.rank, s.host) for s in slots] == [
        (SCHEDULER, 0, "a"),  # the scheduler stays with rank 0
        (SERVER, 0, "c"), (SERVER, 1, "d"), (SERVER, 2, "c"),  # round-robin over --server-hosts only
        (WORKER, 0, "a"), (WORKER, 1, "a"), (WORKER, 2, "b"), (WORKER, 3, "b"),
    ]
    assert {s.local_size for s in slots if s.role == WORKER} == {2}  # servers do not count as local workers
    cli = parse("-np", "2", "-H", "a:1,b:1", "-s", "2", "--server-hosts", "c, d", "python", "x.py")
    assert (cli.server_hosts, cli.launcher) == (("c", "d"), "ssh")
    # a host may run workers and servers; listing it twice gives it two servers
    both = plan_slots(config(num_proc=2, hosts="a:2", num_servers=3, server_hosts=("a", "a", "b")))
    assert [s.host for s in both if s.role == SERVER] == ["a", "a", "b"]
    # without --server-hosts the servers go round-robin over the workers' hosts, as before
    assert [s.host for s in plan_slots(config(num_proc=4, hosts="a:2,b:2", num_servers=3))
            if s.role == SERVER] == ["a", "b", "a"]


def test_server_hosts_choose_the_launcher_and_name_this_machine():
    # only the servers are elsewhere: that still needs ssh
    assert config(num_proc=2, num_servers=1, server_hosts="far").launcher == "ssh"
    local = config(num_proc=2, num_servers=2, server_hosts="localhost,127.0.0.1")
    assert local.launcher == "local"
    import socket

    assert [s.host for s in plan_slots(local) if s.role == SERVER] == [socket.gethostname()] * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"server_hosts": "c"}, r"--server-hosts c places parameter servers, but none are started: add -s N"),
        ({"num_servers": 1, "server_hosts": "c:2"}, r"without slot counts \('c:2'\).*list a host twice"),
        ({"num_servers": 1, "server_hosts": "c,,d"}, r"--server-hosts c,,d has an empty host entry"),
        ({"num_servers": 1, "server_hosts": "-oProxy=x"},
         r"host '-oProxy=x' in '--server-hosts -oProxy=x' is malformed"),
        ({"num_servers": 1, "server_hosts": "far", "launcher": "local"},
         r"--launcher local only starts processes on this machine, but the hosts include 'far'"),
        ({"num_servers": 1, "server_hosts": ()}, r"--server-hosts lists no hosts: give host1,host2"),
    ],
)
def test_bad_server_hosts_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        config(num_proc=2, **kwargs)


def test_build_env_parameter_server_variables():
    cfg = config(num_proc=3, num_servers=2, network_interface="lo")
    base = {"PATH": "/bin", "DMLC_ROLE": "server", "DMLC_NODE_HOST": "stale", "HOROVOD_RANK": "5"}
    env, _ = build_env(cfg, local_size=3, base=base, endpoints=Endpoints(addr="10.1.2.3", port=1234, ps_port=5678))
    assert env["HORA_RENDEZVOUS_ADDR"] == "10.1.2.3" and env["HORA_RENDEZVOUS_PORT"] == "1234"
    assert (env["DMLC_ROLE"], env["DMLC_PS_ROOT_URI"], env["DMLC_PS_ROOT_PORT"]) == ("worker", "10.1.2.3", "5678")
    assert (env["DMLC_NUM_SERVER"], env["DMLC_NUM_WORKER"], env["DMLC_INTERFACE"]) == ("2", "3", "lo")
    assert "DMLC_NODE_HOST" not in env and "HOROVOD_RANK" not in env  # never inherited from an outer job
    plain, _ = build_env(config(num_proc=2), local_size=2, base={"DMLC_ROLE": "server", "DMLC_NUM_SERVER": "4"})
    assert not [k for k in plain if k.startswith("DMLC_")]
    local, _ = build_env(config(num_proc=2, num_servers=1), local_size=2, base={})
    assert local["DMLC_PS_ROOT_URI"] == "127.0.0.1" and local["DMLC_PS_ROOT_PORT"] != local["HORA_RENDEZVOUS_PORT"]


def test_forwarded_names_are_the_job_variables():
    env = {"HORA_SECRET": "s", "DMLC_ROLE": "worker", "PATH": "/bin", "HOME": "/root", "DISPLAY": ":0",
           "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "2", "MINE": "1", "SSH_AUTH_SOCK": "/x"}
    names = forwarded_names(env, config(num_proc=1, env={"MINE": "1"}))
    assert names == ["DMLC_ROLE", "HORA_SECRET", "MINE", "NCCL_DEBUG", "OMP_NUM_THREADS", "PATH"]


# --- ssh, mpirun and srun command lines --------------------------------------------------------


def test_ssh_options(tmp_path):
    options = SshOptions(port=2222, identity_file="/k/id", connect_timeout=2.5).options("node1")
    assert options[:4] == ["-p", "2222", "-i", "/k/id"]
    for option in ("BatchMode=yes", "ConnectTimeout=3", "ServerAliveInterval=5"):
        assert option in options
    if shutil.which("ssh"):  # the host-key policy is read from ssh's own configuration
        assert "StrictHostKeyChecking=accept-new" in options
        strict = tmp_path / "ssh_config"
        strict.write_text("Host *\n    StrictHostKeyChecking yes\n")
        chosen = SshOptions(config_file=str(strict)).options("node1")
        assert chosen[:2] == ["-F", str(strict)] and "StrictHostKeyChecking=accept-new" not in chosen
    assert SshOptions(port=2222).scp_options("n")[:2] == ["-P", "2222"]
    command = SshOptions().command("node1", "echo hi")
    assert command[:2] == ["ssh", "-T"] and command[-2:] == ["node1", "echo hi"]


def test_agent_command_is_one_shell_string_with_the_source_quoted():
    command = agent_command("/opt/venv/bin:/usr/bin")
    assert command.startswith("PATH=/opt/venv/bin:/usr/bin:\"$PATH\"; export PATH; for p in ")
    assert "__hora_agent__" in command and "exit 127" in command


def test_mpirun_command_across_hosts_openmpi_and_mpich():
    cfg = config(num_proc=4, hosts="n1:2,n2:2", controller="mpi", network_interface="eth1", ssh_port=2222)
    env = {"HORA_SECRET": "s3cret", "OMP_NUM_THREADS": "1", "PATH": "/bin"}
    openmpi = mpirun_command(cfg, 4, env, "/v/bin/mpirun", hosts=[("n1", 2), ("n2", 2)])
    text = " ".join(openmpi)
    assert openmpi[:5] == ["/v/bin/mpirun", "-np", "4", "-H", "n1:2,n2:2"]
    assert "--prtemca plm_ssh_args -p 2222 -o BatchMode=yes" in text and "--prefix /v" in text
    assert "--mca btl_tcp_if_include eth1" in text and "--prtemca oob_tcp_if_include eth1" in text
    assert {openmpi[i + 1] for i, a in enumerate(openmpi) if a == "-x"} == {"HORA_SECRET", "OMP_NUM_THREADS", "PATH"}
    assert "s3cret" not in text
    mpich = mpirun_command(cfg, 4, env, "/usr/bin/mpiexec", hosts=[("n1", 2), ("n2", 2)], flavour="mpich")
    text = " ".join(mpich)
    assert "-hosts n1:2,n2:2" in text and "-iface eth1" in text and "-launcher ssh" in text
    assert "-launcher-exec ssh -p 2222" in text and "-genvlist HORA_SECRET,OMP_NUM_THREADS,PATH" in text
    assert "-x" not in mpich and "--prtemca" not in mpich and "s3cret" not in text


def test_slurm_topology_and_srun_command(monkeypatch, tmp_path):
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(LaunchError, match="cannot read Slurm's task counts"):
        expand_counts("two")
    fake_srun = tmp_path / "srun"
    fake_srun.write_text("#!/bin/sh\n")
    fake_srun.chmod(0o755)
    env = {"SLURM_JOB_ID": "3", "PATH": str(tmp_path), "SLURM_JOB_NODELIST": "h1,h2,h3",
           "SLURM_TASKS_PER_NODE": "2(x3)"}
    assert allocation_hosts(6, env) == [HostSlots("h1", 2), HostSlots("h2", 2), HostSlots("h3", 2)]
    assert allocation_hosts(4, env) == [HostSlots("h1", 2), HostSlots("h2", 1), HostSlots("h3", 1)]
    with pytest.raises(LaunchError, match=r"runs inside a Slurm allocation \(SLURM_JOB_ID is not set\)"):
        allocation_hosts(2, {"PATH": str(tmp_path)})
    command = srun_command(config(num_proc=6, launcher="local"), "/usr/bin/srun")
    assert command[:5] == ["/usr/bin/srun", "--ntasks", "6", "--kill-on-bad-exit=1", "--export=ALL"]
    assert command[-5:] == ["-m", "hora.runner.mpi_child", "--", "python", "train.py"]


# --- output and the report ---------------------------------------------------------------------


def test_prefixed_lines_of_servers_and_their_logs(tmp_path):
    assert split_prefixed(b"[3]<stdout>:hi\n") == (3, "stdout", b"hi\n")
    assert split_prefixed(b"[server 1]<stderr>:x\n") == ("server 1", "stderr", b"x\n")
    assert split_prefixed(b"[scheduler]<stdout>:y") == ("scheduler", "stdout", b"y")
    assert split_prefixed(b"[client]<stdout>:z") is None
    assert [log_directory(k) for k in (2, "server 0", "scheduler")] == ["rank.2", "server.0", "scheduler"]
    out, err = io.StringIO(), io.StringIO()
    sink = OutputSink(out, err, str(tmp_path))
    sink.emit("server 0", "stderr", b"boom\n")
    sink.close()
    assert err.getvalue() == "[server 0]<stderr>:boom\n" and sink.tail("server 0") == ["boom"]
    assert (tmp_path / "server.0" / "stderr").read_text() == "boom\n"


def test_report_names_a_failed_server_and_what_was_stopped():
    cause = RankExit(rank=1, role=SERVER, host="h2", returncode=-9, stderr_tail=("oom",))
    exits = {"server 1": cause, 0: RankExit(rank=0, host="h1", returncode=-15, stopped=True),
             "scheduler": RankExit(rank=0, role=SCHEDULER, host="h1", returncode=-15, stopped=True)}
    err = io.StringIO()
    report(JobResult(exit_code=137, root_cause=cause, exits=exits), err)
    assert err.getvalue().splitlines() == [
        "hora run: job failed",
        "  root cause: server 1 on h2 was killed by signal SIGKILL (9)",
        "  last stderr lines of server 1:",
        "    oom",
        "  stopped by hora run: rank 0, scheduler",
    ]
    lost = RankExit(rank=2, host="h3", returncode=255, note="lost: the connection to h3 ended")
    assert lost.describe() == "rank 2 on h3 exited with code 255 (lost: the connection to h3 ended)"
    assert Slot(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1, host="a",
                role=SCHEDULER).name == "scheduler"


def test_slurm_launcher_endpoint_outside_allocation_is_clear():
    from hora.runner.launchers.slurm import SlurmLauncher

    with pytest.raises(LaunchError, match="SLURM_JOB_ID is not set"):
        SlurmLauncher(environ={"PATH": os.defpath}).prepare(config(num_proc=1, launcher="local"), [])


def test_emulated_cluster_says_why_it_cannot_run(monkeypatch):
    from hora.testing import emulate

    monkeypatch.setattr(emulate.os, "geteuid", lambda: 1000)
    assert emulate.unavailable_reason() == "the emulated cluster needs root (network namespaces, veth links, tc)"
    with pytest.raises(emulate.ClusterUnavailable, match="needs root"):
        emulate.EmulatedCluster(2).start()
    with pytest.raises(ConfigError, match="link='fast' is not a tc value"):
        emulate.EmulatedCluster(2, link="fast")


def test_bare_dash_s_before_the_command_means_one_server_per_worker():
    from hora.runner.cli import bare_servers_flag

    assert bare_servers_flag(["run", "-np", "2", "-s", "python", "x.py", "-s"]) == [
        "run", "-np", "2", "--num-servers=-1", "python", "x.py", "-s"]  # the command's own -s is left alone
    assert bare_servers_flag(["run", "-s", "3", "python"]) == ["run", "-s", "3", "python"]
    assert bare_servers_flag(["run", "-H", "a,b", "-s", "--verbose", "python"])[3] == "--num-servers=-1"
    assert bare_servers_flag(["run", "-np", "2", "python", "-s"])[-1] == "-s"
