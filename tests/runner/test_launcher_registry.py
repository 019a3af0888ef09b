"""The launcher registry: every launcher's names, detection, capabilities, and its own refusals."""

from __future__ import annotations

import pytest

from hora.errors import ConfigError, LaunchError
from hora.placement import HostSlots
from hora.runner.cli import build_parser, config_from_args
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers import get_launcher, registry
from hora.runner.launchers.registry import (
    NEEDS,
    Capabilities,
    Launcher,
    Request,
    choose,
    launcher_class,
    launcher_help,
    launcher_names,
    launchers,
)

#: What each launcher declares it can serve (a launcher added in its own module adds its row here).
CAPABILITIES = {
    "local": dict(controllers=("gloo",), servers=True, elastic=True, sync_dst_dir=False, host_list=True,
                  remote_hosts=False, mpi_args=False),
    "ssh": dict(controllers=("gloo",), servers=True, elastic=True, sync_dst_dir=True, host_list=True,
                remote_hosts=True, mpi_args=False),
    "mpi": dict(controllers=("mpi",), servers=False, elastic=False, sync_dst_dir=False, host_list=True,
                remote_hosts=True, mpi_args=True),
    "slurm": dict(controllers=("gloo",), servers=False, elastic=False, sync_dst_dir=False, host_list=False,
                  remote_hosts=True, mpi_args=False),
    "sge": dict(controllers=("gloo",), servers=True, elastic=False, sync_dst_dir=False, host_list=False,
                remote_hosts=True, mpi_args=False),
}


@pytest.fixture
def srun_on_path(tmp_path):
    """An environment inside a Slurm allocation, with an ``srun`` on PATH."""
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    return {"SLURM_JOB_ID": "7", "PATH": str(tmp_path)}


def test_every_launcher_registers_from_its_own_module():
    found = {c.name: c for c in launchers()}
    assert set(CAPABILITIES) <= set(found)
    for name, cls in found.items():
        assert cls.__module__ == f"hora.runner.launchers.{name}", "a launcher lives in a module named after it"
        assert launcher_class(name) is cls and get_launcher(name).name == name
        assert isinstance(cls.capabilities, Capabilities) and cls.summary and cls.detects
    assert [c.priority for c in launchers()] == sorted(c.priority for c in launchers())  # detection order


def test_names_include_mxnet_launch_py_spellings():
    # MXNet's launch.py --launcher takes local, ssh, mpi, sge and yarn; hora's names are the same words
    names = launcher_names()
    assert {"local", "ssh", "mpi", "slurm", "sge"} <= set(names)
    assert "yarn" in names  # known, so the CLI accepts it and explains what to do instead
    with pytest.raises(ConfigError, match=r"no YARN launcher.*Spark on YARN with hora.spark"):
        launcher_class("yarn")
    with pytest.raises(ConfigError, match=r"hora.spark"):
        LaunchConfig(command=["python"], num_proc=2, launcher="yarn")
    args = build_parser().parse_args(["run", "-n", "2", "--launcher", "yarn", "python", "train.py"])  # launch.py's
    with pytest.raises(ConfigError, match=r"no YARN launcher"):
        config_from_args(args)
    with pytest.raises(ConfigError, match=r"--launcher 'k8s' is not one of local, mpi, .*ssh"):
        launcher_class("k8s")
    with pytest.raises(LaunchError, match="unknown launcher 'k8s'"):
        get_launcher("k8s")


@pytest.mark.parametrize("name", sorted(CAPABILITIES))
def test_declared_capabilities(name):
    assert launcher_class(name).capabilities == Capabilities(**CAPABILITIES[name])


@pytest.mark.parametrize("cls", launchers(), ids=lambda c: c.name)
def test_every_missing_capability_has_the_launchers_own_message(cls):
    for need in NEEDS:
        if need == "controller":
            lacks = set(cls.capabilities.controllers) != set(registry.CONTROLLERS)
        else:
            lacks = not getattr(cls.capabilities, need)
        if lacks:
            assert cls.refusals.get(need), f"{cls.name} lacks {need} but says nothing about it"


def test_detection_per_launcher(srun_on_path):
    remote = (HostSlots("localhost", 1), HostSlots("node7", 1))
    ssh, slurm, mpi, local = (launcher_class(n) for n in ("ssh", "slurm", "mpi", "local"))
    assert ssh.detect(Request(hosts=remote)) and not ssh.detect(Request(hosts=(HostSlots("127.0.0.1", 2),)))
    assert not ssh.detect(Request())
    assert slurm.detect(Request(environ=srun_on_path))
    assert not slurm.detect(Request(hosts=remote, environ=srun_on_path))  # an explicit host list is not srun's
    assert not slurm.detect(Request(environ={"SLURM_JOB_ID": "7", "PATH": "/nonexistent"}))  # no srun
    assert not slurm.detect(Request(environ={"PATH": srun_on_path["PATH"]}))  # srun, but no allocation
    assert mpi.detect(Request(controller="mpi", mpi=False))
    assert mpi.detect(Request(mpi=True)) and not mpi.detect(Request(mpi=False))
    assert not mpi.detect(Request(controller="gloo", mpi=True)) and not mpi.detect(Request(servers=1, mpi=True))
    assert local.detect(Request())


def test_choice_follows_priority_and_what_was_asked(srun_on_path):
    remote = (HostSlots("node7", 2),)
    assert choose(Request(hosts=remote, environ=srun_on_path, mpi=True)).name == "ssh"
    assert choose(Request(environ=srun_on_path, mpi=True)).name == "slurm"
    assert choose(Request(controller="mpi", hosts=remote)).name == "mpi"  # only mpirun runs the MPI controller
    # elastic jobs go to a launcher that runs them, even inside an allocation
    assert choose(Request(environ=srun_on_path, elastic=True, mpi=True)).name == "local"
    assert choose(Request(hosts=remote, environ=srun_on_path, elastic=True)).name == "ssh"
    # ... unless the controller asked for leaves none: then that launcher refuses in its own words
    assert choose(Request(controller="mpi", elastic=True)).name == "mpi"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # -s under a launcher without servers: that launcher's message
        (dict(launcher="mpi", num_servers=1), r"-s 1: parameter servers are started by the local.* and ssh "
                                              r"launchers, not by --launcher mpi"),
        (dict(launcher="slurm", num_servers=2), r"-s 2: .*not by --launcher slurm"),
        # elastic under MPI and under Slurm, each in its own words
        (dict(launcher="mpi", min_np=1), r"runs on gloo, because MPI's world is fixed"),
        (dict(controller="mpi", max_np=4), r"runs on gloo, because MPI's world is fixed"),
        (dict(launcher="slurm", min_np=1), r"an srun job step's tasks are fixed; drop --launcher slurm"),
        (dict(launcher="slurm", hosts="a:2"), r"--launcher slurm takes its hosts from the Slurm allocation"),
        (dict(launcher="sge", min_np=1), r"a grid-engine job's hosts are fixed when it starts"),
        (dict(launcher="sge", hosts="a:2"), r"--launcher sge takes its hosts from the grid engine's \$PE_HOSTFILE"),
        (dict(launcher="sge", sync_dst_dir="/tmp/x"), r"it needs the ssh launcher, not --launcher sge"),
        (dict(launcher="local", hosts="localhost:1,far:1"), r"--launcher local only starts processes on this "
                                                            r"machine, but the hosts include 'far'"),
        (dict(launcher="local", sync_dst_dir="/tmp/x"), r"it needs the ssh launcher, not --launcher local"),
        (dict(launcher="ssh", controller="mpi"), r"--mpi needs the mpi launcher .*not --launcher ssh"),
        (dict(launcher="mpi", controller="gloo"), r"--launcher mpi runs the MPI controller; drop --gloo"),
        (dict(launcher="local", mpi_args=["-v"]), r"mpi_args only apply to the mpi launcher"),
    ],
)
def test_a_launcher_refuses_what_it_cannot_serve(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(command=["python"], num_proc=2, **kwargs)


def test_a_new_launcher_is_one_class(monkeypatch, srun_on_path):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    class BatchLauncher(Launcher):
        name = "batch"
        aliases = ("qbatch",)
        summary = "a test batch system"
        detects = "inside a test batch job"
        priority = 20
        capabilities = Capabilities(host_list=False, elastic=True, sync_dst_dir=True, mpi_args=True,
                                    servers=True, controllers=("gloo", "mpi"))
        refusals = {"host_list": "--launcher batch takes its hosts from the batch job; drop -H"}

        @classmethod
        def detect(cls, request: Request) -> bool:
            return request.environ.get("BATCH_JOB") == "1"

    assert launcher_class("qbatch") is BatchLauncher and "qbatch" in launcher_names()
    assert "batch (a test batch system)" in launcher_help()
    assert choose(Request(environ={"BATCH_JOB": "1"}, mpi=False)) is BatchLauncher
    config = LaunchConfig(command=["python"], num_proc=2, launcher="qbatch")
    assert (config.launcher, config.controller) == ("batch", "gloo")  # an alias resolves to the name
    with pytest.raises(ConfigError, match="the batch and ssh launchers"):  # a listing counts the newcomer
        LaunchConfig(command=["python"], num_proc=2, launcher="local", sync_dst_dir="/tmp/x")

    with pytest.raises(TypeError, match=r"must declare its refusal for \['servers'"):
        class Incomplete(Launcher):  # lacks servers and says nothing about it
            name = "incomplete"
            capabilities = Capabilities(elastic=True, sync_dst_dir=True, mpi_args=True, controllers=("gloo", "mpi"))

    with pytest.raises(TypeError, match="declared by both"):
        class Twin(Launcher):
            name = "batch"
            capabilities = BatchLauncher.capabilities
            refusals = BatchLauncher.refusals
