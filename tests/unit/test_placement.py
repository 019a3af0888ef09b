"""The one placement record and the one rank planner (hora.placement), and hora run's environment fall-backs."""

from __future__ import annotations

import dataclasses

import pytest

from hora import envvars
from hora.config import RunDefaults
from hora.core.elastic.worker import Assignment
from hora.core.topology import Topology, detect
from hora.errors import ConfigError, TopologyError
from hora.placement import HostSlots, Placement, place_ranks
from hora.runner.launchers.base import Slot


def test_ranks_fill_hosts_in_order_and_are_consecutive_per_host():
    ranks = place_ranks([HostSlots("a", 2), HostSlots("b", 3), HostSlots("c", 4)], 4)
    assert [(p.rank, p.host, p.local_rank, p.local_size, p.cross_rank, p.cross_size) for p in ranks] == [
        (0, "a", 0, 2, 0, 2), (1, "a", 1, 2, 0, 2), (2, "b", 0, 2, 1, 2), (3, "b", 1, 2, 1, 2)]
    assert all(p.size == 4 for p in ranks)
    assert [p.host for p in place_ranks([HostSlots("a", 0), HostSlots("b", 1)], 1)] == ["b"]  # no slot, no rank


@pytest.mark.parametrize(("hosts", "num_proc", "message"), [
    ([HostSlots("a", 2)], 3, r"3 ranks do not fit in the 2 slots"),
    ([HostSlots("a", 2)], 0, r"cannot place 0 ranks"),
])
def test_planning_more_ranks_than_slots_is_an_error(hosts, num_proc, message):
    with pytest.raises(ConfigError, match=message):
        place_ranks(hosts, num_proc)


def test_a_placement_exports_what_a_worker_reads_back():
    for placed in place_ranks([HostSlots("node-a", 2), HostSlots("node-b", 1)], 3):
        env = placed.env()
        assert env[envvars.HOROVOD_PLACEMENT[0]] == str(placed.rank)  # horovodrun's copies beside hora's
        topology = detect(env)
        assert topology.launcher == "hora" and Placement(**{
            f.name: getattr(topology, f.name) for f in dataclasses.fields(Placement)}) == placed
    assert envvars.HORA_HOSTNAME not in place_ranks([HostSlots("a", 1)], 1)[0].env(host=False)


def test_one_record_under_the_launcher_the_worker_and_the_elastic_round():
    for cls in (Slot, Topology, Assignment):
        assert issubclass(cls, Placement)
        assert [f.name for f in dataclasses.fields(cls)][:7] == [f.name for f in dataclasses.fields(Placement)]
    placed = place_ranks([HostSlots("a", 2)], 2)[1]
    assert Slot.worker(placed).env() == placed.env()
    round_ = Assignment(**dataclasses.asdict(placed), round=3, store_addr="10.0.0.1", store_port=5000)
    assert round_.env()[envvars.HORA_ELASTIC_ROUND] == "3" and envvars.HORA_HOSTNAME not in round_.env()
    with pytest.raises(TopologyError, match=r"local_rank=2 is outside \[0, local_size=2\)"):
        Placement(rank=0, size=1, local_rank=2, local_size=2, cross_rank=0, cross_size=1, host="a")


def test_run_defaults_take_the_flag_then_the_environment_then_the_default():
    assert RunDefaults.from_env({}) == RunDefaults(num_servers=0, network_interface=None, elastic_timeout=600.0)
    env = {"DMLC_NUM_SERVER": "2", "DMLC_INTERFACE": "eth1", "HOROVOD_ELASTIC_TIMEOUT": "30"}
    assert RunDefaults.from_env(env) == RunDefaults(num_servers=2, network_interface="eth1", elastic_timeout=30.0)
    assert RunDefaults.from_env({**env, "HORA_ELASTIC_TIMEOUT": "40"}).elastic_timeout == 40.0
    given = RunDefaults.from_env({**env, "DMLC_NUM_SERVER": "x"}, num_servers=1, network_interface="lo",
                                 elastic_timeout=5.0)  # a flag given: its variable is not read
    assert given == RunDefaults(num_servers=1, network_interface="lo", elastic_timeout=5.0)
    with pytest.raises(ConfigError, match=r"DMLC_NUM_SERVER='x' is not a number of servers"):
        RunDefaults.from_env({"DMLC_NUM_SERVER": "x"})
    with pytest.raises(ConfigError, match=r"HOROVOD_ELASTIC_TIMEOUT='soon' is not a number of seconds"):
        RunDefaults.from_env({"HOROVOD_ELASTIC_TIMEOUT": "soon"})
