"""NumPy collectives for Keras-level helpers (callbacks, ``hvd.allreduce`` on values), through the core."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hora.core import collectives
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.runtime import ProcessSet, global_process_set
from hora.errors import ArgumentError


def _contiguous(a: Any) -> np.ndarray:
    # np.ascontiguousarray would turn a 0-d array (a scalar variable) into shape (1,)
    a = np.asarray(a)
    return a if a.flags.c_contiguous else a.copy(order="C")


def allreduce_arrays(arrays: Sequence[np.ndarray], op: ReduceOp = ReduceOp.AVERAGE, name: str | None = None,
                     prescale: float = 1.0, postscale: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Reduce NumPy arrays across ranks as one grouped allreduce."""
    arrays = [_contiguous(a) for a in arrays]
    if not arrays:
        return []
    return collectives.submit(CollectiveType.ALLREDUCE, arrays, name=name, op=op, prescale=prescale,
                              postscale=postscale, process_set=process_set, wake=False).wait()


def allgather_arrays(arrays: Sequence[np.ndarray], name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Concatenate every rank's arrays along their first dimension."""
    arrays = [_contiguous(a) for a in arrays]
    return collectives.submit(CollectiveType.ALLGATHER, arrays, name=name, process_set=process_set,
                              wake=False).wait()


def broadcast_arrays(arrays: Sequence[np.ndarray], root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """The root's arrays on every rank, as one grouped broadcast."""
    arrays = [_contiguous(a) for a in arrays]
    if not arrays:
        return []
    return collectives.submit(CollectiveType.BROADCAST, arrays, name=name, root=int(root_rank),
                              process_set=process_set, wake=False).wait()


def to_numpy(value: Any) -> np.ndarray:
    """A variable's or tensor's value as a NumPy array (``.numpy()`` where Keras offers it)."""
    numpy = getattr(value, "numpy", None)
    return np.asarray(numpy() if callable(numpy) else value)


def variables_of(obj: Any) -> list[Any]:
    """``obj.variables`` whether Keras made it a property (Keras 3, tf_keras) or a method (legacy optimizers)."""
    if obj is None:
        return []
    v = getattr(obj, "variables", [])
    return list(v() if callable(v) else v)


def is_built(model: Any) -> bool:
    """Whether ``model`` has created its weights (a model given no input shape is built by its first batch)."""
    return bool(getattr(model, "built", True))


def require_built(model: Any, what: str) -> None:
    """Refuse ``what`` on a model whose weights do not exist yet, instead of acting on none of them.

    Raises:
        ArgumentError: the model is not built; the message says how to build it.
    """
    if not is_built(model):
        raise ArgumentError(
            f"{what}: model {getattr(model, 'name', model)!r} has no weights yet (a model given no input shape "
            "creates them at its first batch); give it an input shape (keras.Input(...) as its first layer), call "
            "model.build(input_shape), or train one batch first. In model.fit, "
            "hvd.callbacks.BroadcastGlobalVariablesCallback broadcasts after the first batch by itself.")


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set) -> None:
    """Overwrite Keras variables (any backend, eager) with the root's values, in one grouped broadcast."""
    variables = list(variables)
    values = broadcast_arrays([to_numpy(v) for v in variables], root_rank, process_set=process_set)
    for var, value in zip(variables, values, strict=True):
        var.assign(value)


__all__ = ["allgather_arrays", "allreduce_arrays", "broadcast_arrays", "broadcast_variables", "is_built",
           "require_built", "to_numpy", "variables_of"]
