"""`hora run` across the hosts of an emulated cluster: ssh+gloo, mpirun, fail-fast, file sync, NIC choice.

The launcher runs on h1, as a user logged in there would run it, and reaches
h2 and h3 over ssh with the cluster's own config file (so the user's
~/.ssh is never touched).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]
PS_SUM = Path(__file__).parents[1] / "runner" / "scripts" / "ps_sum.py"
CLEAN = {"h1": [], "h2": [], "h3": []}

CHECK = re.compile(
    r"^\[(\d+)\]<stdout>:hora check: rank (\d+) of (\d+) \(local (\d+) of (\d+)\) on (\S+) (\S+) "
    r"controller (\w+): allreduce ok, hosts (\S+)$"
)


def check_lines(stdout: str) -> dict[int, tuple[str, ...]]:
    """rank -> (host, address, controller, hosts seen) from hora.runner.check's lines."""
    found = {}
    for line in stdout.splitlines():
        match = CHECK.match(line)
        if match:
            assert match.group(1) == match.group(2), line  # the prefix is the rank that printed it
            found[int(match.group(2))] = (match.group(6), match.group(7), match.group(8), match.group(9))
    return found


@pytest.mark.timeout(180)
@pytest.mark.parametrize("controller", ["--gloo", "--mpi"])
def test_allreduce_across_three_hosts_prints_each_ranks_host(cluster, hora_on_h1, controller):
    result = hora_on_h1("-np", "6", "-H", "h1:2,h2:2,h3:2", controller, "python", "-m", "hora.runner.check")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = check_lines(result.stdout)
    assert sorted(ranks) == list(range(6)), result.stdout
    for rank, (host, addr, backend, hosts) in ranks.items():
        expected = f"h{rank // 2 + 1}"  # two consecutive ranks per host, in -H order
        assert host == expected and addr == cluster.host(expected).addr
        assert backend == controller[2:]
        assert hosts == "h1,h1,h2,h2,h3,h3"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("controller", ["--gloo", "--mpi"])
def test_killing_a_rank_on_h2_stops_every_host_with_the_root_cause(popen_on_h1, leftovers, controller):
    job = popen_on_h1("-np", "6", "-H", "h1:2,h2:2,h3:2", controller, "python", str(SCRIPTS / "hold.py"))
    ready = {}
    for line in job.stdout:
        if "<stdout>:ready " in line:
            _, rank, host, pid = line.split("<stdout>:", 1)[1].split()
            ready[int(rank)] = (host, int(pid))
        if len(ready) == 6:
            break
    assert {host for host, _ in ready.values()} == {"h1", "h2", "h3"}
    victim_rank = min(r for r, (host, _) in ready.items() if host == "h2")
    start = time.monotonic()
    os.kill(ready[victim_rank][1], signal.SIGKILL)
    stdout, stderr = job.communicate(timeout=30)
    elapsed = time.monotonic() - start
    assert job.returncode == 128 + signal.SIGKILL
    assert elapsed < 10, f"the job took {elapsed:.1f} s to stop"
    report = stderr[stderr.index("hora run: job failed"):]
    assert f"root cause: rank {victim_rank} on h2 was killed by signal SIGKILL (9)" in report
    assert f"last stderr lines of rank {victim_rank}:\n    rank {victim_rank} waits on stderr" in report
    if controller == "--gloo":  # (under mpirun, mpirun itself stops the others)
        others = [r for r in range(6) if r != victim_rank]
        assert f"stopped by hora run: ranks {', '.join(map(str, others))}" in report
    assert "was not stopped" not in stdout
    assert leftovers() == CLEAN


@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher_reaches_every_rank_on_every_host(popen_on_h1, leftovers, tmp_path):
    job = popen_on_h1("-np", "3", "-H", "h1,h2,h3", "python", str(SCRIPTS.parent.parent / "runner" / "scripts" /
                      "wait_signal.py"), str(tmp_path))
    ready = 0
    while ready < 3:
        ready += "<stdout>:ready " in job.stdout.readline()
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=30)
    assert job.returncode == 128 + signal.SIGTERM
    assert "hora run: stopped all workers after receiving SIGTERM" in stderr
    for rank in range(3):  # the files land in the shared /tmp
        assert (tmp_path / f"got.{rank}").read_text() == "SIGTERM"
    assert leftovers() == CLEAN


@pytest.mark.timeout(120)
def test_killing_the_launcher_leaves_no_process_on_any_host(popen_on_h1, leftovers):
    job = popen_on_h1("-np", "3", "-H", "h1,h2,h3", "python", str(SCRIPTS / "hold.py"), stderr=None)
    seen = 0
    for line in job.stdout:
        seen += "<stdout>:ready " in line
        if seen == 3:
            break
    assert leftovers(timeout=0) != CLEAN  # the ranks run
    job.kill()  # SIGKILL: the launcher gets no chance to clean up; the agents must
    job.wait()
    assert leftovers() == CLEAN


@pytest.mark.timeout(120)
def test_sync_dst_dir_delivers_the_script_to_hosts_that_lack_it(cluster, hora_on_h1, tmp_path):
    source = tmp_path / "project"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "data.txt").write_text("payload 42\n")
    (source / "where.py").write_text(
        "import os, socket\n"
        "data = open('pkg/data.txt').read().strip()\n"
        "print('ran', socket.gethostname(), os.getcwd(), os.path.abspath(__file__), data)\n"
    )
    dst = os.path.join(cluster.scratch, f"job-{uuid.uuid4().hex[:8]}")  # private to each host
    for host in cluster.hosts:
        assert not os.path.exists(cluster.host_path(host.name, dst))
    result = hora_on_h1("-np", "3", "-H", "h1,h2,h3", "--sync-dst-dir", dst, "python", "where.py", cwd=source)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line.split(":", 1)[1] for line in result.stdout.splitlines() if "<stdout>:ran " in line)
    assert lines == [f"ran h{i} {dst} {dst}/where.py payload 42" for i in (1, 2, 3)]
    for host in cluster.hosts:
        copied = cluster.host_path(host.name, dst)
        assert open(os.path.join(copied, "where.py")).read() == (source / "where.py").read_text()
        assert open(os.path.join(copied, "pkg", "data.txt")).read() == "payload 42\n"


@pytest.mark.timeout(120)
def test_sync_dir_alias_and_missing_directory_without_it(cluster, hora_on_h1, tmp_path):
    # A working directory that exists only on h1 (in its private directory): the other hosts say so.
    only_h1 = os.path.join(cluster.scratch, f"only-h1-{uuid.uuid4().hex[:8]}")
    os.makedirs(cluster.host_path("h1", only_h1))
    with open(os.path.join(cluster.host_path("h1", only_h1), "x.py"), "w") as f:
        f.write("print('x ran')\n")
    result = hora_on_h1("-np", "3", "-H", "h1,h2,h3", "python", "x.py", cwd=only_h1)
    assert result.returncode == 1
    assert f"the working directory {only_h1} does not exist; create it there, or copy it with " \
           "--sync-dst-dir DIR (on h2, h3)" in result.stderr
    dst = os.path.join(cluster.scratch, f"alias-{uuid.uuid4().hex[:8]}")
    result = hora_on_h1("-np", "3", "-H", "h1,h2,h3", "--sync-dir", dst, "python", "x.py", cwd=only_h1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("<stdout>:x ran") == 3


@pytest.mark.timeout(180)
@pytest.mark.parametrize("controller", ["--gloo", "--mpi"])
def test_network_interface_picks_the_namespace_interface(cluster, hora_on_h1, controller):
    result = hora_on_h1("-np", "3", "-H", "h1,h2,h3", controller, "--network-interface", "eth0", "--verbose",
                        "python", "-m", "hora.runner.check")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(check_lines(result.stdout)) == 3
    if controller == "--gloo":
        assert f"rendezvous {cluster.host('h1').addr}:" in result.stderr
    else:
        assert "btl_tcp_if_include eth0" in result.stderr and "oob_tcp_if_include eth0" in result.stderr
    result = hora_on_h1("-np", "3", "-H", "h1,h2,h3", "--network-interface", "eth9", "python", "-c", "pass")
    assert result.returncode == 1
    assert "--network-interface 'eth9' does not exist on h1 (it has: eth0, lo)" in result.stderr


@pytest.mark.timeout(120)
def test_network_interface_reaches_every_process(cluster, hora_on_h1):
    code = ("import os; print('ENV', os.environ.get('GLOO_SOCKET_IFNAME'), os.environ.get('HORA_NETWORK_INTERFACE'),"
            " os.environ['HORA_RENDEZVOUS_ADDR'])")
    result = hora_on_h1("-np", "3", "-H", "h1,h2,h3", "--network-interface", "eth0", "python", "-c", code)
    assert result.returncode == 0, result.stderr[-2000:]
    envs = [line.split("ENV ", 1)[1] for line in result.stdout.splitlines() if "<stdout>:ENV " in line]
    assert envs == [f"eth0 eth0 {cluster.host('h1').addr}"] * 3


@pytest.mark.timeout(120)
def test_unreachable_host_fails_within_the_timeout_naming_it(cluster, hora_on_h1, leftovers):
    sshd = cluster.host("h3").pid
    os.kill(sshd, signal.SIGSTOP)  # h3 accepts TCP connections but never answers
    try:
        start = time.monotonic()
        result = hora_on_h1("-np", "3", "-H", "h1,h2,h3", "--ssh-connect-timeout", "2", "python", "-c", "pass")
        elapsed = time.monotonic() - start
    finally:
        os.kill(sshd, signal.SIGCONT)
    assert result.returncode == 1
    assert "hora run: error: host h3 " in result.stderr, result.stderr
    assert "h1" not in result.stderr.split("hora run: error:")[1].split(";")[0]
    assert elapsed < 20, f"took {elapsed:.1f} s"
    assert leftovers() == CLEAN


@pytest.mark.timeout(120)
def test_port_and_identity_flags_are_what_ssh_uses(cluster, job_env, tmp_path):
    # A config that knows the host keys but offers no key: only -i can log in.
    config = tmp_path / "ssh_config"
    config.write_text(f"Host *\n    User root\n    UserKnownHostsFile {cluster.known_hosts}\n"
                      "    StrictHostKeyChecking yes\n    IdentitiesOnly yes\n    IdentityFile /nonexistent\n")
    base = [sys.executable, "-m", "hora.runner.cli", "run", "--ssh-config-file", str(config), "-np", "2",
            "-H", "h2,h3"]
    command = ["python", "-c", "import socket; print('on', socket.gethostname())"]
    without = cluster.run("h1", [*base, *command], env=job_env, timeout=60)
    assert without.returncode == 1
    assert "host h2 cannot be reached: ssh exited with code 255: root@h2: Permission denied (publickey)" in \
        without.stderr
    with_key = cluster.run("h1", [*base, "-p", "22", "-i", cluster.identity_file, *command], env=job_env,
                           timeout=60)
    assert with_key.returncode == 0, with_key.stderr
    assert sorted(line.split(":", 1)[1] for line in with_key.stdout.splitlines()) == ["on h2", "on h3"]
    wrong_port = cluster.run("h1", [*base, "-p", "2222", "-i", cluster.identity_file, *command],
                             env=job_env, timeout=60)
    assert "host h2 cannot be reached" in wrong_port.stderr and "port 2222: Connection refused" in wrong_port.stderr


@pytest.mark.timeout(120)
def test_unknown_host_and_missing_remote_command_are_clear_errors(cluster, hora_on_h1):
    result = hora_on_h1("-np", "2", "-H", "h1,nohost", "python", "-c", "pass")
    assert result.returncode == 1
    assert "host nohost cannot be reached: ssh exited with code 255" in result.stderr
    # A program that exists on h1 only (in its private directory).
    tool = os.path.join(cluster.scratch, f"tool-{uuid.uuid4().hex[:8]}")
    with open(cluster.host_path("h1", tool), "w") as f:
        f.write("#!/bin/sh\necho tool ran\n")
    os.chmod(cluster.host_path("h1", tool), 0o755)
    result = hora_on_h1("-np", "3", "-H", "h1,h2,h3", tool)
    assert result.returncode == 1
    assert f"cannot run '{tool}': no such executable file (on h2, h3)" in result.stderr
    assert "tool ran" not in result.stdout  # nothing starts anywhere when one host cannot run it
    result = hora_on_h1("-np", "3", "-H", "h1,h2,h3", "no_such_command_xyz")
    assert "cannot run 'no_such_command_xyz': command not found on PATH (on h1, h2, h3)" in result.stderr


@pytest.mark.timeout(120)
def test_mxnet_hostfile_spreads_workers_and_dist_sync_servers_across_hosts(cluster, hora_on_h1, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2\nh3\n")  # MXNet launch.py's format: no slot counts
    result = hora_on_h1("-n", "3", "-s", "2", "-H", str(hostfile), "--launcher", "ssh", "--verbose",
                        "python", str(PS_SUM))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "scheduler on h1, server 0 on h1, server 1 on h2" in result.stderr
    oks = sorted(line.split(":", 1)[1] for line in result.stdout.splitlines() if "sums ok" in line)
    assert oks == [f"worker {r} of 3 on h{r + 1}: dist_sync sums ok" for r in range(3)]
    assert "[server 0]<stderr>:" in result.stderr and "[scheduler]<stderr>:" in result.stderr


def test_hand_started_ranks_on_two_hosts_need_no_interface(cluster, job_env):
    """torchrun-style environment on h1 and h2, no GLOO_SOCKET_IFNAME: gloo finds the route to rank 0 itself."""
    h1 = cluster.host("h1")
    procs = []
    for rank, host in enumerate(("h1", "h2")):
        env = {**job_env, "HORA_RANK": str(rank), "HORA_SIZE": "2", "HORA_LOCAL_RANK": "0", "HORA_LOCAL_SIZE": "1",
               "HORA_CROSS_RANK": str(rank), "HORA_CROSS_SIZE": "2", "HORA_CONTROLLER": "gloo",
               "HORA_RENDEZVOUS_ADDR": h1.addr, "HORA_RENDEZVOUS_PORT": "29511"}
        procs.append(cluster.popen(host, [sys.executable, "-m", "hora.runner.check"], env=env, cwd=str(REPO),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank}:\n{out[-2000:]}"
        assert "allreduce ok, hosts h1,h2" in out, out[-2000:]
