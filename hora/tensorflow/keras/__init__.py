"""Horovod's ``horovod.tensorflow.keras`` on hora: ``import hora.tensorflow.keras as hvd``.

``tf.keras`` is Keras 3 on TensorFlow 2.16 and later, or the legacy tf_keras
(Keras 2) when ``TF_USE_LEGACY_KERAS=1``; both work.  The optimizer's
gradients are reduced where each Keras applies them (``Optimizer.apply`` in
Keras 3, ``apply_gradients`` in tf_keras), inside the compiled train step,
as one grouped allreduce per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hora._keras import optimizer as _distributed
from hora._keras.aggregation import AggregationOps, keras3_ops
from hora._keras.numpy_collectives import broadcast_variables as _broadcast_keras_variables
from hora._keras.numpy_collectives import require_built, variables_of
from hora.core.frontend import gradient_reduction as _gradient_reduction
from hora.core.ops import ReduceOp
from hora.core.runtime import ProcessSet, global_process_set
from hora.tensorflow import (  # noqa: F401  (the topology and collectives are hora.tensorflow's)
    Adasum,
    Average,
    Compression,
    CompressionState,
    Max,
    Min,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_object,
    allreduce,
    broadcast,
    broadcast_object,
    cross_rank,
    cross_size,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from hora.tensorflow import broadcast_global_variables as _tf_broadcast_global_variables
from hora.tensorflow.compression import track_optimizer_compression as _track_optimizer_compression
from hora.tensorflow.gradients import reduce_gradients as _reduce_gradients
from hora.tensorflow.keras import callbacks


def is_legacy_keras() -> bool:
    """True when ``tf.keras`` is tf_keras (Keras 2), i.e. ``TF_USE_LEGACY_KERAS=1``."""
    return tf.keras.optimizers.Optimizer.__module__.startswith("tf_keras")


def _hook(cls: type) -> str:
    """Where an optimizer class applies gradients: ``apply_gradients`` in tf_keras, ``apply`` in Keras 3."""
    legacy = any(c.__module__.startswith("tf_keras") for c in cls.__mro__)
    return "apply_gradients" if legacy else "apply"


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: ReduceOp | int = ReduceOp.AVERAGE,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True, num_groups: int = 0) -> Any:
    """A copy of a ``tf.keras`` optimizer (same class and config, fresh state) that averages gradients.

    Args and semantics are Horovod's; see :func:`hora.keras.DistributedOptimizer`.
    ``backward_passes_per_step=N`` sums the gradients locally and reduces and
    applies them every N steps, with Keras 3 and tf_keras alike.

    Raises:
        ValueError: ``backward_passes_per_step < 1``, or ``gradient_predivide_factor``
            with an op other than Average.
    """
    hook = _hook(type(optimizer))
    reduction = _gradient_reduction(op=op, gradient_predivide_factor=gradient_predivide_factor,
                                    compression=compression, groups=groups, num_groups=num_groups,
                                    sparse_as_dense=sparse_as_dense, process_set=process_set)
    ops = _keras3_ops if hook == "apply" else lambda: _TF_AGGREGATION_OPS
    dist = _distributed.make_distributed(optimizer, hook=hook, reduce=_reduce_gradients, reduction=reduction,
                                         name=name, backward_passes_per_step=backward_passes_per_step,
                                         average_aggregated_gradients=average_aggregated_gradients,
                                         aggregation_ops=ops)
    return _track_optimizer_compression(dist)


def _keras3_ops() -> AggregationOps:
    """Local aggregation for Keras 3 behind ``tf.keras``: its own variables and ops, as hora.keras does."""
    import keras

    return keras3_ops(keras, tf.convert_to_tensor)


def _variable(initial_value: Any) -> tf.Variable:
    with tf.init_scope():  # created eagerly even while a tf.function is being traced
        return tf.Variable(initial_value(), trainable=False)


#: local gradient aggregation (``backward_passes_per_step``) for tf_keras optimizers, on TensorFlow variables
_TF_AGGREGATION_OPS = AggregationOps(
    zeros_variable=lambda v: _variable(lambda: tf.zeros(v.shape, v.dtype.base_dtype)),
    counter_variable=lambda: _variable(lambda: tf.constant(0, tf.int32)),
    equal=tf.equal,
    cond=tf.cond,
    to_dense=tf.convert_to_tensor,
    read=lambda v: v.read_value(),
    zeros_like=tf.zeros_like,
)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None, local_layers: Any = None,
                                **kwargs: Any) -> Any:
    """A :func:`DistributedOptimizer` whose ``local_layers``' variables keep their local gradients."""
    return _distributed.register_local_layers(DistributedOptimizer(optimizer, name=name, **kwargs), local_layers)


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set) -> None:
    """Overwrite variables with the root's values, in place."""
    _broadcast_keras_variables(variables, root_rank, process_set)


def broadcast_global_variables(root_rank: int, model: Any = None) -> Any:
    """Broadcast a model's and its optimizer's variables (eagerly), or the TF1 graph's global variables."""
    if model is not None:
        require_built(model, "broadcast_global_variables")
        _broadcast_keras_variables([*model.variables, *variables_of(getattr(model, "optimizer", None))], root_rank)
        return None
    return _tf_broadcast_global_variables(root_rank)


def _optimizer_classes(custom_optimizers: Sequence[type]) -> dict[str, type]:
    base = tf.keras.optimizers.Optimizer
    classes = [c for c in vars(tf.keras.optimizers).values() if isinstance(c, type) and issubclass(c, base)]
    classes += list(custom_optimizers)
    return {c.__name__: _distributed.distributed_class(c, _hook(c), _reduce_gradients) for c in classes}


def load_model(filepath: str, custom_optimizers: Sequence[type] | None = None,
               custom_objects: dict[str, Any] | None = None, compression: Any = Compression.none,
               **kwargs: Any) -> Any:
    """``tf.keras.models.load_model`` whose compiled optimizer comes back as a ``DistributedOptimizer``.

    A stateful ``compression`` takes the compressor state saved in the model's
    archive (``model.save("….keras")`` on every rank keeps each rank's own).
    """
    model = _distributed.load_model(tf.keras.models.load_model, filepath,
                                    _optimizer_classes(custom_optimizers or ()), custom_objects,
                                    _gradient_reduction(compression=compression), **kwargs)
    if getattr(model, "optimizer", None) is not None and _distributed.is_distributed(model.optimizer):
        _track_optimizer_compression(model.optimizer)
    return model


from hora.tensorflow.keras import elastic  # noqa: E402  (hvd.elastic: Horovod's elastic API)

__all__ = [name for name in dir() if not name.startswith("_") and name not in ("annotations", "tf", "Any",
                                                                               "Sequence")]
