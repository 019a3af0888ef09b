"""The elastic driver's host-loss path, in one process: a lost host's workers, the survivors' abort.

A real driver socket and real authenticated channels; the spawner is a
stand-in that records signals (no processes), and the host watch one that
reports h3 lost when told.  The connection shut-down a
survivor performs on an abort is checked on a real TCP pair with a thread
blocked in ``recv``: it must wake at once.
"""

from __future__ import annotations

import queue
import signal
import socket
import threading
import time

import pytest

from hora import elastic_wire
from hora.config import ElasticConfig
from hora.core.elastic.watch import DriverWatch, shut_connections
from hora.runner.elastic.driver import ElasticDriver, ElasticSettings, Worker
from hora.runner.elastic.hosts import HostManager

SECRET = "job-secret"


class RecordingSpawner:
    def __init__(self) -> None:
        self.exits: queue.Queue = queue.Queue()
        self.signals: list[tuple[list[int], int]] = []

    def signal(self, seqs, signum) -> None:
        self.signals.append((list(seqs), signum))


class Sink:
    def tail(self, key):
        return []


class FakeHostWatch:
    def __init__(self) -> None:
        self.watched: list[str] = []
        self.pending: list[tuple[str, str]] = []

    def watch(self, host: str) -> None:
        self.watched.append(host)

    def lost(self) -> list[tuple[str, str]]:
        found, self.pending = self.pending, []
        return found


@pytest.fixture
def driver():
    d = ElasticDriver(ElasticSettings(num_proc=3, min_np=2), HostManager(), discovery=None,
                      spawner=RecordingSpawner(), secret=SECRET, sink=Sink(), interrupt=None,
                      host_watch=FakeHostWatch())
    d.hosts.update({"h1": 1, "h2": 1, "h3": 1})
    for seq, host in enumerate(("h1", "h2", "h3")):
        d.workers[seq] = Worker(seq, host)
    d.round, d.members = 1, [0, 1, 2]
    d._addrs = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.3"}
    yield d
    d.close()


def _watch(driver, seq: int) -> elastic_wire.Channel:
    channel = elastic_wire.connect("127.0.0.1", driver.port, SECRET, timeout=10)
    channel.send({"op": "watch", "worker": f"h{seq + 1}-{seq}", "round": 1})
    return channel


def _until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_a_lost_host_fails_its_workers_and_the_survivors_are_told_to_leave_the_round(driver):
    lines = {seq: _watch(driver, seq) for seq in range(3)}
    _until(lambda: len(driver._watches) == 3, 10)
    driver._check_heartbeats()
    assert all(w.alive for w in driver.workers.values())  # nothing lost yet
    driver.host_watch.pending = [("h3", "lost: h3 stopped answering (no heartbeat for 8.1 s)")]
    driver._check_heartbeats()
    assert not driver.workers[2].alive and driver.workers[2].returncode == 255
    assert driver.workers[0].alive and driver.workers[1].alive
    assert driver.spawner.signals == [([2], signal.SIGKILL)]
    assert driver.hosts.is_blacklisted("h3")
    assert driver.events and driver.events[-1].update == elastic_wire.HOSTS_REMOVED
    assert driver.failures[0].host == "h3" and "lost: h3 stopped answering" in driver.failures[0].note
    for seq in (0, 1):
        lines[seq].sock.settimeout(10)
        message = lines[seq].recv()
        assert message["round"] == 1 and message["addrs"] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
        assert "lost: h3 stopped answering" in message["abort"]
    driver.spawner.exits.put((2, -9))  # its ssh, killed: already counted, not a second failure
    driver._reap()
    assert len(driver.failures) == 1
    for channel in lines.values():
        channel.close()


def test_starting_a_worker_watches_its_host(driver):
    driver.spawner.start = lambda seq, host, env: None
    driver._start("h2", 0)
    assert driver.host_watch.watched == ["h2"]


@pytest.mark.timeout(60)
def test_a_dropped_member_aborts_the_round_but_a_closed_watch_or_an_exit_does_not(driver):
    lines = {seq: _watch(driver, seq) for seq in range(3)}
    _until(lambda: len(driver._watches) == 3, 10)
    lines[2].close()  # h3's worker left its round on purpose: not a loss
    _until(lambda: 2 not in driver._watches, 10)
    assert driver.workers[2].alive and driver.spawner.signals == []
    driver.spawner.exits.put((2, 1))  # then it failed: its connections closed with it, the others know at once
    driver._reap()
    assert driver.events and driver.events[-1].update == elastic_wire.HOSTS_REMOVED
    assert driver.hosts.is_blacklisted("h3")
    lines[0].sock.settimeout(0.5)
    with pytest.raises(TimeoutError):
        lines[0].recv()
    driver.hosts.update({"h1": 1})  # discovery drops h2 while its worker is a member
    driver._reconcile(time.monotonic())
    assert driver.workers[1].retired
    lines[0].sock.settimeout(10)
    assert lines[0].recv()["abort"] == "discovery no longer lists h2"
    driver.round = 2  # a new round without it: a member lost after that aborts round 2 only
    driver.members = [0, 1]
    driver._abort_round([2], "not a member")
    lines[0].sock.settimeout(0.5)
    with pytest.raises(TimeoutError):
        lines[0].recv()
    for channel in lines.values():
        channel.close()


@pytest.mark.timeout(60)
def test_shut_connections_wakes_a_blocked_reader_and_keeps_the_listed_ports():
    server = socket.create_server(("127.0.0.1", 0))
    kept_server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    kept = socket.create_connection(kept_server.getsockname())
    kept_peer, _ = kept_server.accept()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(client.recv(10)), daemon=True)
    reader.start()
    time.sleep(0.2)
    shut = shut_connections({"127.0.0.1"}, keep_ports={kept_server.getsockname()[1]})
    reader.join(5)
    assert got == [b""], "the blocked reader did not wake"
    assert shut >= 2  # both ends of the pair (this process holds both)
    kept_peer.sendall(b"x")
    kept.settimeout(5)
    assert kept.recv(1) == b"x"  # the kept connection still works
    for s in (server, kept_server, client, peer, kept, kept_peer):
        s.close()


@pytest.mark.timeout(60)
def test_an_abort_for_the_workers_round_shuts_its_peer_connections_and_keeps_its_line(driver):
    peer_server = socket.create_server(("127.0.0.1", 0))
    gloo_like = socket.create_connection(peer_server.getsockname())
    accepted, _ = peer_server.accept()
    config = ElasticConfig(driver_addr="127.0.0.1", driver_port=driver.port, worker_id="h2-1", secret=SECRET)
    watch = DriverWatch(config, round_=1)
    try:
        _until(lambda: 1 in driver._watches, 10)
        _, channel = driver._watches[1]
        channel.send({"abort": "old round", "round": 0, "addrs": ["127.0.0.1"]})
        channel.send({"abort": "h3 lost", "round": 1, "addrs": ["127.0.0.1"]})
        _until(lambda: watch.aborted == "h3 lost", 10)
        gloo_like.settimeout(5)
        assert gloo_like.recv(1) == b""
        assert driver._watches[1][1] is channel, "the driver's own line was shut"
        channel.send({"abort": "again", "round": 1, "addrs": []})  # the line still carries messages
        _until(lambda: watch.aborted == "again", 10)
    finally:
        watch.close()
        for s in (peer_server, gloo_like, accepted):
            s.close()
    _until(lambda: 1 not in driver._watches, 10)  # closing it ends the driver's side too
