"""MXNet-style KVStore on PyTorch tensors and NumPy arrays.

``create(name)`` returns a store of one of the types MXNet users know:

=======================  ================================================================
``local``                one process; values of a key pushed from several devices are
                         summed on the CPU, then the updater runs once.
``device``               as ``local``, but the sum is computed on the devices themselves.
``dist_sync``            parameter servers (start them with ``hora run -s S``); a server
                         waits for every worker's push of a key before it updates.
``dist_device_sync``     ``dist_sync`` with the per-process sum done on the devices.
``dist_async``           parameter servers; every push is applied on arrival.
``dist_sync_allreduce``  the same API carried by hora's allreduce engine; no servers.
=======================  ================================================================
"""

from __future__ import annotations

from typing import Any

from hora.kvstore import lr_scheduler, optimizer
from hora.kvstore.base import KVStore
from hora.kvstore.lr_scheduler import FactorScheduler, LRScheduler, MultiFactorScheduler, PolyScheduler
from hora.kvstore.optimizer import SGD, Adam, Optimizer, Updater, create_updater

TYPES = ("local", "device", "dist_sync", "dist_device_sync", "dist_async", "dist_sync_allreduce")


def create(name: str = "local", **kwargs: Any) -> KVStore:
    """Create a KVStore of type ``name`` (one of :data:`TYPES`).

    Keyword arguments go to the store's constructor (for example
    ``work_load_list`` for ``local``/``device``).
    """
    from hora.errors import ConfigError

    if not isinstance(name, str) or name not in TYPES:
        raise ConfigError(f"unknown KVStore type {name!r}; valid types are: {', '.join(TYPES)}")
    if name in ("local", "device"):
        from hora.kvstore.local import LocalKVStore

        return LocalKVStore(name, **kwargs)
    if name == "dist_sync_allreduce":
        from hora.kvstore.allreduce import AllreduceKVStore

        return AllreduceKVStore(name, **kwargs)
    from hora.kvstore.dist import DistKVStore

    return DistKVStore(name, **kwargs)


def __getattr__(name: str) -> Any:
    # DataParallelTrainer needs torch; import it only when asked for, so that NumPy-only users
    # (and parameter servers) never load torch.
    if name == "DataParallelTrainer":
        from hora.kvstore.trainer import DataParallelTrainer

        return DataParallelTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KVStore", "TYPES", "create", "optimizer", "lr_scheduler", "Optimizer", "SGD", "Adam", "Updater",
           "create_updater", "LRScheduler", "FactorScheduler", "MultiFactorScheduler", "PolyScheduler",
           "DataParallelTrainer"]
