"""The launcher: ``hora run`` and ``hora.run(fn)``.

Both build a :class:`LaunchConfig` and call :func:`launch`; the environment
contract between the launcher and the workers is :mod:`hora.envvars`
(filled in by :mod:`hora.runner.env`).
"""

from __future__ import annotations

from hora.placement import HostSlots
from hora.runner.launch import launch, run_job
from hora.runner.launch_config import LaunchConfig

__all__ = ["HostSlots", "LaunchConfig", "launch", "run_job"]
