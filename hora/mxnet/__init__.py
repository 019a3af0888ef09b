"""Horovod's MXNet API on hora: ``import hora.mxnet as hvd``.

Scripts written for ``horovod.mxnet`` (Gluon with ``DistributedTrainer`` and
``broadcast_parameters``, Module with ``DistributedOptimizer``) run with this
import and ``hora run -np N``.  Nothing here imports torch: the engine runs on
MPI (``hora run`` picks it when mpirun and mpi4py are installed).  Importing
this package also registers hora's stores in MXNet's KVStore registry
(:mod:`hora.mxnet.kvstore`): ``hora``, ``hora_dist_sync`` and ``hora_dist_async``.
"""

from __future__ import annotations

import mxnet as mx

from hora.core import runtime as _runtime
from hora.core.api import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    ddl_built,
    gloo_enabled,
    is_homogeneous,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    rocm_built,
    size,
)
from hora.core.runtime import (
    ProcessSet,
    add_process_set,
    global_process_set,
    is_initialized,
    remove_process_set,
)
from hora.errors import HostsUpdatedInterrupt, InternalError
from hora.mxnet import kvstore as _kvstore
from hora.mxnet.compression import Compression
from hora.mxnet.functions import allgather_object, broadcast_object, broadcast_parameters
from hora.mxnet.mpi_ops import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    join,
    reducescatter,
)
from hora.mxnet.optimizer import DistributedOptimizer, DistributedTrainer

#: Horovod's name for the error elastic training recovers from.
HorovodInternalError = InternalError

_kvstore.register()


def init(comm=None, process_sets=None) -> None:
    """Start hora: connect to the other ranks (launched by ``hora run``, mpirun or srun)."""
    _runtime.init(comm, process_sets)


def shutdown() -> None:
    """Stop hora on every rank; ``init()`` may be called again afterwards."""
    _runtime.shutdown()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a timeline into ``file_path`` from now on (see :func:`hora.core.runtime.start_timeline`)."""
    _runtime.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline recording; its file is then complete JSON."""
    _runtime.stop_timeline()


def gloo_built() -> bool:
    """True when torch.distributed with gloo could be imported; hora.mxnet itself never imports torch."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def nccl_built() -> int:
    """0: hora.mxnet reduces host memory only (Horovod returns the NCCL version, 0 without NCCL)."""
    return 0


def cuda_built() -> bool:
    """False: hora.mxnet moves GPU arrays through host memory."""
    return False


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("mx", "annotations")]
