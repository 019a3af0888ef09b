"""hora.ray's decisions without a cluster: ranks from placement, bundles, settings, arguments, the job's env."""

from __future__ import annotations

import pytest

from hora import envvars
from hora.errors import ConfigError
from hora.ray import RayExecutor, RaySettings
from hora.ray.plan import ActorInfo, assign, bundles, check_controller, death_cause, job_env
from hora.runner.env import Endpoints


def info(node: str, ip: str) -> ActorInfo:
    return ActorInfo(node_id=node, node_ip=ip, hostname=f"host-{node}", pid=1)


def test_a_nodes_actors_get_consecutive_ranks_whatever_order_ray_started_them():
    # 12 actors created round-robin over three nodes, as Horovod's coordinator test registers them.
    ips = {"a": "10.0.0.3", "b": "10.0.0.1", "c": "10.0.0.20"}
    infos = [info(node, ips[node]) for _ in range(4) for node in "abc"]
    slots = assign(infos)
    assert sorted(s.rank for s in slots) == list(range(12))
    by_node: dict[str, list] = {}
    for actor, slot in zip(infos, slots, strict=True):
        by_node.setdefault(actor.node_id, []).append(slot)
    # nodes ordered by IP (numerically: 10.0.0.3 before 10.0.0.20): b, a, c
    assert [s.rank for s in by_node["b"]] == [0, 1, 2, 3]
    assert [s.rank for s in by_node["a"]] == [4, 5, 6, 7]
    assert [s.rank for s in by_node["c"]] == [8, 9, 10, 11]
    for cross_rank, node in enumerate("bac"):
        assert [s.local_rank for s in by_node[node]] == [0, 1, 2, 3]
        assert {(s.local_size, s.cross_rank, s.cross_size, s.size, s.host) for s in by_node[node]} == {
            (4, cross_rank, 3, 12, ips[node])}


def test_uneven_nodes_get_their_own_local_sizes():
    infos = [info("n1", "10.0.0.1")] * 5 + [info("n2", "10.0.0.2")] * 4 + [info("n3", "10.0.0.3")] * 3
    slots = assign(infos)
    assert [s.local_size for s in slots] == [5] * 5 + [4] * 4 + [3] * 3
    assert [s.cross_rank for s in slots] == [0] * 5 + [1] * 4 + [2] * 3
    assert [s.local_rank for s in slots] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]


def test_two_ray_nodes_on_one_address_stay_two_hosts():
    slots = assign([info("x", "10.0.0.1"), info("y", "10.0.0.1"), info("x", "10.0.0.1")])
    assert [(s.rank, s.local_rank, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 0, 0, 2), (2, 0, 1, 2), (1, 1, 0, 2)]


def test_bundles_pack_workers_or_spread_hosts():
    specs, strategy = bundles(num_workers=3, num_hosts=None, num_workers_per_host=1, cpus_per_worker=2,
                              gpus_per_worker=0)
    assert (specs, strategy) == ([{"CPU": 2}] * 3, "PACK")
    specs, strategy = bundles(num_workers=None, num_hosts=3, num_workers_per_host=2, cpus_per_worker=1,
                              gpus_per_worker=1)
    assert (specs, strategy) == ([{"CPU": 2, "GPU": 2}] * 3, "STRICT_SPREAD")


@pytest.mark.parametrize("kwargs, words", [
    ({}, "neither"),
    ({"num_workers": 2, "num_hosts": 2}, "both"),
    ({"num_workers": 0}, "num_workers=0"),
    ({"num_hosts": 2, "num_workers_per_host": 0}, "num_workers_per_host=0"),
    ({"num_workers": 2, "cpus_per_worker": 0}, "cpus_per_worker=0"),
    ({"num_workers": 2, "gpus_per_worker": 1}, "use_gpu=True"),
])
def test_bad_arguments_name_what_to_change(kwargs, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        RayExecutor(RayExecutor.create_settings(), **kwargs)


def test_settings_validate_and_keep_horovods_fields():
    s = RayExecutor.create_settings(timeout_s=12, placement_group_timeout_s=5, nics={"eth1", "eth0"},
                                    ssh_identity_file="/nonexistent")
    assert (s.timeout_s, s.placement_group_timeout_s, s.nics, s.network_interface) == (
        12, 5, ("eth0", "eth1"), "eth0,eth1")
    with pytest.raises(ConfigError, match="timeout_s=0"):
        RaySettings(timeout_s=0)
    with pytest.raises(ConfigError, match="placement_group_timeout_s=-1"):
        RaySettings(placement_group_timeout_s=-1)
    with pytest.raises(ConfigError, match="worker_niceness=20"):
        RaySettings(worker_niceness=20)
    assert RaySettings().worker_niceness == 0 and RaySettings(worker_niceness=None).worker_niceness is None


@pytest.mark.parametrize("name", [envvars.HORA_CONTROLLER, envvars.HOROVOD_CONTROLLER])
def test_asking_for_mpi_is_a_clear_error(name):
    with pytest.raises(ConfigError, match=f"{name}='mpi' in extra_env_vars.*Ray actors.*mpirun does not start them"):
        check_controller({name: "mpi"}, {})
    with pytest.raises(ConfigError, match="the driver's environment"):
        check_controller({}, {name: "MPI"})
    check_controller({name: "gloo"}, {})


def test_threads_follow_cpus_per_worker_unless_the_user_chose():
    settings = RaySettings(timeout_s=7)
    endpoints = Endpoints(addr="10.0.0.1", port=29500)
    env, notice = job_env(num_workers=2, local_size=2, endpoints=endpoints, settings=settings, cpus_per_worker=3,
                          extra_env_vars={}, driver_env={})
    assert env[envvars.OMP_NUM_THREADS] == "3" and "OMP_NUM_THREADS=3" in notice
    assert env[envvars.HORA_CONTROLLER] == "gloo" and env[envvars.HORA_START_TIMEOUT] == "7"
    env, notice = job_env(num_workers=2, local_size=2, endpoints=endpoints, settings=settings, cpus_per_worker=3,
                          extra_env_vars={}, driver_env={envvars.OMP_NUM_THREADS: "5"})
    assert env[envvars.OMP_NUM_THREADS] == "5" and notice is None
    env, notice = job_env(num_workers=2, local_size=2, endpoints=endpoints, settings=settings, cpus_per_worker=0.5,
                          extra_env_vars={envvars.OMP_NUM_THREADS: "2", "MY_VAR": "x"}, driver_env={})
    assert (env[envvars.OMP_NUM_THREADS], env["MY_VAR"], notice) == ("2", "x", None)


def test_every_job_gets_a_new_secret():
    kwargs = dict(num_workers=2, local_size=2, endpoints=Endpoints(addr="10.0.0.1", port=1), settings=RaySettings(),
                  cpus_per_worker=1, extra_env_vars={}, driver_env={})
    assert job_env(**kwargs)[0][envvars.HORA_SECRET] != job_env(**kwargs)[0][envvars.HORA_SECRET]


def test_an_actors_death_is_told_in_one_line():
    ray_says = ("The actor died unexpectedly before finishing this task.\n\tclass_name: Worker\n\tactor_id: ab12\n"
                "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
                "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes")
    assert death_cause(ray_says) == (
        "died: its worker process has died (Ray's worker exit type SYSTEM_ERROR); it was killed (a signal, the OOM "
        "killer), crashed, or lost its node")
    assert death_cause("The actor is dead because its node has died. Node Id: 3f").startswith("died: its node has died")


def test_the_worker_keeps_horovods_methods(monkeypatch):
    import socket

    from hora.ray import BaseHorovodWorker

    monkeypatch.setenv(envvars.HORA_RANK, "7")  # an outer job's rank must not survive configure()
    for name in ("HORA_TEST_VALUE", "HORA_TEST_OTHER"):  # the worker sets them here: undone after the test
        monkeypatch.setenv(name, "")
    worker = BaseHorovodWorker()
    worker.update_env_vars({"HORA_TEST_VALUE": 1123123})
    assert worker.env_vars()["HORA_TEST_VALUE"] == "1123123" and worker.hostname() == socket.gethostname()
    worker.configure({"HORA_TEST_OTHER": "x"})
    assert envvars.HORA_RANK not in worker.env_vars() and worker.env_vars()["HORA_TEST_OTHER"] == "x"
    worker.start_executable(dict, [], {"a": 1})
    assert worker.execute(lambda executable: executable["a"]) == 1
    assert worker.run(lambda x, y=0: x + y, [2], {"y": 3}) == 5
