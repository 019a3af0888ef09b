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
