"""Broadcasting models, optimizer state and Python objects (Horovod's ``functions``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hora.core import objects, runtime
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
    """Send any picklable object from the root to every rank and return it (core's, on NumPy bytes)."""
    return objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None, process_set=global_process_set) -> list[Any]:
    """Gather one picklable object from every rank; returns them in rank order (core's, on NumPy bytes)."""
    return objects.allgather_object(obj, name, process_set)


class _TensorSlot:
    """Stands for the i-th tensor of a state dict while its structure travels as a Python object."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype

    def __reduce__(self):
        return (_TensorSlot, (self.index, self.shape, self.dtype))


def _split_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a :class:`_TensorSlot`; the tensors are appended to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _split_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_split_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_split_tensors(v, tensors) for v in obj)
    return obj


def _fill_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`_split_tensors`."""
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_fill_tensors(v, tensors) for v in obj)
    return obj


def _materialize_state(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Create a fresh optimizer's per-parameter state (momentum buffers, step counts...).

    Runs one step of the optimizer itself (never the distributed wrapper, so
    no allreduce) on zero gradients, then puts the parameters and any
    existing gradients back: only the state changes.  Parameters that had no
    gradient keep the zero one, as in Horovod.
    """
    sparse_ids: set[int] = set()
    if isinstance(optimizer, torch.optim.SparseAdam):
        sparse_ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    elif model is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag) and module.sparse:
                sparse_ids.update(id(p) for p in module.parameters(recurse=False))
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved_grads = [p.grad for p in params]
    saved_params = [p.detach().clone() for p in params]
    for p in params:
        zeros = torch.zeros_like(p, memory_format=torch.contiguous_format)
        p.grad = zeros.to_sparse() if id(p) in sparse_ids else zeros
    optimizer.step()
    with torch.no_grad():
        for p, before, grad in zip(params, saved_params, saved_grads, strict=True):
            p.copy_(before)
            if grad is not None:
                p.grad = grad
            else:  # fresh zeros: some optimizers add weight decay to the gradient in place
                p.grad.zero_()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set=global_process_set) -> None:
    """Give every rank the root's optimizer state and hyper-parameters.

    The root's ``state_dict()`` (per-parameter state such as momentum buffers
    and step counts, and each group's options such as ``lr``) is loaded on
    every rank, with Python types preserved.  Its structure travels as one
    pickled object and its tensors by in-place broadcasts.  A fresh optimizer
    (no state yet) first creates its state, as in Horovod, so that ranks
    agree on it; parameters are not changed.

    Args:
        optimizer: a torch optimizer or a :func:`DistributedOptimizer`.
        root_rank: the rank whose state everyone gets.
        model: optional; its sparse embeddings get sparse zero gradients when
            the state has to be created.
        process_set: broadcast within this process set only.

    Raises:
        ValueError: for ``torch.optim.LBFGS``, whose state is not per-parameter.
    """
    from hora.torch.optimizer import _DistributedOptimizer

    local = optimizer._opt if isinstance(optimizer, _DistributedOptimizer) else optimizer
    if isinstance(local, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state does not support torch.optim.LBFGS (its state is not "
                         "per-parameter); broadcast the model and recreate LBFGS on every rank instead")
    if not local.state_dict()["state"]:
        _materialize_state(local, model)
    rt = runtime.current()
    is_root = rt.engine.rank == root_rank
    tensors: list[torch.Tensor] = []
    skeleton = _split_tensors(local.state_dict(), tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state", process_set=process_set)
    if not is_root:
        slots: list[_TensorSlot] = []
        _collect_slots(skeleton, slots)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in sorted(slots, key=lambda s: s.index)]
    handles = [
        mpi_ops.broadcast_async_(t if t.is_contiguous() else t.contiguous(), root_rank,
                                 name=f"broadcast_optimizer_state.{i}", process_set=process_set)
        for i, t in enumerate(tensors)
    ]
    for h in handles:
        mpi_ops.synchronize(h)
    if not is_root:
        local.load_state_dict(_fill_tensors(skeleton, tensors))
    if local is not optimizer:  # a stateful compressor's step and factors travel too
        optimizer.sync_compression(root_rank)


def _collect_slots(obj: Any, out: list[_TensorSlot]) -> None:
    if isinstance(obj, _TensorSlot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _collect_slots(v, out)
