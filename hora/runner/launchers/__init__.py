"""Launchers: how the processes of a job get started.

A launcher implements :class:`hora.runner.launchers.base.Launcher`.  The
``local`` one runs every process as a child of ``hora run``; ``ssh`` reaches
other hosts over ssh (and runs this machine's share locally); ``mpi`` hands
the job to mpirun; ``slurm`` starts the ranks with srun inside an allocation;
``sge`` starts them with ``qrsh -inherit`` inside a grid-engine parallel job.
"""

from __future__ import annotations

from hora.errors import LaunchError
from hora.runner.launchers.base import Launcher


def get_launcher(name: str) -> Launcher:
    """A new launcher called ``name`` (one per job: a launcher keeps the job's connections).

    Raises:
        LaunchError: the launcher does not exist.
    """
    if name == "local":
        from hora.runner.launchers.local import LocalLauncher

        return LocalLauncher()
    if name == "ssh":
        from hora.runner.launchers.ssh import SshLauncher

        return SshLauncher()
    if name == "mpi":
        from hora.runner.launchers.mpi import MpiLauncher

        return MpiLauncher()
    if name == "slurm":
        from hora.runner.launchers.slurm import SlurmLauncher

        return SlurmLauncher()
    if name == "sge":
        from hora.runner.launchers.sge import SgeLauncher

        return SgeLauncher()
    raise LaunchError(f"unknown launcher {name!r}")
