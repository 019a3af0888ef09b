"""Horovod's PyTorch API on hora: ``import hora.torch as hvd``.

Scripts written for ``horovod.torch`` run unchanged with this import.
"""

from __future__ import annotations

import torch

from hora.core import runtime as _runtime
from hora.core.runtime import (
    ProcessSet,
    add_process_set,
    global_process_set,
    is_initialized,
    remove_process_set,
)
from hora.errors import HostsUpdatedInterrupt, InternalError
from hora.torch.compression import Compression
from hora.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.torch.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from hora.torch.optimizer import DistributedOptimizer
from hora.torch.sync_batch_norm import SyncBatchNorm

#: Horovod's name for the error elastic training recovers from.
HorovodInternalError = InternalError


def init(comm=None, process_sets=None) -> None:
    """Start hora: connect to the other ranks (launched by hora run, mpirun, torchrun or srun)."""
    _runtime.init(comm, process_sets)


def shutdown() -> None:
    """Stop hora on every rank; ``init()`` may be called again afterwards."""
    from hora.torch.async_ops import forget_handles

    _runtime.shutdown()
    forget_handles()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a timeline into ``file_path`` from now on (see :func:`hora.core.runtime.start_timeline`).

    Like Horovod, it raises ``ValueError`` before ``init()``.
    """
    _runtime.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline recording; its file is then complete JSON."""
    _runtime.stop_timeline()


def _topo():
    return _runtime.current().engine.topology


def rank() -> int:
    """This process's rank in ``[0, size())``."""
    return _runtime.current().engine.rank


def size() -> int:
    """Number of processes in the job."""
    return _runtime.current().engine.size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return _topo().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return _topo().local_size


def cross_rank() -> int:
    """Index of this host among the job's hosts."""
    return _topo().cross_rank


def cross_size() -> int:
    """Number of hosts in the job."""
    return _topo().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    t = _topo()
    return t.local_size * t.cross_size == size()


def _controller() -> str:
    return _runtime.current().engine.controller.name


def mpi_enabled() -> bool:
    """True when this job's engine runs on MPI."""
    return is_initialized() and _controller() == "mpi"


def mpi_built() -> bool:
    """True when mpi4py is importable (hora needs no compile step)."""
    return _runtime.mpi_built()


def gloo_enabled() -> bool:
    """True when this job's engine runs on gloo."""
    return is_initialized() and _controller() == "gloo"


def gloo_built() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def nccl_built() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_nccl_available() and torch.cuda.is_available()


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return bool(getattr(torch.version, "hip", None))


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE (always, for the MPI hora starts)."""
    rt = _runtime.current()
    backend = rt.engine.controller
    return bool(getattr(backend, "threads_supported", False))


# Horovod scripts use ``hvd.elastic.run`` and ``hvd.elastic.TorchState`` after ``import horovod.torch as hvd``.
from hora.torch import elastic  # noqa: E402

__all__ = [name for name in dir() if not name.startswith("_") and name not in ("torch", "annotations", "warnings")]
