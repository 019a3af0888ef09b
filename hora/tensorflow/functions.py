"""Broadcasting variables and Python objects (Horovod's ``horovod.tensorflow.functions``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import tensorflow as tf

from hora.core import objects
from hora.core.runtime import ProcessSet, global_process_set
from hora.errors import HoraError
from hora.tensorflow import mpi_ops


def broadcast_variables(variables: Iterable[tf.Variable], root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False) -> Any:
    """Overwrite every rank's ``variables`` with the root's values, as one grouped broadcast.

    Eagerly the assignment happens now; in a TF1 graph the returned op does
    it when run (``inplace`` is accepted for Horovod compatibility: hora
    always assigns through the variables).
    """
    variables = list(variables)
    if tf.executing_eagerly():
        mpi_ops.broadcast_(variables, root_rank, process_set=process_set)
        return None
    if not variables:
        return tf.no_op(name="hora_broadcast_variables")
    return tf.group(*mpi_ops.broadcast_(variables, root_rank, process_set=process_set))


def broadcast_global_variables(root_rank: int) -> Any:
    """The op that broadcasts every global variable of the TF1 graph from ``root_rank``.

    Raises:
        RuntimeError: called eagerly, where there are no global variables; use
            :func:`broadcast_variables` with the model's variables instead.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; "
                           "use hvd.broadcast_variables(model.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Send any picklable object from the root to every rank of the process set and return it.

    Runs immediately in eager and graph mode alike (``session`` is accepted
    for Horovod compatibility and not needed).
    """
    try:
        return objects.broadcast_object(obj, root_rank, name, process_set)
    except HoraError as e:
        raise mpi_ops.CollectiveFailedError(str(e)) from e


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from ``root_rank`` (Horovod's TF1 form)."""
    def fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, session, name, process_set)

    return fn


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather one picklable object from every rank of the process set, in rank order."""
    try:
        return objects.allgather_object(obj, name, process_set)
    except HoraError as e:
        raise mpi_ops.CollectiveFailedError(str(e)) from e


__all__ = ["allgather_object", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
           "broadcast_variables"]
