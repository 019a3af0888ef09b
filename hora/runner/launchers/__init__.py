"""Launchers: how the processes of a job get started, one module each.

``local`` runs every process as a child of ``hora run``; ``ssh`` reaches
other hosts over ssh (and runs this machine's share locally); ``mpi`` hands
the job to mpirun; ``slurm`` starts the ranks with srun inside an
allocation; ``sge`` with ``qrsh -inherit`` inside a grid-engine parallel
job (or submits one).  Each declares its names, detection, capabilities and host list
in its class; :mod:`hora.runner.launchers.registry` finds them.
"""

from __future__ import annotations

from hora.runner.launchers.registry import Launcher, get_launcher, launcher_class

__all__ = ["Launcher", "get_launcher", "launcher_class"]
