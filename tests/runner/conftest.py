"""Fixtures for the launcher tests: run ``hora`` as a real subprocess."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def hora_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher's environment: ours, minus variables that would change what the tests see."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "OMPI_", "PMIX_", "DMLC_", "SLURM_"))}
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra or {})
    return env


@pytest.fixture
def clean_env() -> Callable[..., dict[str, str]]:
    """:func:`hora_env`, for tests that start processes themselves."""
    return hora_env


@pytest.fixture
def scripts() -> Path:
    """The directory of the worker scripts used by the tests."""
    return SCRIPTS


@pytest.fixture
def hora_cli() -> Callable[..., subprocess.CompletedProcess]:
    """Run ``python -m hora.runner.cli ARGS`` and return the finished process (text output)."""

    def run(*args: str, env: Mapping[str, str] | None = None, timeout: float = 45) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "hora.runner.cli", *args],
            env=hora_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


class RunningLauncher:
    """A ``hora run`` started in the background, with its stdout lines collected by a thread."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hora.runner.cli", "run", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=hora_env(),
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._lines.put(line)

    def wait_for(self, text: str, count: int, timeout: float = 30) -> None:
        """Block until ``count`` stdout lines containing ``text`` were printed."""
        seen, deadline = 0, time.monotonic() + timeout
        while seen < count:
            line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            self.stdout.append(line)
            seen += text in line

    def finish(self, timeout: float = 30) -> str:
        """Wait for the launcher to exit; return its stderr (stdout lines land in ``self.stdout``)."""
        stderr = self.proc.stderr.read()  # type: ignore[union-attr]
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout)
        while not self._lines.empty():
            self.stdout.append(self._lines.get())
        return stderr


@pytest.fixture
def launcher_bg():
    """Start ``hora run ARGS`` in the background; kills it at the end of the test if still running."""
    started: list[RunningLauncher] = []

    def start(*args: str) -> RunningLauncher:
        started.append(RunningLauncher(list(args)))
        return started[-1]

    yield start
    for launcher in started:
        if launcher.proc.poll() is None:
            launcher.proc.kill()
            launcher.proc.wait()
