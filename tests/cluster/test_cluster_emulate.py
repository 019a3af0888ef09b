"""The emulated cluster itself: hosts, names, private directories, shaping, idempotent and stale teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hora.errors import ConfigError
from hora.testing.emulate import REGISTRY, ClusterUnavailable, EmulatedCluster, latency_supported, sweep_stale

pytestmark = pytest.mark.netns

SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5555)); s.listen(1); print('listening', flush=True)
c, _ = s.accept(); n = 0; start = None
while True:
    data = c.recv(1 << 20)
    if not data: break
    start = start or time.monotonic(); n += len(data)
print(n, time.monotonic() - start, flush=True)
"""
CLIENT = "import socket, sys; c = socket.create_connection((sys.argv[1], 5555)); c.sendall(b'x' * 4_000_000); c.close()"


def gone(pid: int, timeout: float = 5.0) -> bool:
    """Whether ``pid`` has ended (a zombie nobody reaped yet counts as ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@pytest.mark.timeout(60)
def test_hosts_have_their_own_name_address_and_private_directory(cluster):
    for host in cluster.hosts:
        result = cluster.run(host.name, ["sh", "-c", "hostname; cat /etc/hosts; ls " + cluster.scratch])
        lines = result.stdout.splitlines()
        assert lines[0] == host.name
        assert f"{host.addr} {host.name}" in lines
    marker = os.path.join(cluster.scratch, "only-on-h2")
    open(cluster.host_path("h2", marker), "w").close()
    assert cluster.run("h2", ["test", "-e", marker]).returncode == 0
    assert cluster.run("h3", ["test", "-e", marker]).returncode == 1
    ssh = cluster.run("h1", cluster.ssh_command("h3", "hostname; echo $SSH_CONNECTION"))
    assert ssh.returncode == 0, ssh.stderr
    assert ssh.stdout.split()[0] == "h3" and ssh.stdout.split()[1] == cluster.host("h1").addr
    assert not os.path.exists(os.path.expanduser("~/.ssh/known_hosts")) or "hora-emulated" not in open(
        os.path.expanduser("~/.ssh/known_hosts")).read()


def throughput(cluster, sender: str, receiver: str) -> float:
    """Bytes per second from ``sender`` to ``receiver`` over one TCP connection."""
    addr = cluster.host(receiver).addr
    server = cluster.popen(receiver, [sys.executable, "-c", SERVER, addr], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"  # type: ignore[union-attr]
        cluster.run(sender, [sys.executable, "-c", CLIENT, addr], timeout=60, check=True)
        count, seconds = server.stdout.readline().split()  # type: ignore[union-attr]
    finally:
        server.kill()
        server.wait()
    return int(count) / max(float(seconds), 1e-6)


@pytest.mark.timeout(120)
def test_link_shaping_limits_the_bandwidth(cluster):
    try:
        cluster.shape(link="50mbit", latency=None)
        shaped = throughput(cluster, "h1", "h2")
    finally:
        cluster.shape(link=None, latency=None)
    free = throughput(cluster, "h1", "h2")
    assert shaped < 50e6 / 8 * 1.5, f"{shaped * 8 / 1e6:.0f} Mbit/s through a 50 Mbit/s link"
    assert free > 3 * shaped, f"unshaped {free * 8 / 1e6:.0f} Mbit/s vs shaped {shaped * 8 / 1e6:.0f}"
    with pytest.raises(ConfigError, match="is not a tc value"):
        cluster.shape(link="fast", latency=None)


@pytest.mark.timeout(120)
def test_latency_is_emulated_or_refused_with_the_reason():
    if latency_supported():
        with EmulatedCluster(2, latency="20ms") as shaped:
            result = shaped.run("h1", ["ping", "-c", "3", "-q", "h2"])
            assert "rtt" in result.stdout and float(result.stdout.split("=")[-1].split("/")[1]) >= 20
    else:
        with pytest.raises(ClusterUnavailable, match="netem"):
            EmulatedCluster(2, latency="1ms").start()
    assert not [n for n in netns_names() if n.startswith("hora") and n.endswith("-h2") and n not in _ours()]


def _ours() -> set[str]:
    names = set()
    for name in os.listdir(REGISTRY) if os.path.isdir(REGISTRY) else []:
        names |= {f"hora{name[:-5]}-h{i}" for i in range(1, 10)}
    return names


@pytest.mark.timeout(120)
def test_close_is_idempotent_and_removes_everything():
    cluster = EmulatedCluster(2).start()
    index, state = cluster.index, cluster.state_dir
    sshd = [h.pid for h in cluster.hosts]
    assert f"hora{index}-h1" in netns_names()
    cluster.close()
    cluster.close()
    assert not [n for n in netns_names() if n.startswith(f"hora{index}-")]
    assert not os.path.exists(state) and not os.path.exists(os.path.join(REGISTRY, f"{index}.json"))
    assert subprocess.run(["ip", "link", "show", f"hora{index}br"], capture_output=True).returncode != 0
    assert all(gone(pid) for pid in sshd)


@pytest.mark.timeout(120)
def test_a_cluster_left_by_a_killed_process_is_swept():
    code = ("from hora.testing.emulate import EmulatedCluster; import json, time; c = EmulatedCluster(2).start(); "
            "print(json.dumps([c.index, c.state_dir, [h.pid for h in c.hosts]]), flush=True); time.sleep(120)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        index, state, sshd = json.loads(owner.stdout.readline())  # type: ignore[union-attr]
    finally:
        owner.send_signal(signal.SIGKILL)  # no finalizer, no atexit: only the sweep can clean up
        owner.wait()
    assert f"hora{index}-h2" in netns_names()
    assert index in sweep_stale()
    assert not [n for n in netns_names() if n.startswith(f"hora{index}-")]
    assert not os.path.exists(state)
    assert all(gone(pid) for pid in sshd)
