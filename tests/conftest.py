"""Shared helpers: launching real multi-process jobs through `hora run`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment without launcher variables that would confuse a nested job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "OMPI_", "PMIX_", "PMI_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    # A test whose ranks diverge must fail, not hang: give up on stalled collectives quickly.
    env["HORA_STALL_CHECK_TIME_SECONDS"] = "10"
    env["HORA_STALL_SHUTDOWN_TIME_SECONDS"] = "30"
    env.update(extra or {})
    return env


def hora_run(
    np: int,
    command: Sequence[str],
    *,
    mpi: bool = False,
    timeout: float = 240,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Run ``hora run -np N [--mpi] COMMAND`` and return the finished process.

    The timeout is the guard against hangs: a job that hangs fails the test.
    """
    args = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np), "--mpi" if mpi else "--gloo",
            *extra_args, *command]
    return subprocess.run(args, env=job_env(env), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def run_job():
    return hora_run


#: tests/scripts/compression_checkpoint.py: one stateful-compression checkpoint script for every binding.
COMPRESSION_CHECKPOINT = ROOT / "tests" / "scripts" / "compression_checkpoint.py"


def checkpoint_resumes(directory: Path, np: int, save_at: int = 3, atol: float = 0.0) -> None:
    """Assert what tests/scripts/compression_checkpoint.py left in ``directory`` after a full and a resumed run.

    Every rank's resumed weights equal its uninterrupted ones (within
    ``atol``; 0 is bit for bit), every rank ends where rank 0 does, and the
    checkpoint held the compressor's state as of step ``save_at``.
    """
    import numpy

    first = numpy.load(directory / "full.0.npz")
    for rank in range(np):
        full, resumed = numpy.load(directory / f"full.{rank}.npz"), numpy.load(directory / f"resume.{rank}.npz")
        for key in full.files:
            gap = float(numpy.abs(full[key] - resumed[key]).max())
            assert gap <= atol, f"rank {rank}: the resumed run left the uninterrupted one ({key}: {gap} > {atol})"
            assert numpy.array_equal(full[key], first[key]), f"rank {rank} differs from rank 0 ({key})"
        assert (directory / f"saved-step.{rank}.txt").read_text() == str(save_at), "the checkpoint lacks the state"
