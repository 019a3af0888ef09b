"""dist_sync / dist_async / dist_device_sync through real scheduler, server and worker processes."""

from __future__ import annotations

import pytest
from ps_cluster import Cluster

pytestmark = pytest.mark.timeout(180)


def _all_checked(results, cluster: Cluster, at_least: int) -> None:
    for i, r in enumerate(results):
        assert r.returncode == 0, f"worker {i} failed:\n{cluster.report()}"
        checked = r.lines("CHECKED")
        assert checked and int(checked[-1]) >= at_least, f"worker {i} checked too little:\n{cluster.report()}"


SPLIT = {"HORA_PS_BIGARRAY_BOUND": "1000", "HORA_PS_PART_BYTES": "1024"}  # big keys: 2 servers, many parts


@pytest.mark.parametrize("workers,servers,dtype,kind,env", [
    (2, 1, "float32", "int", {}),
    (3, 2, "float64", "str", SPLIT),
    (2, 2, "int64", "int", {"HORA_PS_BIGARRAY_BOUND": "1000"}),
    (2, 2, "float32", "str", {**SPLIT, "HORA_PS_ENCRYPT": "1", "HORA_PS_SHM": "0"}),  # CURVE on every connection
])
def test_sync_sums_are_exact(tmp_path, workers, servers, dtype, kind, env):
    """Every pull returns the exact sum of the round's pushes; big keys are split and reassembled."""
    with Cluster(tmp_path, workers, servers, env=env) as c:
        c.start_roles()
        results = c.run_workers("sums", "dist_sync", dtype, kind, "4")
        _all_checked(results, c, 13)
        assert c.wait_roles() == [0] * (1 + servers), c.report()


def test_device_sync_sums_device_values(tmp_path):
    with Cluster(tmp_path, 2, 1) as c:
        c.start_roles()
        _all_checked(c.run_workers("sums", "dist_device_sync", "float32", "str", "2"), c, 7)
        assert c.wait_roles() == [0, 0], c.report()


def test_pushpull_async_tickets_give_the_sum_and_refuse_misuse(tmp_path):
    """The ticket a binding runs on its engine: ready signal, exact values, and clear errors when misused."""
    with Cluster(tmp_path, 2, 1) as c:
        c.start_roles()
        results = c.run_workers("tickets")
        _all_checked(results, c, 3)
        for r in results:
            raised = r.lines("RAISED")
            assert raised.count("PSError: this pull was already finished or cancelled") == 3, c.report()
            assert any(line.startswith("ConfigError: 1 keys were pulled but 2 outs were given") for line in raised), \
                c.report()
        assert c.wait_roles() == [0, 0], c.report()


def test_async_applies_every_push_once(tmp_path):
    with Cluster(tmp_path, 3, 2, env=SPLIT) as c:
        c.start_roles()
        _all_checked(c.run_workers("async_once", "20"), c, 22)
        assert c.wait_roles() == [0, 0, 0], c.report()


@pytest.mark.parametrize("name", ["sgd", "adam", "lbsgd", "rmsprop", "ftml"])
def test_server_optimizer_matches_local(tmp_path, name):
    """The servers' optimizer equals the same optimizer run locally; its states save and load."""
    with Cluster(tmp_path, 2, 2, env=SPLIT) as c:
        c.start_roles()
        _all_checked(c.run_workers("optimizer", name, "5", str(tmp_path / "states.bin")), c, 6)
        assert c.wait_roles() == [0, 0, 0], c.report()


def test_two_bit_compression_through_servers(tmp_path):
    with Cluster(tmp_path, 2, 2, env=SPLIT) as c:
        c.start_roles()
        _all_checked(c.run_workers("compression", "6"), c, 18)
        assert c.wait_roles() == [0, 0, 0], c.report()


@pytest.mark.parametrize("scenario,args", [("sums", ("dist_sync", "float32", "str", "6")), ("async_once", ("15",))])
def test_resends_never_apply_twice(tmp_path, scenario, args):
    """Servers drop every 3rd reply; workers resend after 50 ms and the results stay exact."""
    env = {**SPLIT, "HORA_PS_RESEND_TIMEOUT_MS": "50"}
    with Cluster(tmp_path, 2, 2, env=env) as c:
        c.start_roles(server_env={"HORA_PS_TEST_DROP_REPLY_EVERY": "3"})
        _all_checked(c.run_workers(scenario, *args), c, 17)
        assert c.wait_roles() == [0, 0, 0], c.report()


@pytest.mark.parametrize("kv_type", ["dist_sync", "dist_device_sync"])
def test_torch_tensors_in_and_out(tmp_path, kv_type):
    pytest.importorskip("torch")
    with Cluster(tmp_path, 2, 2, env={"HORA_PS_BIGARRAY_BOUND": "10"}) as c:
        c.start_roles()
        _all_checked(c.run_workers("torch_values", kv_type, timeout=150), c, 10)
        assert c.wait_roles() == [0, 0, 0], c.report()


def test_training_script_started_as_server_becomes_one(tmp_path):
    """MXNet's habit: the training script itself, started with DMLC_ROLE=server, serves when it creates the store."""
    from ps_cluster import WORKERS

    with Cluster(tmp_path, 2, 1) as c:
        c.scheduler = c._start("scheduler", ["-m", "hora.kvstore.ps.node"], {"DMLC_ROLE": "scheduler"})
        script = [str(WORKERS), "sums", "dist_sync", "float32", "int", "2"]
        server = c._start("server0", script, {"DMLC_ROLE": "server"})
        _all_checked(c.run_workers("sums", "dist_sync", "float32", "int", "2"), c, 7)
        done = c.finish(server, 30)
        assert done.returncode == 0 and "CHECKED" not in done.stdout, c.report()  # it served, never ran the script on
