"""Launchers: how the workers of a job get started.

A launcher implements :class:`hora.runner.launchers.base.Launcher`.  The
``local`` one runs every rank as a child of ``hora run``; the ``mpi`` one
hands the job to mpirun.  ``ssh`` and ``slurm`` are planned.
"""

from __future__ import annotations

from hora.errors import LaunchError
from hora.runner.config import PLANNED_LAUNCHERS
from hora.runner.launchers.base import Launcher


def get_launcher(name: str) -> Launcher:
    """The launcher called ``name``.

    Raises:
        LaunchError: the launcher does not exist or is not available yet.
    """
    if name == "local":
        from hora.runner.launchers.local import LocalLauncher

        return LocalLauncher()
    if name == "mpi":
        from hora.runner.launchers.mpi import MpiLauncher

        return MpiLauncher()
    if name in PLANNED_LAUNCHERS:
        raise LaunchError(
            f"the {name} launcher is not available yet (a later release adds it); "
            "for now run on this machine with --launcher local or --mpi"
        )
    raise LaunchError(f"unknown launcher {name!r}")
