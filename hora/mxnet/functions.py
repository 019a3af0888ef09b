"""Broadcasting parameters and Python objects (Horovod's MXNet ``broadcast_parameters`` and ``functions``)."""

from __future__ import annotations

import logging
import types
from collections.abc import Mapping
from typing import Any

import mxnet as mx

from hora.core import objects, runtime
from hora.core.runtime import ProcessSet, global_process_set
from hora.mxnet import mpi_ops

log = logging.getLogger(__name__)


def _with_broadcast_after_init(param: mx.gluon.Parameter, root_rank: int, name: str,
                               process_set: ProcessSet) -> None:
    """Make ``param`` broadcast its value from the root as soon as its deferred initialisation runs.

    Gluon initialises such a parameter during the first forward pass, when
    the input shape is known; every rank runs that pass, so every rank joins
    the broadcast there.  Only this instance's ``_init_impl`` is wrapped.
    """
    init_impl = param._init_impl

    def init_then_broadcast(self: mx.gluon.Parameter, *args: Any, **kwargs: Any) -> None:
        init_impl(*args, **kwargs)
        for i, data in enumerate(self._check_and_get(self._data, list)):
            mpi_ops.broadcast_(data, root_rank, name=f"{name}.{i}" if i else name, process_set=process_set)
        self._init_impl = init_impl  # later re-initialisations are local, as before

    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params: Mapping[Any, Any], root_rank: int = 0, prefix: str | None = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's parameters with the root's, in place.

    Args:
        params: ``block.collect_params()`` (a Gluon ``ParameterDict``), or a
            dict of NDArrays such as ``Module.get_params()[0]``.  Gluon
            parameters whose initialisation is deferred to the first forward
            pass are broadcast right after it.
        root_rank: the rank whose values everyone gets.
        prefix: distinguishes the names when several models are broadcast.
        process_set: broadcast within this process set only.

    Raises:
        ValueError: ``params`` is neither a dict nor a ``ParameterDict``.
    """
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise ValueError(f"broadcast_parameters takes a dict or a ParameterDict, not {type(params).__name__}")
    if runtime.current().engine.size == 1:
        return
    prefix = prefix or ""
    arrays, names = [], []
    for key, p in sorted(params.items(), key=lambda kv: str(kv[0])):
        name = f"{prefix}{key}"
        if isinstance(p, mx.gluon.Parameter):
            if p._deferred_init:
                _with_broadcast_after_init(p, root_rank, name, process_set)
                continue
            for i, data in enumerate(p.list_data()):
                arrays.append(data)
                names.append(f"{name}.{i}" if i else name)
        elif isinstance(p, mx.nd.NDArray):
            arrays.append(p)
            names.append(name)
        else:
            raise ValueError(f"broadcast_parameters: {key!r} is a {type(p).__name__}, not a Parameter or NDArray")
    for array, name in zip(arrays, names, strict=True):
        mpi_ops.broadcast_(array, root_rank, name=name, process_set=process_set)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Send any picklable object from the root to every rank and return it."""
    return objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather one picklable object from every rank; returns them in rank order."""
    return objects.allgather_object(obj, name, process_set)
