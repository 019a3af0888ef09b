"""Broadcasting models, optimizer state and Python objects (Horovod's ``functions``)."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import cloudpickle
import torch

from hora.core import runtime
from hora.core.runtime import global_process_set
from hora.torch import mpi_ops


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int,
                         prefix: str | None = None, process_set=global_process_set) -> None:
    """Overwrite every rank's parameters with the root's, in place.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.
        root_rank: the rank whose values everyone gets.
        prefix: optional name prefix, to keep names unique across models.
    """
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    handles = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a tensor")
        full = f"{prefix or ''}broadcast.{name}"
        handles.append(mpi_ops.broadcast_async_(p, root_rank, name=full, process_set=process_set))
    for h in handles:
        mpi_ops.synchronize(h)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set=global_process_set) -> Any:
    """Send any picklable object from the root to every rank and return it."""
    rt = runtime.current()
    name = name or rt.auto_name("broadcast_object")
    if rt.engine.rank == root_rank:
        payload = cloudpickle.dumps(obj)
        size = torch.tensor([len(payload)], dtype=torch.int64)
    else:
        payload = b""
        size = torch.zeros(1, dtype=torch.int64)
    mpi_ops.broadcast_(size, root_rank, name=f"{name}.size", process_set=process_set)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
            else torch.empty(int(size), dtype=torch.uint8))
    mpi_ops.broadcast_(data, root_rank, name=f"{name}.data", process_set=process_set)
    if rt.engine.rank == root_rank:
        return obj
    return cloudpickle.loads(data.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set=global_process_set) -> list[Any]:
    """Gather one picklable object from every rank; returns them in rank order."""
    rt = runtime.current()
    name = name or rt.auto_name("allgather_object")
    payload = cloudpickle.dumps(obj)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    sizes = mpi_ops.allgather(torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sizes",
                              process_set=process_set)
    gathered = mpi_ops.allgather(data, name=f"{name}.data", process_set=process_set).numpy().tobytes()
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(cloudpickle.loads(gathered[offset : offset + n]))
        offset += n
    return out


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set=global_process_set) -> None:
    """Give every rank the root's optimizer state and hyper-parameters.

    The root's whole ``state_dict()`` (per-parameter state such as momentum
    buffers and step counts, and each group's options such as ``lr``) is
    loaded on every rank, with Python types preserved.  Parameters are not
    touched.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state does not support LBFGS (its state is not per-parameter)")
    rt = runtime.current()
    if rt.engine.rank == root_rank:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        blob = buf.getvalue()
    else:
        blob = None
    blob = broadcast_object(blob, root_rank, name="broadcast_optimizer_state", process_set=process_set)
    if rt.engine.rank != root_rank:
        state = torch.load(io.BytesIO(blob), weights_only=False)
        optimizer.load_state_dict(state)
