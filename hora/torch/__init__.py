"""Horovod's PyTorch API on hora: ``import hora.torch as hvd``.

Scripts written for ``horovod.torch`` run unchanged with this import.
"""

from __future__ import annotations

import torch

from hora.core import runtime as _runtime
from hora.core.api import (
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


def gloo_built() -> bool:
    """True when torch.distributed has gloo (the engine hora uses without MPI)."""
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def nccl_built() -> bool:
    """True when torch.distributed has NCCL and a GPU is visible."""
    return torch.distributed.is_available() and torch.distributed.is_nccl_available() and torch.cuda.is_available()


def cuda_built() -> bool:
    """True when torch sees a CUDA device."""
    return torch.cuda.is_available()


def rocm_built() -> bool:
    """True when this torch is a ROCm build."""
    return bool(getattr(torch.version, "hip", None))


# Horovod scripts use ``hvd.elastic.run`` and ``hvd.elastic.TorchState`` after ``import horovod.torch as hvd``.
from hora.torch import elastic  # noqa: E402

__all__ = [name for name in dir() if not name.startswith("_") and name not in ("torch", "annotations", "warnings")]
