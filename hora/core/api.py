"""Horovod's framework-free calls, once for every binding: topology, build queries and reduction names.

``hora.torch``, ``hora.tensorflow`` and ``hora.mxnet`` re-export these, so
``hvd.rank()``, ``hvd.local_size()``, ``hvd.mpi_enabled()`` or ``hvd.Average``
mean the same thing, and are written once, whatever the framework.  What a
framework decides itself (``gloo_built``, ``nccl_built``, ``cuda_built``)
stays in its binding.
"""

from __future__ import annotations

from hora.core import runtime
from hora.core.ops import ReduceOp
from hora.core.topology import Topology

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


def _topology() -> Topology:
    return runtime.current().engine.topology


def rank() -> int:
    """This process's rank in ``[0, size())``."""
    return runtime.current().engine.rank


def size() -> int:
    """Number of processes in the job."""
    return runtime.current().engine.size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return _topology().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return _topology().local_size


def cross_rank() -> int:
    """Index of this host among the job's hosts."""
    return _topology().cross_rank


def cross_size() -> int:
    """Number of hosts in the job."""
    return _topology().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    t = _topology()
    return t.local_size * t.cross_size == size()


def _controller() -> str:
    return runtime.current().engine.controller.name


def mpi_enabled() -> bool:
    """True when this job's engine runs on MPI."""
    return runtime.is_initialized() and _controller() == "mpi"


def mpi_built() -> bool:
    """True when mpi4py is importable (hora needs no compile step)."""
    return runtime.mpi_built()


def gloo_enabled() -> bool:
    """True when this job's engine runs on gloo."""
    return runtime.is_initialized() and _controller() == "gloo"


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE (always, for the MPI hora starts)."""
    return bool(getattr(runtime.current().engine.controller, "threads_supported", False))


def rocm_built() -> bool:
    """False: hora has no ROCm-specific build."""
    return False


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not supported."""
    return False


__all__ = ["Adasum", "Average", "Max", "Min", "Product", "Sum", "ccl_built", "cross_rank", "cross_size",
           "ddl_built", "gloo_enabled", "is_homogeneous", "local_rank", "local_size", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "rank", "rocm_built", "size"]
