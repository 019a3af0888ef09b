"""`hora.run(fn, ...)`: the Python API over the same launch path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import hora
from hora.errors import ConfigError, UnsupportedError, WorkerFailedError


def rank_from_env(scale: int = 1, offset: int = 0) -> int:
    rank = os.environ.get("HORA_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    return int(rank) * scale + offset


@pytest.mark.timeout(60)
def test_run_returns_results_ordered_by_rank():
    assert hora.run(rank_from_env, np=2) == [0, 1]
    assert hora.run(rank_from_env, args=(10,), kwargs={"offset": 1}, np=3) == [1, 11, 21]


@pytest.mark.timeout(60)
def test_run_pickles_closures_by_value(capfd):
    payload = {"greeting": "hi"}

    def task():
        print("printed by", rank_from_env())
        return payload["greeting"] + str(rank_from_env())

    assert hora.run(task, np=2) == ["hi0", "hi1"]
    out = capfd.readouterr().out
    assert "[0]<stdout>:printed by 0" in out and "[1]<stdout>:printed by 1" in out


def fail_on_rank_one():
    if rank_from_env() == 1:
        raise ValueError("rank one refuses")
    import time

    time.sleep(60)


@pytest.mark.timeout(60)
def test_raising_function_raises_worker_failed_error():
    with pytest.raises(WorkerFailedError) as info:
        hora.run(fail_on_rank_one, np=2)
    error = info.value
    assert (error.rank, error.exitcode) == (1, 1)
    assert isinstance(error.__cause__, ValueError) and str(error.__cause__) == "rank one refuses"
    assert "ValueError: rank one refuses" in error.stderr_tail


@pytest.mark.timeout(60)
def test_run_under_mpi():
    pytest.importorskip("mpi4py")

    def allreduce():
        from mpi4py import MPI

        return MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.rank + 1)

    assert hora.run(allreduce, np=2, use_mpi=True) == [3, 3]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(min_np=1), UnsupportedError, "elastic training is not available yet"),
        (dict(reset_limit=2), UnsupportedError, "elastic training is not available yet"),
        (dict(slots=2), UnsupportedError, "hosts='localhost:2'"),
        (dict(use_gloo=True, use_mpi=True), ConfigError, "contradict each other"),
        (dict(use_mpi=True, controller="gloo"), ConfigError, "contradicts use_mpi=True"),
        (dict(np=0), ConfigError, "-np 0 must be at least 1"),
        (dict(np=3, hosts="localhost:2"), ConfigError, "more than the 2 slots"),
    ],
)
def test_run_rejects_unsupported_or_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        hora.run(rank_from_env, **kwargs)


def test_import_hora_stays_light():
    code = "import sys, hora; print(hora.__version__, 'hora.runner' in sys.modules, callable(hora.run))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.split() == [hora.__version__, "False", "True"]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hora.nope  # noqa: B018


def test_the_version_lives_in_hora_init_only():
    """The installed metadata and ``hora --version`` both read ``hora.__version__``."""
    import importlib.metadata

    assert importlib.metadata.version("hora") == hora.__version__
    for module in ("hora.cli", "hora.runner.cli"):
        out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True,
                             timeout=60, check=True)
        assert out.stdout.strip() == f"hora {hora.__version__}"
