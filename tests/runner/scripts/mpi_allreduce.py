"""A 2+ rank mpi4py allreduce: proves the ranks really joined one MPI job."""

import os

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
total = np.zeros(1)
comm.Allreduce(np.array([comm.rank + 1.0]), total)
print(f"rank {comm.rank} of {comm.size}: sum {total[0]:g} controller {os.environ.get('HORA_CONTROLLER')}")
