"""Horovod's TensorFlow API on hora: ``import hora.tensorflow as hvd``.

Scripts written for ``horovod.tensorflow`` run with this import, eagerly, in
``tf.function`` and in ``tf.compat.v1`` graphs.  The engine is the one every
binding shares (:mod:`hora.core.runtime`); tensors reach it as NumPy arrays,
so tensors on a GPU travel through host memory.
"""

from __future__ import annotations

from typing import Any

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
from hora.tensorflow.compression import Compression, CompressionState
from hora.tensorflow.functions import (
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from hora.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from hora.tensorflow.mpi_ops import (
    Adasum,
    Average,
    CollectiveFailedError,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    cross_rank_op,
    cross_size_op,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from hora.tensorflow.optimizer import BroadcastGlobalVariablesHook, DistributedOptimizer
from hora.tensorflow.util import _executing_eagerly

#: Horovod's name for the error elastic training recovers from.
HorovodInternalError = InternalError


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start hora (launched by hora run, mpirun or srun) and size TensorFlow's thread pools per rank."""
    from hora.tensorflow.threads import configure_threads

    _runtime.init(comm, process_sets)
    configure_threads(_runtime.current().engine.topology.local_size)


def shutdown() -> None:
    """Stop hora on every rank; ``init()`` may be called again afterwards."""
    _runtime.shutdown()


def gloo_built() -> bool:
    """True when torch.distributed (which carries gloo) can be imported."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def nccl_built() -> bool:
    """False: TensorFlow tensors reach hora through host memory."""
    return False


def cuda_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Accepted for Horovod compatibility; hora's timeline is configured with ``hora run --timeline-filename``."""
    _runtime.current()


def stop_timeline() -> None:
    """Accepted for Horovod compatibility (see :func:`start_timeline`)."""
    _runtime.current()


def __getattr__(name: str) -> Any:
    # SyncBatchNormalization subclasses a Keras layer: load Keras only when it is asked for.
    if name == "SyncBatchNormalization":
        from hora.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module 'hora.tensorflow' has no attribute {name!r}")


# hvd.elastic (Horovod's elastic API) and hvd.util._executing_eagerly (as Horovod's tests use)
from hora.tensorflow import elastic, util  # noqa: E402
