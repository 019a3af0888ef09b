"""Topology detection from each launcher's environment, and knob parsing."""

from __future__ import annotations

import pytest

from hora.config import EngineConfig, RendezvousConfig
from hora.core.topology import detect
from hora.errors import ConfigError, TopologyError


def test_hora_launcher_env():
    t = detect({"HORA_RANK": "3", "HORA_SIZE": "4", "HORA_LOCAL_RANK": "1", "HORA_LOCAL_SIZE": "2",
                "HORA_CROSS_RANK": "1", "HORA_CROSS_SIZE": "2", "HORA_HOSTNAME": "h2"})
    assert (t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size) == (3, 4, 1, 2, 1, 2)
    assert t.host == "h2" and t.launcher == "hora"


def test_openmpi_env():
    t = detect({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1"})
    assert (t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size) == (5, 8, 1, 4, 1, 2)
    assert t.started_by_mpi


def test_mpich_env():
    t = detect({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"})
    assert (t.rank, t.local_size, t.cross_size, t.cross_rank) == (2, 2, 2, 1)


def test_torchrun_env():
    t = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"})
    assert (t.rank, t.local_rank, t.cross_rank, t.cross_size, t.launcher) == (3, 1, 1, 2, "torchrun")


def test_slurm_env_with_compressed_tasks_per_node():
    t = detect({"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
                "SLURM_TASKS_PER_NODE": "2(x2),1"})
    assert (t.rank, t.size, t.local_size, t.cross_rank) == (4, 5, 1, 2)


def test_no_launcher_is_single_process():
    t = detect({})
    assert (t.rank, t.size, t.launcher) == (0, 1, "single")


@pytest.mark.parametrize("env", [
    {"HORA_RANK": "2", "HORA_SIZE": "2"},
    {"HORA_RANK": "x", "HORA_SIZE": "2"},
])
def test_bad_topology_is_a_clear_error(env):
    with pytest.raises(TopologyError, match="HORA_RANK|rank"):
        detect(env)


def test_engine_config_env_and_horovod_names():
    cfg = EngineConfig.from_env({"HOROVOD_FUSION_THRESHOLD": "1048576", "HORA_CYCLE_TIME": "2.5",
                                 "HOROVOD_STALL_CHECK_DISABLE": "1", "HORA_CONTROLLER": "MPI"})
    assert cfg.fusion_threshold_bytes == 1 << 20 and cfg.cycle_time_ms == 2.5
    assert cfg.stall_check_seconds == 0 and cfg.controller == "mpi"


@pytest.mark.parametrize(("env", "message"), [
    ({"HORA_CONTROLLER": "tcp"}, "controller"),
    ({"HORA_CYCLE_TIME": "fast"}, "HORA_CYCLE_TIME"),
    ({"HORA_STALL_CHECK_TIME_SECONDS": "60", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "10"}, "stall shutdown"),
])
def test_engine_config_errors_name_the_knob(env, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_env(env)


def test_rendezvous_gloo_devices():
    assert RendezvousConfig.from_env({}).gloo_devices == 4
    rdv = RendezvousConfig.from_env({"HORA_GLOO_DEVICES": "2", "GLOO_SOCKET_IFNAME": "eth0,eth1"})
    assert (rdv.gloo_devices, rdv.interface) == (2, "eth0,eth1")
    with pytest.raises(ConfigError, match="HORA_GLOO_DEVICES=0 must be at least 1"):
        RendezvousConfig.from_env({"HORA_GLOO_DEVICES": "0"})
    with pytest.raises(ConfigError, match="HORA_GLOO_DEVICES='many' is not an integer"):
        RendezvousConfig.from_env({"HORA_GLOO_DEVICES": "many"})


def test_rendezvous_from_torchrun_uses_agent_store():
    rdv = RendezvousConfig.from_env({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                                     "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (rdv.addr, rdv.port, rdv.host_store) == ("10.0.0.1", 29500, False)
