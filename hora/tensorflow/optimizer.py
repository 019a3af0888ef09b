"""``DistributedOptimizer`` for ``tf.compat.v1`` optimizers and ``BroadcastGlobalVariablesHook``."""

from __future__ import annotations

import logging
from typing import Any

import tensorflow as tf

from hora.core.frontend import GradientReduction, gradient_reduction
from hora.core.ops import ReduceOp
from hora.core.runtime import ProcessSet, global_process_set
from hora.errors import UnsupportedError
from hora.tensorflow.compression import Compression
from hora.tensorflow.functions import broadcast_global_variables
from hora.tensorflow.gradients import reduce_gradients

log = logging.getLogger(__name__)


class _DistributedOptimizerV1(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` averages the gradients across ranks."""

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: str | None, use_locking: bool,
                 reduction: GradientReduction) -> None:
        self._optimizer = optimizer
        self._reduction = reduction
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's ``(gradient, variable)`` pairs with the gradients reduced across ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = zip(*pairs, strict=True) if pairs else ((), ())
        reduced = reduce_gradients(grads, variables, self._reduction)
        return list(zip(reduced, variables, strict=True))

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> list[str]:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._optimizer.variables(*args, **kwargs)


def _is_keras_optimizer(optimizer: Any) -> bool:
    names = [c.__module__ for c in type(optimizer).__mro__]
    return any(m.startswith(("keras", "tf_keras")) for m in names)


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: ReduceOp | int = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> Any:
    """Wrap an optimizer so that gradients are averaged across ranks before they are applied.

    A ``tf.compat.v1.train.Optimizer`` gets its ``compute_gradients``
    wrapped; a Keras optimizer (Keras 3 or tf_keras) is handed to
    :func:`hora.tensorflow.keras.DistributedOptimizer`.

    Raises:
        UnsupportedError: ``backward_passes_per_step > 1`` with a TF1 optimizer.
        ValueError: an object that is neither kind of optimizer.
    """
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise UnsupportedError("backward_passes_per_step > 1 is not supported for tf.compat.v1 optimizers in "
                                   "hora; use a Keras optimizer or DistributedGradientTape")
        reduction = gradient_reduction(op=op, gradient_predivide_factor=gradient_predivide_factor,
                                       compression=compression, groups=groups, num_groups=num_groups,
                                       sparse_as_dense=sparse_as_dense, process_set=process_set)
        return _DistributedOptimizerV1(optimizer, name, use_locking, reduction)
    if _is_keras_optimizer(optimizer):
        from hora.tensorflow import keras as hvd_keras

        return hvd_keras.DistributedOptimizer(
            optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups, process_set=process_set,
            num_groups=num_groups)
    raise ValueError(f"DistributedOptimizer expects a tf.compat.v1.train.Optimizer or a Keras optimizer, "
                     f"got {type(optimizer).__name__}")


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts the root's global variables to every rank when a TF1 session starts.

    Pass it to ``tf.compat.v1.train.MonitoredTrainingSession(hooks=[...])`` so
    that every rank starts from the same weights, whether they were
    initialised randomly or restored from a checkpoint.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)


__all__ = ["BroadcastGlobalVariablesHook", "DistributedOptimizer"]
