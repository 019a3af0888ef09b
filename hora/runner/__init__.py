"""The launcher: ``hora run`` and ``hora.run(fn)``.

Both build a :class:`LaunchConfig` and call :func:`launch`; the environment
contract between the launcher and the workers is :mod:`hora.envvars`
(filled in by :mod:`hora.runner.env`).
"""

from __future__ import annotations

from hora.runner.config import HostSlots, LaunchConfig
from hora.runner.launch import launch, run_job

__all__ = ["HostSlots", "LaunchConfig", "launch", "run_job"]
