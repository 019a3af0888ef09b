"""The shared-memory data path between co-located workers and servers: exact values, fallbacks, cleanup.

Every job here runs on one host, so workers and servers share memory unless
told not to (``HORA_PS_SHM=0``) or kept apart (another pid namespace).
``HORA_PS_SHM_MIN_BYTES=0`` sends every shard through shared memory, small
keys included.  The servers log how many pushes and pulls went that way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from ps_cluster import Cluster

from hora.kvstore.ps import shm

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not shm.available(), reason="no /dev/shm on this platform")]

SHM = {"HORA_PS_SHM_MIN_BYTES": "0"}
SPLIT = {"HORA_PS_BIGARRAY_BOUND": "1000", "HORA_PS_PART_BYTES": "1024"}
FAST = {"HORA_PS_TIMEOUT": "3"}


def _all_checked(results, cluster: Cluster, at_least: int) -> None:
    for i, r in enumerate(results):
        assert r.returncode == 0, f"worker {i} failed:\n{cluster.report()}"
        checked = r.lines("CHECKED")
        assert checked and int(checked[-1]) >= at_least, f"worker {i} checked too little:\n{cluster.report()}"


def _shared(cluster: Cluster, server: int = 0) -> tuple[int, int, int]:
    """(workers that shared memory, pushes, pulls) from a finished server's log."""
    log = cluster.output(f"server{server}")
    m = re.search(r"(\d+) of \d+ workers shared memory; (\d+) pushes and (\d+) pulls", log)
    assert m, cluster.report()
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@pytest.mark.parametrize("workers,servers,dtype,kind,env", [
    (2, 1, "float32", "int", SHM),
    (3, 2, "float64", "str", {**SHM, **SPLIT}),
    (2, 2, "int64", "int", {**SHM, "HORA_PS_BIGARRAY_BOUND": "1000"}),
])
def test_shared_memory_sums_are_exact(tmp_path, workers, servers, dtype, kind, env):
    """Pushes summed straight out of the workers' segments, pulls copied out of the servers': exact, and no
    segment is left behind."""
    with Cluster(tmp_path, workers, servers, env=env) as c:
        c.start_roles()
        _all_checked(c.run_workers("sums", "dist_sync", dtype, kind, "4"), c, 13)
        assert c.wait_roles() == [0] * (1 + servers), c.report()
        for j in range(servers):
            peers, pushes, pulls = _shared(c, j)
            assert peers == workers and pushes > 0 and pulls > 0, c.report()
        assert c.segments() == []


def test_socket_path_when_shared_memory_is_off(tmp_path):
    with Cluster(tmp_path, 2, 1, env={**SHM, "HORA_PS_SHM": "0"}) as c:
        c.start_roles()
        _all_checked(c.run_workers("sums", "dist_sync", "float32", "str", "3"), c, 10)
        assert c.wait_roles() == [0, 0], c.report()
        assert _shared(c) == (0, 0, 0)


def test_one_worker_on_the_socket_path_one_in_shared_memory(tmp_path):
    """The choice is per worker and server: a worker with HORA_PS_SHM=0 beside one that shares memory."""
    with Cluster(tmp_path, 2, 1, env=SHM) as c:
        c.start_roles()
        procs = [c.start_worker("shm_status", rank=0), c.start_worker("shm_status", rank=1, env={"HORA_PS_SHM": "0"})]
        results = [c.finish(p, 90) for p in procs]
        _all_checked(results, c, 1)
        assert [r.lines("SHM") for r in results] == [["1"], ["0"]]
        assert c.wait_roles() == [0, 0], c.report()
        assert _shared(c) == (1, 2, 1)  # worker 0: its init and its push; its pull


def test_another_pid_namespace_keeps_the_socket_path(tmp_path):
    """A worker the server cannot prove co-located (here: another pid namespace) uses the socket."""
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a pid namespace here (unshare needs privileges)")
    with Cluster(tmp_path, 2, 1, env=SHM) as c:
        c.start_roles()
        procs = [c.start_worker("shm_status", rank=0),
                 c.start_worker("shm_status", rank=1, wrap=["unshare", "--pid", "--fork"])]
        results = [c.finish(p, 90) for p in procs]
        _all_checked(results, c, 1)
        assert [r.lines("SHM") for r in results] == [["1"], ["0"]]
        assert c.wait_roles() == [0, 0], c.report()
        assert _shared(c)[0] == 1


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_server_optimizer_through_shared_memory(tmp_path, name):
    """Updates in place on values that workers read out of shared memory (copy-on-write when still read)."""
    with Cluster(tmp_path, 2, 2, env={**SHM, **SPLIT}) as c:
        c.start_roles()
        _all_checked(c.run_workers("optimizer", name, "5", str(tmp_path / "states.bin")), c, 6)
        assert c.wait_roles() == [0, 0, 0], c.report()
        assert _shared(c)[1] > 0


def test_async_through_shared_memory(tmp_path):
    with Cluster(tmp_path, 3, 2, env={**SHM, **SPLIT}) as c:
        c.start_roles()
        _all_checked(c.run_workers("async_once", "20"), c, 22)
        assert c.wait_roles() == [0, 0, 0], c.report()
        assert _shared(c)[1] > 0


def test_shared_memory_resends_never_apply_twice(tmp_path):
    """Servers drop every 3rd reply, shared-memory pull answers included; results stay exact and the
    unanswered readers are released with the resent pull."""
    env = {**SHM, **SPLIT, "HORA_PS_RESEND_TIMEOUT_MS": "50"}
    with Cluster(tmp_path, 2, 2, env=env) as c:
        c.start_roles(server_env={"HORA_PS_TEST_DROP_REPLY_EVERY": "3"})
        _all_checked(c.run_workers("sums", "dist_sync", "float32", "str", "6"), c, 19)
        assert c.wait_roles() == [0, 0, 0], c.report()
        assert _shared(c)[2] > 0


def test_torch_tensors_through_shared_memory(tmp_path):
    """Torch tensors are filled from the servers' read-only segments (no copy through a writable array,
    and no warning from torch about one)."""
    pytest.importorskip("torch")
    with Cluster(tmp_path, 2, 2, env={**SHM, "HORA_PS_BIGARRAY_BOUND": "10"}) as c:
        c.start_roles()
        results = c.run_workers("torch_values", "dist_sync", timeout=150)
        _all_checked(results, c, 10)
        assert not any("not writable" in r.stderr for r in results), c.report()
        assert c.wait_roles() == [0, 0, 0], c.report()
        assert _shared(c)[2] > 0


def _wait_ready(c: Cluster, procs, count: int) -> None:
    deadline = time.monotonic() + 60
    while not all("READY" in (c.dir / f"worker{i}.out").read_text() for i in range(count)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), c.report()
        time.sleep(0.1)


@pytest.mark.parametrize("victim", ["worker", "server"])
def test_segments_of_a_killed_role_are_removed(tmp_path, victim):
    """SIGKILL a worker or the server while it holds named segments: the survivors remove them."""
    with Cluster(tmp_path, 2, 1, env=FAST) as c:
        c.start_roles()
        workers = [c.start_worker("shm_hold", rank=r) for r in range(2)]
        _wait_ready(c, workers, 2)
        target = workers[1] if victim == "worker" else c.servers[0]
        held = [n for n in c.segments() if f"-{target.pid}-" in n]
        assert held, f"the {victim} holds no named segment: {c.segments()}"
        c.kill(target)
        survivors = [w for w in workers if w is not target]
        for w in survivors:
            r = c.finish(w, 30)
            assert r.lines("RAISED") and "PeerLostError" in r.lines("RAISED")[0], c.report()
        others = [p for p in (c.scheduler, *c.servers) if p is not target]
        for p in others:
            assert c.finish(p, 30).returncode == 1, c.report()
        assert c.segments() == [], c.report()


def test_orphans_of_a_job_killed_whole_are_removed_by_the_next(tmp_path):
    """Segments whose creators all died (a job killed with SIGKILL) go when a later job starts."""
    code = ("import os, signal\nfrom hora.kvstore.ps import shm\n"
            "print(shm.Segment.create('0123456789ab', 4096).name, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Cluster(tmp_path, 1, 1).env["PYTHONPATH"])})
    name = proc.stdout.strip()
    assert proc.returncode == -9 and os.path.exists(f"{shm.SHM_DIR}/{name}")
    with Cluster(tmp_path, 1, 1) as c:
        c.start_roles()
        _all_checked(c.run_workers("shm_status"), c, 1)
        assert c.wait_roles() == [0, 0], c.report()
    assert not os.path.exists(f"{shm.SHM_DIR}/{name}")


def test_launch_index_names_the_servers(tmp_path):
    """HORA_PS_SERVER_INDEX (set by the launcher) becomes the server id, whatever the registration order."""
    with Cluster(tmp_path, 1, 2, env={"HORA_PS_BIGARRAY_BOUND": "1000"}) as c:
        c.start_roles(server_index=[1, 0])
        _all_checked(c.run_workers("shm_status"), c, 1)
        assert c.wait_roles() == [0, 0, 0], c.report()
        assert f"server 1 (pid {c.servers[0].pid} " in c.output("server0"), c.report()
        assert f"server 0 (pid {c.servers[1].pid} " in c.output("server1"), c.report()


# ------------------------------------------------------------------------------------- in one process
def test_segments_are_private_and_checked(tmp_path):
    seg = shm.Segment.create("0123456789ab", 100)
    try:
        path = f"{shm.SHM_DIR}/{seg.name}"
        assert os.stat(path).st_mode & 0o777 == 0o600
        seg.array(np.dtype(np.float32), 25)[:] = 7
        peer = shm.Segment.open("0123456789ab", seg.name)
        view = peer.array(np.dtype(np.float32), 25)
        assert not view.flags.writeable and (view == 7).all()
        for offset, count in ((4, 25), (2, 3), (0, 26)):
            with pytest.raises(shm.ShmError):
                peer.array(np.dtype(np.float32), count, offset)
        for bad in ("../../etc/passwd", seg.name + "x", "/dev/shm/" + seg.name, 7):
            with pytest.raises(shm.ShmError, match="not a shared-memory segment of this job"):
                shm.Segment.open("0123456789ab", bad)
        with pytest.raises(shm.ShmError, match="not a shared-memory segment of this job"):
            shm.Segment.open("ba9876543210", seg.name)  # another job's
        os.chmod(path, 0o640)
        with pytest.raises(shm.ShmError, match="not a private file"):
            shm.Segment.open("0123456789ab", seg.name)
        del view
        peer.close()
    finally:
        seg.unlink()
        seg.close()
    assert not os.path.exists(f"{shm.SHM_DIR}/{seg.name}")


def test_probe_proves_the_nonce():
    probe, nonce = shm.make_probe("0123456789ab")
    try:
        shm.check_probe("0123456789ab", probe.name, nonce.hex())
        with pytest.raises(shm.ShmError, match="another nonce"):
            shm.check_probe("0123456789ab", probe.name, bytes(16).hex())
        with pytest.raises(shm.ShmError, match="malformed"):
            shm.check_probe("0123456789ab", probe.name, "00")
    finally:
        probe.unlink()
        probe.close()


def test_server_buffers_unlink_when_collected():
    buffers = shm.Buffers("0123456789ab")
    a = buffers.alloc(1000, np.dtype(np.float64))
    seg = buffers.segment_of(a)
    assert seg is not None and (a == 0).all() and buffers.segment_of(np.zeros(3)) is None
    name = seg.name
    assert os.path.exists(f"{shm.SHM_DIR}/{name}")
    del a, seg
    import gc

    gc.collect()
    assert not os.path.exists(f"{shm.SHM_DIR}/{name}")


def test_mappings_keep_the_last_names_of_a_slot():
    segs = [shm.Segment.create("0123456789ab", 64) for _ in range(3)]
    try:
        maps = shm.Mappings("0123456789ab", keep=2)
        for s in segs:
            maps.view(("w0", "k"), shm.make_ref(s, 0, 8, np.dtype(np.float64)))
        assert sorted(maps._by_name) == sorted(s.name for s in segs[1:])
        _, _, _, new = maps.view(("w0", "k"), shm.make_ref(segs[2], 0, 8, np.dtype(np.float64)))
        assert not new
        maps.close()
    finally:
        for s in segs:
            s.unlink()
            s.close()


def test_reap_spares_live_creators_and_other_namespaces():
    live = shm.Segment.create("0123456789ab", 64)
    foreign = f"{shm.SHM_DIR}/{shm.PREFIX}0123456789ab-1-999999-{'ab' * 8}"  # pid namespace 1: not ours
    fd = os.open(foreign, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    try:
        assert shm.reap("0123456789ab") == []
        assert os.path.exists(f"{shm.SHM_DIR}/{live.name}") and os.path.exists(foreign)
    finally:
        os.unlink(foreign)
        live.unlink()
        live.close()
