"""Faults of a parameter-server job: dead nodes, departed workers, wrong secrets, bad frames.

Every test bounds its waits: a dead peer must make the survivors raise within
the configured timeout (HORA_PS_TIMEOUT=3 s here), never hang.
"""

from __future__ import annotations

import time

import pytest
from ps_cluster import Cluster

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 3.0  # HORA_PS_TIMEOUT of these jobs
FAST = {"HORA_PS_TIMEOUT": str(TIMEOUT)}
SLACK = 4.0  # process start-up, heartbeat phase and a loaded machine


def _raised(result, cls: str) -> str:
    lines = result.lines("RAISED")
    assert lines and lines[0].startswith(cls), f"expected {cls}, got {lines or result.stdout + result.stderr}"
    return lines[0]


def test_dead_worker_makes_others_raise(tmp_path):
    with Cluster(tmp_path, 2, 1, env=FAST) as c:
        c.start_roles()
        w0 = c.start_worker("dead_worker", rank=0)
        w1 = c.start_worker("dead_worker", rank=1)
        r0 = c.finish(w0, 30)
        assert c.finish(w1, 10).returncode == -9
        message = _raised(r0, "PeerLostError")
        assert "worker 1" in message and "no heartbeat" in message, message
        assert float(r0.lines("AFTER")[0]) < TIMEOUT + SLACK, c.report()
        assert c.wait_roles(TIMEOUT + 10) == [1, 1], c.report()  # scheduler and server end, non-zero


@pytest.mark.parametrize("victim", ["server", "scheduler"])
def test_dead_server_or_scheduler_makes_workers_raise(tmp_path, victim):
    with Cluster(tmp_path, 2, 2, env={**FAST, "HORA_PS_BIGARRAY_BOUND": "1000"}) as c:
        c.start_roles()
        workers = [c.start_worker("fault_loop", rank=r) for r in range(2)]
        deadline = time.monotonic() + 60
        while not all("READY" in (tmp_path / f"worker{i}.out").read_text() for i in range(2)):
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers), c.report()
            time.sleep(0.1)
        target = c.servers[1] if victim == "server" else c.scheduler
        c.kill(target)
        killed_at = time.monotonic()
        results = [c.finish(w, TIMEOUT + 30) for w in workers]
        elapsed = time.monotonic() - killed_at
        for r in results:
            message = _raised(r, "PeerLostError")
            assert (f"pid {target.pid}" in message) if victim == "server" else ("the scheduler" in message), message
        assert elapsed < TIMEOUT + SLACK + 2, f"workers took {elapsed:.1f} s to fail\n{c.report()}"
        others = [p for p in (c.scheduler, *c.servers) if p is not target]
        for p in others:
            assert c.finish(p, TIMEOUT + 15).returncode == 1, c.report()


def test_worker_that_leaves_early_fails_the_round_not_hangs(tmp_path):
    with Cluster(tmp_path, 2, 1, env=FAST) as c:
        c.start_roles()
        results = c.run_workers("leave_early", timeout=60)
        assert [r.returncode for r in results] == [0, 0], c.report()
        pull_error, barrier_error = results[0].lines("RAISED")
        assert "left the job" in pull_error and "worker 1" in pull_error, pull_error
        assert "left the job" in barrier_error, barrier_error
        assert c.wait_roles() == [0, 0], c.report()


@pytest.mark.parametrize("encrypt", ["0", "1"])
def test_secret_mismatch_is_refused_at_the_handshake(tmp_path, encrypt):
    """A wrong secret never gets past the ZeroMQ handshake, in either mode; the scheduler logs the refusal."""
    with Cluster(tmp_path, 1, 1, env={**FAST, "HORA_PS_ENCRYPT": encrypt}) as c:
        c.start_roles()
        r = c.finish(c.start_worker("join_only", env={"HORA_SECRET": "a different secret"}), 30)
        message = _raised(r, "AuthError")
        assert "refused" in message and "handshake" in message and "HORA_SECRET" in message, message
        assert float(r.lines("AFTER")[0]) < 10, c.report()
        c.kill(c.scheduler)
        assert "refused a connection" in c.output("scheduler"), c.report()
        assert "bad message" not in c.output("scheduler"), c.report()  # nothing reached the decoder


def test_encryption_mismatch_between_roles_is_a_clear_error(tmp_path):
    with Cluster(tmp_path, 1, 1, env=FAST) as c:
        c.start_roles()
        r = c.finish(c.start_worker("join_only", env={"HORA_PS_ENCRYPT": "1"}), 30)
        message = _raised(r, "AuthError")
        assert "HORA_PS_ENCRYPT" in message, message


def test_a_connection_libzmq_gave_up_is_an_error_not_a_blocked_send():
    """After a mechanism mismatch libzmq drops its only connection a moment after the monitor reports it;
    a node that sends after that (a loaded machine: the next REGISTER came before the report was read)
    must raise the handshake's error, not block forever on a DEALER with no peer."""
    import zmq

    from hora.config import PSConfig
    from hora.errors import AuthError
    from hora.kvstore.ps import secure
    from hora.kvstore.ps.link import SchedulerLink

    ctx = zmq.Context()
    try:
        listener = ctx.socket(zmq.ROUTER)
        secure.secure_listener(listener, secure.credentials(b"k", False))
        secure.Authenticator(ctx, secure.credentials(b"k", False), "test", listener)
        port = listener.bind_to_random_port("tcp://127.0.0.1")
        config = PSConfig.from_env({}, root_port=port, num_workers=1, num_servers=1, encrypt=True,
                                   start_timeout_s=60.0)
        link = SchedulerLink(ctx, config, b"k", "worker")
        link.sock.send(b"first")  # goes into the pipe libzmq is about to drop
        deadline = time.monotonic() + 10
        while True:  # wait until libzmq has dropped the pipe, without reading the monitor
            try:
                link.sock.send(b"probe", zmq.NOBLOCK)
            except zmq.Again:
                break
            assert time.monotonic() < deadline, "libzmq kept the connection of a failed handshake"
            time.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(AuthError, match="HORA_PS_ENCRYPT=1"):
            link.register()
        assert time.monotonic() - started < 5
        link.close()
        listener.close(linger=0)
    finally:
        ctx.term()


def test_roles_that_start_further_apart_than_the_timeout_still_join(tmp_path):
    """A registered server heartbeats while it waits for the workers: a worker that starts after more than
    HORA_PS_TIMEOUT (a slow torch import on a busy host) still finds the job alive."""
    with Cluster(tmp_path, 1, 1, env=FAST) as c:
        c.start_roles()
        time.sleep(3 * TIMEOUT)
        (r,) = c.run_workers("sums", "dist_sync", "float32", "int", "2", timeout=60)
        assert r.returncode == 0, c.report()
        assert c.wait_roles() == [0, 0], c.report()


def test_no_scheduler_is_a_clear_error(tmp_path):
    with Cluster(tmp_path, 1, 1, env={"HORA_PS_START_TIMEOUT": "2"}) as c:
        r = c.finish(c.start_worker("join_only"), 30)
        message = _raised(r, "PSError")
        assert "no answer from a scheduler" in message, message


def test_fuzzed_server_keeps_every_value_and_keeps_serving(tmp_path):
    """>= 1000 forged, truncated and malformed frames change nothing; the server still answers."""
    with Cluster(tmp_path, 1, 1) as c:
        c.start_roles()
        (r,) = c.run_workers("fuzz", "25", timeout=90)
        assert r.returncode == 0, c.report()
        sent = int(r.lines("SENT")[0])
        assert sent >= 1000
        assert int(r.lines("REFUSED_TOTAL")[0]) == 17  # 9 requests, and 8 bad shared-memory references
        assert int(r.lines("CHECKED")[0]) == 4
        assert c.wait_roles() == [0, 0], c.report()
        assert f"dropped {sent} bad messages in all" in c.output("server0"), c.report()  # each one, none accepted
