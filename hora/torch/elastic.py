"""Elastic training for PyTorch (Horovod's ``hvd.elastic``): ``run``, ``TorchState``, ``ElasticSampler``.

The machinery is framework-free and lives in :mod:`hora.core.elastic`; this
module adds only what is torch: broadcasting a model's and an optimizer's
``state_dict`` from rank 0, and a sampler that repartitions the samples an
epoch has not yet seen over the ranks of each new ring.

Typical use, unchanged from Horovod::

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)
"""

from __future__ import annotations

import copy
import logging
import math
import random
from collections.abc import Callable, Iterator, Sized
from typing import Any, TypeVar

import torch

from hora.core import runtime
from hora.core.elastic import ObjectState, State, run_fn
from hora.errors import HostsUpdatedInterrupt, InternalError
from hora.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

log = logging.getLogger(__name__)

#: Horovod's name for the error a lost peer raises.
HorovodInternalError = InternalError

F = TypeVar("F", bound=Callable[..., Any])


def _reset() -> None:
    import hora.torch as hvd

    hvd.shutdown()
    hvd.init()


def run(func: F) -> F:
    """Decorate a training function ``func(state, ...)`` so that it survives lost peers and host changes.

    On :class:`HorovodInternalError` the state is restored to its last
    commit; on :class:`HostsUpdatedInterrupt` it is kept; either way the
    ring is re-formed (``shutdown()``, then ``init()`` joins the elastic
    driver's next round), every rank's state becomes rank 0's, and ``func``
    is called again.
    """
    return run_fn(func, _reset)


def _rank() -> int:
    return runtime.current().engine.rank


def _size() -> int:
    return runtime.current().engine.size


class _Handler:
    """Save/restore/sync of one torch object inside a :class:`TorchState`."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = self._snapshot()

    def _snapshot(self) -> Any:
        return copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self.saved = self._snapshot()

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        raise NotImplementedError


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def restore(self) -> None:
        clear = getattr(self.value, "clear_pending", None)
        if clear is not None:  # gradients of the failed step were in flight in the old ring
            clear()
        super().restore()

    def sync(self) -> None:
        clear = getattr(self.value, "clear_pending", None)
        if clear is not None:
            clear()
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        # processed_num counts the whole ring's samples, so rank 0's is every rank's.
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


def _handler_for(value: Any) -> _Handler | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    if isinstance(value, torch.optim.Optimizer) or (hasattr(value, "param_groups") and hasattr(value, "state_dict")):
        return _OptimizerHandler(value)
    return None


class TorchState(ObjectState):
    """Elastic state of a torch model, optimizer, samplers and plain attributes (Horovod's ``TorchState``).

    ``model`` and ``optimizer`` (and any keyword argument that is a module,
    an optimizer or an :class:`ElasticSampler`) are saved as deep copies of
    their ``state_dict``, restored with ``load_state_dict`` and synced by
    broadcast from rank 0; every other keyword argument is kept as in
    :class:`~hora.core.elastic.ObjectState`.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = None if value is None else _handler_for(value)
            if handler is not None:
                handlers[name] = handler
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=_rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name] = _handler_for(value) or handlers[name]
        object.__setattr__(self, name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()


class ElasticSampler(torch.utils.data.Sampler):
    """A sampler that deals the samples an epoch has not yet processed over the ranks of the current ring.

    Horovod's sampler, with its public attributes and their values: the
    epoch's order is a shuffle of every index with ``random.Random(seed +
    epoch)`` (the same on every rank); ``processed_num`` counts the samples
    the whole ring has processed this epoch, the first ``processed_num`` of
    that order; ``remaining_indices`` are the others, padded to
    ``total_size`` (a multiple of the ring's size) and dealt round-robin, so
    each rank iterates over ``num_samples`` of them.

    Call :meth:`set_epoch` when an epoch starts (it forgets the progress) and
    :meth:`record_batch` after every batch, and put the sampler in a
    :class:`TorchState`: a commit saves ``processed_num``, a restore goes
    back to it, and after a reset every rank takes rank 0's value and
    repartitions the remaining samples over the new ring.

    Args:
        dataset: anything with a length.
        shuffle: shuffle the indices each epoch.
        seed: base of the shuffle's seed; must agree on every rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    @property
    def processed_indices(self) -> set[int]:
        """The dataset indices processed this epoch: the first ``processed_num`` of the epoch's order."""
        return set(self._order()[:self.processed_num])

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: nothing of it is processed yet, and its order is reshuffled."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` on every rank of the ring as processed.

        ``batch_idx`` is accepted for Horovod's signature; the count is what
        matters, since the ranks deal the epoch's order round-robin.
        """
        self.processed_num += batch_size * self.num_replicas

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of this rank's batch ``batch_idx`` in the current iteration."""
        mine = self._mine()
        start = batch_idx * batch_size
        return mine[start:start + batch_size]

    def state_dict(self) -> dict[str, Any]:
        """The epoch and how many of its samples the ring has processed."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the epoch and ``processed_num`` of :meth:`state_dict`, and repartition."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Repartition the epoch's remaining samples over the current ring's ranks."""
        initialized = runtime.is_initialized()
        self.num_replicas = _size() if initialized else 1
        self.rank = _rank() if initialized else 0
        self.remaining_indices = self._order()[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def _order(self) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def _mine(self) -> list[int]:
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:
            padded += padded[:self.total_size - len(padded)]
        return padded[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        self.indices = self._mine()
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]
