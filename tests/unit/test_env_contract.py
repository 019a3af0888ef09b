"""The launcher/worker contract: what each launcher sets for a worker is exactly what the worker side reads.

Each test builds one launcher's environment for every process of a job the
way that launcher does (local, ssh through the per-host agent, mpirun's
``-x`` exports, srun's ``--export=ALL``), adds what the tool itself would
set (Open MPI's or Slurm's rank variables), and reads it back with
:func:`hora.core.topology.detect` and the ``from_env`` of every config.
A recording mapping notes every name the worker side looks at, so a
``HORA_*`` variable that a launcher sets and no worker reads fails too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import pytest

from hora import envvars
from hora.config import EngineConfig, MiB, PSConfig, RendezvousConfig
from hora.core import topology
from hora.placement import HostSlots, place_ranks
from hora.ray import plan as ray_plan
from hora.runner import agent
from hora.runner.env import Endpoints, build_env
from hora.runner.keys import SERVER, WORKER
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import Slot
from hora.runner.launchers.mpi import mpirun_command
from hora.runner.launchers.slurm import srun_command
from hora.runner.launchers.ssh import host_env
from hora.runner.plan import plan_slots
from hora.spark import plan as spark_plan

ENDPOINTS = Endpoints(addr="10.0.0.1", port=29500, ps_port=29501)
BASE = {"PATH": os.environ.get("PATH", "/usr/bin"), "OMP_NUM_THREADS": "1"}


class Recording(dict):
    """A dict that remembers every name looked up in it."""

    def __init__(self, values: Mapping[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def __contains__(self, name):
        self.read.add(name)
        return super().__contains__(name)

    def get(self, name, default=None):
        self.read.add(name)
        return super().get(name, default)


class Worker:
    """What the worker side makes of one process's environment."""

    def __init__(self, env: Mapping[str, str]) -> None:
        recording = Recording(env)
        self.topology = topology.detect(recording)
        self.engine = EngineConfig.from_env(recording)
        self.rendezvous = RendezvousConfig.from_env(recording)
        self.ps = PSConfig.from_env(recording)
        self.read = recording.read
        self.env = dict(env)

    def placement(self) -> tuple[int, ...]:
        t = self.topology
        return (t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size)

    def assert_reads_every_hora_variable(self) -> None:
        unread = sorted(n for n in self.env if n.startswith("HORA_") and n not in self.read)
        assert not unread, f"set by the launcher, read by no worker: {unread}"


def placement(slot: Slot) -> tuple[int, ...]:
    return (slot.rank, slot.size, slot.local_rank, slot.local_size, slot.cross_rank, slot.cross_size)


def job_env(config: LaunchConfig, local_size: int) -> dict[str, str]:
    env, _ = build_env(config, local_size=local_size, base=BASE, endpoints=ENDPOINTS)
    return env


def command() -> list[str]:
    return [sys.executable, "-c", "pass"]


@pytest.fixture
def clean_environ(monkeypatch):
    """No launcher variables of an outer job in this process (the ssh agent starts from os.environ)."""
    prefixes = ("HORA_", "HOROVOD_", "DMLC_", "OMPI_", "PMI", "SLURM_", "GLOO_", "MASTER_")
    for name in list(os.environ):
        if name.startswith(prefixes):
            monkeypatch.delenv(name)


def test_local_workers_read_their_place_and_the_job(clean_environ):
    config = LaunchConfig(command=command(), num_proc=3, launcher="local", controller="gloo",
                          fusion_threshold_mb=32, cycle_time_ms=2.5, timeline_filename="/tmp/t.json",
                          start_timeout=12, network_interface="eth7")
    env = job_env(config, local_size=3)
    assert set(envvars.WORKER_ENV) - set(envvars.WORKER_PLACEMENT) <= set(env)
    slots = plan_slots(config)
    assert [s.rank for s in slots] == [0, 1, 2]
    for slot in slots:
        worker = Worker({**env, **slot.env()})
        assert set(envvars.WORKER_ENV) <= set(worker.env)
        assert worker.placement() == placement(slot) == (slot.rank, 3, slot.rank, 3, 0, 1)
        assert worker.topology.launcher == "hora" and worker.topology.host == slot.host
        assert (worker.rendezvous.addr, worker.rendezvous.port) == ("10.0.0.1", 29500)
        assert worker.rendezvous.secret == env[envvars.HORA_SECRET] and len(worker.rendezvous.secret) == 32
        assert worker.rendezvous.interface == "eth7" and worker.ps.interface == "eth7"
        assert worker.engine.controller == "gloo"
        assert worker.engine.fusion_threshold_bytes == 32 * MiB
        assert worker.engine.cycle_time_ms == 2.5
        assert worker.engine.timeline_filename == "/tmp/t.json"
        assert worker.engine.start_timeout_seconds == 12
        assert worker.ps.worker_rank == slot.rank and worker.ps.num_workers == 3
        for hora, horovod in zip(envvars.WORKER_PLACEMENT, envvars.HOROVOD_PLACEMENT, strict=True):
            assert worker.env[horovod] == worker.env[hora]
        worker.assert_reads_every_hora_variable()


def test_ssh_workers_on_two_hosts_get_their_cross_rank_through_the_agent(clean_environ, tmp_path):
    hosts = (HostSlots("node-a.test", 2), HostSlots("node-b.test", 2))
    config = LaunchConfig(command=command(), num_proc=4, hosts=hosts, launcher="ssh", num_servers=2,
                          network_interface="eth7")
    env = job_env(config, local_size=2)
    slots = plan_slots(config)
    addrs = {"node-a.test": "10.0.0.1", "node-b.test": "10.0.0.2"}
    seen = []
    for host in addrs:
        common = host_env(env, config, local=False, node_host=addrs[host])
        mine = [s for s in slots if s.host == host]
        spec = {"cwd": str(tmp_path), "env": common,
                "processes": [{"key": str(s.key), "argv": command(), "env": s.env()} for s in mine]}
        for slot, (_, _, process_env, _) in zip(mine, agent.Agent().prepare(spec), strict=True):
            worker = Worker(process_env)
            assert worker.ps.node_host == addrs[host]
            assert worker.ps.role == slot.role
            assert (worker.ps.root_uri, worker.ps.root_port) == ("10.0.0.1", 29501)
            assert (worker.ps.num_servers, worker.ps.num_workers) == (2, 4)
            assert worker.ps.secret == env[envvars.HORA_SECRET]
            if slot.role == WORKER:
                assert set(envvars.WORKER_ENV) <= set(process_env)
                assert worker.placement() == placement(slot)
                assert worker.topology.host == host
                assert worker.ps.worker_rank == slot.rank
                seen.append(worker.placement())
            elif slot.role == SERVER:
                assert worker.ps.server_index == slot.rank
            worker.assert_reads_every_hora_variable()
    assert sorted(seen) == [(0, 4, 0, 2, 0, 2), (1, 4, 1, 2, 0, 2), (2, 4, 0, 2, 1, 2), (3, 4, 1, 2, 1, 2)]


def test_sge_workers_get_the_whole_job_environment_through_the_agent_and_keep_their_hosts_own(
        clean_environ, tmp_path, monkeypatch):
    from hora.runner.launchers.sge import HOST_SPECIFIC, SgeLauncher

    pe_hostfile = tmp_path / "pe_hostfile"
    pe_hostfile.write_text("node-b.test 2 all.q@node-b.test UNDEFINED\nnode-a.test 2 all.q@node-a.test UNDEFINED\n")
    monkeypatch.setenv(envvars.PE_HOSTFILE, str(pe_hostfile))
    monkeypatch.setenv(envvars.JOB_ID, "7")
    config = LaunchConfig(command=command(), num_proc=3, launcher="sge", num_servers=1)
    env = job_env(config, local_size=2)
    env.update(TMPDIR="/tmp/7.1.all.q", MY_SETTING="a,b")  # the job script's own environment
    slots = plan_slots(config)
    addrs = {"node-b.test": "10.0.0.2", "node-a.test": "10.0.0.1"}
    seen = []
    for host in addrs:
        given = {k: v for k, v in env.items() if k not in HOST_SPECIFIC}  # what SgeLauncher.run sends
        common = host_env(given, config, local=SgeLauncher.forward_all, node_host=addrs[host])
        assert common["MY_SETTING"] == "a,b" and "TMPDIR" not in common
        mine = [s for s in slots if s.host == host]
        spec = {"cwd": str(tmp_path), "env": common,
                "processes": [{"key": str(s.key), "argv": command(), "env": s.env()} for s in mine]}
        for slot, (_, _, process_env, _) in zip(mine, agent.Agent().prepare(spec), strict=True):
            worker = Worker(process_env)
            assert worker.ps.node_host == addrs[host] and worker.ps.role == slot.role
            assert (worker.ps.num_servers, worker.ps.num_workers) == (1, 3)
            if slot.role == WORKER:
                assert set(envvars.WORKER_ENV) <= set(process_env)
                assert worker.placement() == placement(slot)
                assert worker.topology.host == host
                seen.append(worker.placement())
            worker.assert_reads_every_hora_variable()
    assert sorted(seen) == [(0, 3, 0, 2, 0, 2), (1, 3, 1, 2, 0, 2), (2, 3, 0, 1, 1, 2)]


def _exported(argv: list[str], flavour: str) -> list[str]:
    if flavour == "mpich":
        return argv[argv.index("-genvlist") + 1].split(",")
    return [argv[i + 1] for i, word in enumerate(argv) if word == "-x"]


@pytest.mark.parametrize("flavour", ["openmpi", "mpich"])
def test_mpirun_exports_the_job_and_its_rank_variables_place_the_ranks(flavour):
    hosts = (HostSlots("node-a.test", 2), HostSlots("node-b.test", 2))
    config = LaunchConfig(command=command(), num_proc=4, hosts=hosts, launcher="mpi", controller="mpi",
                          cycle_time_ms=3)
    env = job_env(config, local_size=2)
    argv = mpirun_command(config, 4, env, "/usr/bin/mpirun", hosts=[(h.host, h.slots) for h in hosts],
                          flavour=flavour)
    exported = _exported(argv, flavour)
    assert set(envvars.JOB) <= set(exported)
    assert not set(exported) & set(envvars.WORKER_PLACEMENT + envvars.HOROVOD_PLACEMENT)  # mpirun places the ranks
    for slot in place_ranks(hosts, 4):
        if flavour == "mpich":
            tool = {envvars.PMI_RANK: slot.rank, envvars.PMI_SIZE: 4,
                    envvars.MPI_LOCALRANKID: slot.local_rank, envvars.MPI_LOCALNRANKS: 2}
        else:
            tool = {envvars.OMPI_COMM_WORLD_RANK: slot.rank, envvars.OMPI_COMM_WORLD_SIZE: 4,
                    envvars.OMPI_COMM_WORLD_LOCAL_RANK: slot.local_rank, envvars.OMPI_COMM_WORLD_LOCAL_SIZE: 2,
                    envvars.OMPI_COMM_WORLD_NODE_RANK: slot.cross_rank}
        worker = Worker({**{name: env[name] for name in exported}, **{k: str(v) for k, v in tool.items()}})
        assert worker.placement() == placement(slot)
        assert worker.topology.launcher == "mpi"
        assert worker.engine.controller == "mpi" and worker.engine.cycle_time_ms == 3
        assert worker.rendezvous.secret == env[envvars.HORA_SECRET]
        worker.assert_reads_every_hora_variable()


def test_srun_exports_everything_and_slurm_variables_place_the_ranks():
    hosts = (HostSlots("node-a", 2), HostSlots("node-b", 2))
    config = LaunchConfig(command=command(), num_proc=4, launcher="slurm", controller="gloo")
    env = job_env(config, local_size=2)
    assert "--export=ALL" in srun_command(config, "/usr/bin/srun")
    assert set(envvars.JOB) <= set(env)
    for slot in place_ranks(hosts, 4):
        tool = {envvars.SLURM_PROCID: slot.rank, envvars.SLURM_NTASKS: 4, envvars.SLURM_LOCALID: slot.local_rank,
                envvars.SLURM_NODEID: slot.cross_rank, envvars.SLURM_TASKS_PER_NODE: "2(x2)"}
        worker = Worker({**env, **{k: str(v) for k, v in tool.items()}})
        assert worker.placement() == placement(slot)
        assert worker.topology.launcher == "slurm"
        assert (worker.rendezvous.addr, worker.rendezvous.port) == ("10.0.0.1", 29500)
        worker.assert_reads_every_hora_variable()


def _check_gloo_actor(worker: Worker, slot: Slot, host: str, at: tuple[str, int], secret: str) -> None:
    """A rank of hora.ray or hora.spark (set up with eth7, a 12 s start timeout and 2 threads) reads its job."""
    assert set(envvars.WORKER_ENV) <= set(worker.env)
    assert worker.placement() == placement(slot)
    assert worker.topology.launcher == "hora" and worker.topology.host == host
    assert (worker.rendezvous.addr, worker.rendezvous.port) == at
    assert worker.rendezvous.secret == secret and worker.rendezvous.interface == "eth7"
    assert worker.engine.controller == "gloo" and worker.engine.start_timeout_seconds == 12
    assert worker.env[envvars.OMP_NUM_THREADS] == "2"
    worker.assert_reads_every_hora_variable()


def test_ray_actors_read_their_place_and_the_job():
    """hora.ray: ranks from where Ray placed the actors (two nodes, created interleaved), the job's env as gloo."""
    infos = [ray_plan.ActorInfo(node_id=node, node_ip=ip, hostname=node, pid=1)
             for _ in range(2) for node, ip in (("n2", "10.0.0.2"), ("n1", "10.0.0.1"))]
    slots = ray_plan.assign(infos)
    env, _ = ray_plan.job_env(num_workers=4, local_size=2, endpoints=Endpoints(addr="10.0.0.1", port=29500),
                         settings=ray_plan.RaySettings(timeout_s=12, nics=("eth7",)), cpus_per_worker=2,
                         extra_env_vars={}, driver_env={})
    seen = []
    for info, slot in zip(infos, slots, strict=True):
        worker = Worker({**env, **slot.env()})
        _check_gloo_actor(worker, slot, info.node_ip, ("10.0.0.1", 29500), env[envvars.HORA_SECRET])
        seen.append((info.node_ip, *worker.placement()))
    assert sorted(seen) == [("10.0.0.1", 0, 4, 0, 2, 0, 2), ("10.0.0.1", 1, 4, 1, 2, 0, 2),
                            ("10.0.0.2", 2, 4, 0, 2, 1, 2), ("10.0.0.2", 3, 4, 1, 2, 1, 2)]


def test_spark_tasks_read_their_place_and_the_job():
    """hora.spark: ranks from the barrier tasks' reports (two hosts, partitions interleaved), rank 0's task's
    address as the rendezvous, the job's env as gloo, built once on the driver."""
    infos = [spark_plan.TaskInfo(partition=p, host=host, addr=host, port=29500 + p)
             for p, host in enumerate(("10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.1"))]
    slots = spark_plan.plan_ranks(infos)
    job = spark_plan.job_env(num_proc=4, start_timeout=12, nics=("eth7",), env={"OMP_NUM_THREADS": "2"})
    at = spark_plan.rendezvous(infos, slots)
    assert at == ("10.0.0.1", 29501)
    seen = []
    for info, slot in zip(infos, slots, strict=True):
        worker = Worker({**BASE, **spark_plan.rank_env(job, slot, at, None)})
        _check_gloo_actor(worker, slot, info.host, at, job[envvars.HORA_SECRET])
        seen.append((info.host, *worker.placement()))
    assert sorted(seen) == [("10.0.0.1", 0, 4, 0, 2, 0, 2), ("10.0.0.1", 1, 4, 1, 2, 0, 2),
                            ("10.0.0.2", 2, 4, 0, 2, 1, 2), ("10.0.0.2", 3, 4, 1, 2, 1, 2)]


def test_a_nested_launch_does_not_inherit_the_outer_jobs_place():
    outer = {**BASE, **Slot(rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2,
                            host="node-b").env(),
             envvars.DMLC_ROLE: "server", envvars.DMLC_NUM_SERVER: "3"}
    config = LaunchConfig(command=command(), num_proc=2, launcher="local", controller="gloo")
    env, _ = build_env(config, local_size=2, base=outer, endpoints=ENDPOINTS)
    assert not set(env) & set(envvars.WORKER_PLACEMENT + envvars.HOROVOD_PLACEMENT + envvars.PS_JOB)
    worker = Worker({**env, **plan_slots(config)[1].env()})
    assert worker.placement() == (1, 2, 1, 2, 0, 1)
    assert worker.ps.role == "worker" and worker.ps.num_servers is None


def test_every_name_is_spelled_as_its_constant():
    names = {k: v for k, v in vars(envvars).items() if k.isupper() and isinstance(v, str)}
    assert all(v == k for k, v in names.items() if not k.startswith("TORCHRUN_")), names
    for name in ("GLOO_SOCKET_IFNAME", "HORA_NETWORK_INTERFACE", "HORA_RENDEZVOUS_ADDR"):
        assert getattr(agent, name) == getattr(envvars, name)  # the agent's copies (it runs without hora)
