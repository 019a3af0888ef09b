"""``DistributedOptimizer`` for Keras 3: gradients reduced across ranks inside the compiled train step.

Keras 3 applies gradients through one public method, ``Optimizer.apply``
(``apply_gradients`` and the train steps of every backend call it); the
distributed optimizer reduces the gradients there, as one grouped allreduce
per step:

* TensorFlow backend: :func:`hora.tensorflow.gradients.reduce_gradients` (one
  ``tf.py_function`` in the compiled step);
* torch backend: :func:`hora.keras.reduction.reduce_torch_gradients`, the
  torch tensors go to the core as they are;
* JAX backend: refused with a clear error (the step is traced by ``jax.jit``).

The options are checked once (:func:`hora.core.frontend.gradient_reduction`)
and the optimizer is made by :func:`hora._keras.optimizer.make_distributed`,
as ``hora.tensorflow.keras`` makes its own.

``backward_passes_per_step=N`` sums the gradients locally for N steps and
reduces and applies them on the Nth (:mod:`hora._keras.aggregation`), so the
ranks communicate once per N steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from hora._keras import optimizer as _distributed
from hora._keras.aggregation import keras3_ops
from hora.core.frontend import gradient_reduction
from hora.core.ops import ReduceOp
from hora.core.runtime import ProcessSet, global_process_set
from hora.keras.compression import Compression
from hora.keras.reduction import JAX_MESSAGE, backend_reduce


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: ReduceOp | int = ReduceOp.AVERAGE, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, groups: Any = None,
                         process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
                         num_groups: int = 0) -> keras.optimizers.Optimizer:
    """A copy of ``optimizer`` (same class and config, fresh state) that averages gradients across ranks.

    Args:
        optimizer: a Keras 3 optimizer.  A tf_keras one (``tf.keras`` under
            ``TF_USE_LEGACY_KERAS=1``) is handed to
            :func:`hora.tensorflow.keras.DistributedOptimizer`.
        compression: ``hvd.Compression.fp16`` sends float gradients as float16.
        op: ``hvd.Average`` (default) or ``hvd.Sum``...
        backward_passes_per_step: apply the accumulated gradients every N steps.
        average_aggregated_gradients: with N > 1, average (True) or sum (False,
            Horovod's default) the N steps' gradients.
        gradient_predivide_factor: divide before the sum and multiply after (Average only).
        groups: an int (number of allreduces per step) or lists of variables,
            on the TensorFlow and torch backends alike.
        process_set: reduce within this process set only.

    Raises:
        UnsupportedError: on the JAX backend.
        ValueError: ``backward_passes_per_step < 1``, or ``gradient_predivide_factor``
            with an op other than Average.
    """
    if any(c.__module__.startswith("tf_keras") for c in type(optimizer).__mro__):
        from hora.tensorflow import keras as tf_keras_binding

        return tf_keras_binding.DistributedOptimizer(
            optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups, process_set=process_set,
            num_groups=num_groups)
    reduce = backend_reduce(keras.backend.backend())
    reduction = gradient_reduction(op=op, gradient_predivide_factor=gradient_predivide_factor,
                                   compression=compression, groups=groups, num_groups=num_groups,
                                   sparse_as_dense=sparse_as_dense, process_set=process_set)
    dist = _distributed.make_distributed(optimizer, hook="apply", reduce=reduce, reduction=reduction, name=name,
                                         backward_passes_per_step=backward_passes_per_step,
                                         average_aggregated_gradients=average_aggregated_gradients,
                                         aggregation_ops=lambda: KERAS_AGGREGATION_OPS)
    return track_checkpoints(dist)


def track_checkpoints(optimizer: Any) -> Any:
    """On the TensorFlow backend, let ``tf.train.Checkpoint`` carry the optimizer's compressor state too.

    (``model.save`` carries it on every backend, through the optimizer's ``save_assets``.)
    """
    if keras.backend.backend() == "tensorflow":
        from hora.tensorflow.compression import track_optimizer_compression

        track_optimizer_compression(optimizer)
    return optimizer


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,
                                local_layers: Any = None, **kwargs: Any) -> keras.optimizers.Optimizer:
    """A :func:`DistributedOptimizer` whose ``local_layers``' variables keep their local gradients
    (divided by the number of ranks, as in Horovod)."""
    return _distributed.register_local_layers(DistributedOptimizer(optimizer, name=name, **kwargs), local_layers)


def _dense(grad: Any) -> Any:
    if hasattr(grad, "indices") and hasattr(grad, "dense_shape"):  # tf.IndexedSlices (an Embedding's, on TF)
        import tensorflow as tf

        return tf.convert_to_tensor(grad)
    return grad


#: local gradient aggregation on Keras 3's own variables and ops (any backend hora.keras runs on)
KERAS_AGGREGATION_OPS = keras3_ops(keras, _dense)


def distributed_optimizer_classes(custom_optimizers: Sequence[type] = ()) -> dict[str, type]:
    """Every Keras optimizer class (and ``custom_optimizers``) by name -> its distributed class, for loading."""
    classes = [c for c in vars(keras.optimizers).values()
               if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)]
    classes += list(custom_optimizers)
    reduce = backend_reduce(keras.backend.backend())
    return {c.__name__: _distributed.distributed_class(c, "apply", reduce) for c in classes}


__all__ = ["DistributedOptimizer", "JAX_MESSAGE", "PartialDistributedOptimizer", "distributed_optimizer_classes"]

