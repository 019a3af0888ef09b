"""Python objects through the collectives: ``broadcast_object`` and ``allgather_object`` on NumPy buffers.

An object travels as its pickled bytes (:mod:`hora.core.frontend`) in a
NumPy ``uint8`` array submitted straight to the core, so a binding whose
tensors are not engine buffers (MXNet NDArrays) needs none of its own here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora.core import collectives, runtime
from hora.core.frontend import bytes_to_object, object_to_bytes, split_gathered_bytes
from hora.core.ops import CollectiveType
from hora.core.runtime import ProcessSet


def _name(prefix: str, name: str | None, process_set: ProcessSet | int | None) -> str:
    if name is not None:
        return name
    return runtime.current().auto_name(prefix, collectives.process_set_id(process_set))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | int | None = None) -> Any:
    """Send any picklable object from ``root_rank`` to every rank of the process set and return it.

    The root returns ``obj`` itself, the others an unpickled copy.  The
    length travels first (one int64), then the bytes, each a named broadcast.
    """
    name = _name("broadcast_object", name, process_set)
    is_root = runtime.current().engine.rank == root_rank
    data = object_to_bytes(obj) if is_root else np.empty(0, np.uint8)
    size = np.array([data.size], dtype=np.int64)
    collectives.submit(CollectiveType.BROADCAST, [size], name=f"{name}.size", root=int(root_rank), inplace=True,
                       process_set=process_set, wake=False).wait()
    if not is_root:
        data = np.empty(int(size[0]), np.uint8)
    collectives.submit(CollectiveType.BROADCAST, [data], name=f"{name}.data", root=int(root_rank), inplace=True,
                       process_set=process_set, wake=False).wait()
    return obj if is_root else bytes_to_object(data)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet | int | None = None) -> list[Any]:
    """Gather one picklable object from every rank of the process set; returns them in rank order."""
    name = _name("allgather_object", name, process_set)
    data = object_to_bytes(obj)
    sizes = collectives.submit(CollectiveType.ALLGATHER, [np.array([data.size], np.int64)], name=f"{name}.sizes",
                               process_set=process_set, wake=False).wait()[0]
    gathered = collectives.submit(CollectiveType.ALLGATHER, [data], name=f"{name}.data", process_set=process_set,
                                  wake=False).wait()[0]
    return split_gathered_bytes(gathered, sizes.tolist())


__all__ = ["allgather_object", "broadcast_object"]
