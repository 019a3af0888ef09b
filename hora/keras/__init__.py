"""Horovod's Keras API for Keras 3 on hora: ``import hora.keras as hvd``.

Works on Keras's TensorFlow and torch backends (the gradients are reduced
inside the compiled train step); the JAX backend is refused with a clear
error.  Scripts written for ``horovod.keras`` / ``horovod.tensorflow.keras``
keep their calls: ``hvd.init()``, ``hvd.DistributedOptimizer(opt)``,
``hvd.callbacks.BroadcastGlobalVariablesCallback(0)`` and the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from hora._keras.numpy_collectives import (
    allgather_arrays,
    allreduce_arrays,
    broadcast_arrays,
    require_built,
    variables_of,
)
from hora._keras.numpy_collectives import broadcast_variables as _broadcast_variables
from hora._keras.optimizer import is_distributed as _is_distributed
from hora._keras.optimizer import load_model as _load_model
from hora.core import runtime as _runtime
from hora.core.api import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    cross_rank,
    cross_size,
    gloo_enabled,
    is_homogeneous,
    local_rank,
    local_size,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    size,
)
from hora.core.frontend import gradient_reduction as _gradient_reduction
from hora.core.frontend import resolve_op
from hora.core.objects import allgather_object, broadcast_object
from hora.core.ops import ReduceOp
from hora.core.runtime import (
    ProcessSet,
    add_process_set,
    global_process_set,
    is_initialized,
    remove_process_set,
)
from hora.errors import UnsupportedError
from hora.keras import callbacks
from hora.keras.compression import Compression
from hora.keras.optimizer import (
    JAX_MESSAGE,
    DistributedOptimizer,
    PartialDistributedOptimizer,
    distributed_optimizer_classes,
)
from hora.keras.optimizer import track_checkpoints as _track_checkpoints


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start hora; on the TensorFlow backend also size TensorFlow's thread pools per rank.

    Raises:
        UnsupportedError: Keras runs on JAX.
    """
    if keras.backend.backend() == "jax":
        raise UnsupportedError(JAX_MESSAGE)
    _runtime.init(comm, process_sets)
    if keras.backend.backend() == "tensorflow":
        from hora.tensorflow.threads import configure_threads

        configure_threads(_runtime.current().engine.topology.local_size)


def shutdown() -> None:
    """Stop hora on every rank."""
    _runtime.shutdown()


def _is_tf_graph_tensor(value: Any) -> bool:
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return not tf.executing_eagerly()


def allreduce(value: Any, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: ReduceOp | None = None, compression: Any = Compression.none,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce a value (NumPy array, Python number or backend tensor) across ranks; a backend tensor comes back.

    Inside a TensorFlow graph it is :func:`hora.tensorflow.allreduce`.
    """
    op = resolve_op(average, op)
    if _is_tf_graph_tensor(value):
        import hora.tensorflow as hvd_tf

        return hvd_tf.allreduce(value, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                name=name, process_set=process_set)
    compressed, ctx = compression.compress(keras.ops.convert_to_tensor(value))
    (out,) = allreduce_arrays([keras.ops.convert_to_numpy(compressed)], op, name, prescale_factor,
                              postscale_factor, process_set)
    return compression.decompress(keras.ops.convert_to_tensor(out), ctx)


def allgather(value: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's value along the first dimension."""
    if _is_tf_graph_tensor(value):
        import hora.tensorflow as hvd_tf

        return hvd_tf.allgather(value, name=name, process_set=process_set)
    (out,) = allgather_arrays([np.asarray(keras.ops.convert_to_numpy(value))], name, process_set)
    return keras.ops.convert_to_tensor(out)


def broadcast(value: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """The root's value on every rank."""
    if _is_tf_graph_tensor(value):
        import hora.tensorflow as hvd_tf

        return hvd_tf.broadcast(value, root_rank, name=name, process_set=process_set)
    (out,) = broadcast_arrays([np.asarray(keras.ops.convert_to_numpy(value))], root_rank, name, process_set)
    return keras.ops.convert_to_tensor(out)


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set) -> None:
    """Overwrite Keras variables with the root's values, in place (one grouped broadcast)."""
    _broadcast_variables(variables, root_rank, process_set)


def broadcast_global_variables(root_rank: int, model: keras.Model | None = None) -> None:
    """Broadcast a model's variables and its optimizer's from ``root_rank``.

    Keras 3 has no graph of global variables as TF1 had, so the model is
    needed; in ``model.fit`` use ``callbacks.BroadcastGlobalVariablesCallback``.

    Raises:
        ValueError: no model was given, or it has no weights yet (not built).
    """
    if model is None:
        raise ValueError("Keras 3 has no global variables: call hvd.broadcast_global_variables(root_rank, model) "
                         "or pass hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) to model.fit")
    require_built(model, "broadcast_global_variables")
    _broadcast_variables([*model.variables, *variables_of(getattr(model, "optimizer", None))], root_rank)


def join() -> int:
    """Declare that this rank has no more data; returns the rank that joined last."""
    from hora.core import collectives
    from hora.core.ops import CollectiveType

    return int(collectives.submit(CollectiveType.JOIN, [], wake=False).wait())


def load_model(filepath: str, custom_optimizers: Sequence[type] | None = None,
               custom_objects: dict[str, Any] | None = None, compression: Any = Compression.none,
               **kwargs: Any) -> keras.Model:
    """``keras.models.load_model`` whose compiled optimizer comes back as a ``DistributedOptimizer``.

    The saved optimizer's class is mapped to its distributed subclass, so its
    state (iterations, slots) is restored into the distributed optimizer; a
    stateful ``compression`` takes the compressor state saved in the archive
    (``model.save("….keras")`` on every rank keeps each rank's own residuals).
    """
    model = _load_model(keras.models.load_model, filepath, distributed_optimizer_classes(custom_optimizers or ()),
                        custom_objects, _gradient_reduction(compression=compression), **kwargs)
    if getattr(model, "optimizer", None) is not None and _is_distributed(model.optimizer):
        _track_checkpoints(model.optimizer)
    return model


from hora.keras import elastic  # noqa: E402  (hvd.elastic: Horovod's elastic API)

__all__ = [name for name in dir() if not name.startswith("_") and name not in ("annotations", "keras", "np",
                                                                               "Any", "Sequence")]
