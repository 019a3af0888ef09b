"""Framework-free helpers that every binding's front (hora.tensorflow, hora.keras, ...) shares.

Horovod's API has a few pieces of arithmetic and argument handling that do not
depend on the framework: the ``average=``/``op=`` pair, the bytes of a pickled
object sent by ``broadcast_object``, and the learning-rate warmup schedule of
the Keras callbacks.  They live here once, so that bindings do not copy them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cloudpickle
import numpy as np

from hora.core import collectives, runtime
from hora.core.ops import CollectiveType, ReduceOp
from hora.errors import UnsupportedError


def resolve_op(average: bool | None, op: ReduceOp | int | None, default: ReduceOp = ReduceOp.AVERAGE) -> ReduceOp:
    """Horovod's deprecated ``average=`` and its ``op=`` as one operator.

    Raises:
        ValueError: both were given.
        UnsupportedError: ``op=Adasum``, which hora does not implement.
    """
    if average is not None and op is not None:
        raise ValueError("average and op are mutually exclusive; pass only op=")
    if op is None:
        op = default if average is None else (ReduceOp.AVERAGE if average else ReduceOp.SUM)
    op = ReduceOp(int(op))
    if op == ReduceOp.ADASUM:
        raise UnsupportedError("op=hvd.Adasum is not supported by hora yet; use hvd.Average or hvd.Sum")
    return op


def object_to_bytes(obj: Any) -> np.ndarray:
    """``obj`` pickled (cloudpickle, so lambdas and local classes travel) as a uint8 array."""
    return np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8).copy()


def bytes_to_object(data: np.ndarray | bytes) -> Any:
    """The inverse of :func:`object_to_bytes`."""
    raw = data if isinstance(data, bytes) else np.asarray(data, dtype=np.uint8).tobytes()
    return cloudpickle.loads(raw)


def split_gathered_bytes(data: np.ndarray, sizes: Sequence[int]) -> list[Any]:
    """Objects from the concatenated pickles of an allgather, given each rank's byte count."""
    out, offset = [], 0
    raw = np.asarray(data, dtype=np.uint8).tobytes()
    for n in sizes:
        out.append(cloudpickle.loads(raw[offset: offset + int(n)]))
        offset += int(n)
    return out


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """Send any picklable object from the root to every rank of the process set and return it.

    Framework-free (NumPy through the core); the bindings' ``broadcast_object`` use it.
    """
    rt = runtime.current()
    name = name or rt.auto_name("broadcast_object", collectives.process_set_id(process_set))
    is_root = rt.engine.rank == root_rank
    payload = object_to_bytes(obj) if is_root else np.zeros(0, np.uint8)
    (size,) = collectives.submit(CollectiveType.BROADCAST, [np.array([payload.size], np.int64)], name=f"{name}.size",
                                 root=int(root_rank), process_set=process_set, wake=False).wait()
    data = payload if is_root else np.zeros(int(size[0]), np.uint8)
    (data,) = collectives.submit(CollectiveType.BROADCAST, [data], name=f"{name}.data", root=int(root_rank),
                                 process_set=process_set, wake=False).wait()
    return obj if is_root else bytes_to_object(data)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Gather one picklable object from every rank of the process set, in rank order."""
    rt = runtime.current()
    name = name or rt.auto_name("allgather_object", collectives.process_set_id(process_set))
    data = object_to_bytes(obj)
    (sizes,) = collectives.submit(CollectiveType.ALLGATHER, [np.array([data.size], np.int64)], name=f"{name}.sizes",
                                  process_set=process_set, wake=False).wait()
    (gathered,) = collectives.submit(CollectiveType.ALLGATHER, [data], name=f"{name}.data", process_set=process_set,
                                     wake=False).wait()
    return split_gathered_bytes(gathered, sizes.tolist())


def warmup_multiplier(epoch: float, size: int, warmup_epochs: float) -> float:
    """Horovod's gradual warmup factor at a (fractional) epoch: from ``1/size`` to 1.

    The learning rate of a job of ``size`` ranks starts at ``initial_lr /
    size`` (the single-process rate) and grows linearly to ``initial_lr`` at
    ``warmup_epochs`` (Goyal et al., "Accurate, Large Minibatch SGD").
    """
    if warmup_epochs <= 0:
        return 1.0
    return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1.0)


# ------------------------------------------------------------------ topology calls, the same in every binding
def rank() -> int:
    """This process's rank in ``[0, size())``."""
    return runtime.current().engine.rank


def size() -> int:
    """Number of processes in the job."""
    return runtime.current().engine.size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return runtime.current().engine.topology.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return runtime.current().engine.topology.local_size


def cross_rank() -> int:
    """Index of this host among the job's hosts."""
    return runtime.current().engine.topology.cross_rank


def cross_size() -> int:
    """Number of hosts in the job."""
    return runtime.current().engine.topology.cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    t = runtime.current().engine.topology
    return t.local_size * t.cross_size == size()


def _controller_is(name: str) -> bool:
    return runtime.is_initialized() and runtime.current().engine.controller.name == name


def mpi_enabled() -> bool:
    """True when this job's engine runs on MPI."""
    return _controller_is("mpi")


def gloo_enabled() -> bool:
    """True when this job's engine runs on gloo."""
    return _controller_is("gloo")


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE."""
    return bool(getattr(runtime.current().engine.controller, "threads_supported", False))


TOPOLOGY_CALLS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
                  "mpi_enabled", "gloo_enabled", "mpi_threads_supported")

__all__ = [*TOPOLOGY_CALLS, "allgather_object", "broadcast_object", "bytes_to_object", "object_to_bytes",
           "resolve_op", "split_gathered_bytes", "warmup_multiplier"]
