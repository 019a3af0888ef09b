"""An ``mx.optimizer`` as the equivalent :mod:`hora.kvstore.optimizer`, so that it can travel to the servers as data.

MXNet pickles the optimizer object to its servers; hora sends its name, its
hyperparameters, its lr scheduler and its lr/wd multipliers, read from the
object's attributes, and the servers rebuild it from their own registry.  What
MXNet's server would see is what is sent: ``param_dict`` (gluon Parameters'
``lr_mult``/``wd_mult``) is dropped by MXNet's pickling, so it is not sent
either; multipliers given by parameter name are resolved to keys through
``param_idx2name`` as MXNet's optimizer resolves them.
"""

from __future__ import annotations

import logging
from typing import Any

import mxnet as mx

from hora.errors import ConfigError
from hora.kvstore import lr_scheduler as hsched
from hora.kvstore import optimizer as hopt

log = logging.getLogger(__name__)

#: hora field -> the mx.optimizer attribute that holds it, where the names differ.
_RENAMED = {"adagrad": {"eps": "float_stable_eps"}}

_WAYS_OUT = ("run it on the workers instead (gluon.Trainer(..., update_on_kvstore=False), or the 'hora' allreduce "
             "store), or write it as a hora.kvstore.optimizer.Optimizer subclass registered with "
             "hora.kvstore.optimizer.register in a module that HORA_PS_OPTIMIZER_MODULES names (the servers and "
             "workers import it, an explicit and auditable choice)")


def _builtin_class(optimizer: Any) -> bool:
    cls = type(optimizer)
    return cls.__module__.startswith("mxnet.") and cls.__name__.lower() in hopt.BUILTIN


def scheduler_of(scheduler: Any) -> hsched.LRScheduler | None:
    """An ``mx.lr_scheduler`` scheduler as hora's, built from its constructor arguments.

    It starts afresh from the ``base_lr`` it was built with (MXNet's
    ``warmup_final_lr``), as the servers' update counts do; the optimizer's
    ``learning_rate`` then overrides ``base_lr`` exactly as it did in MXNet.
    A schedule that already advanced on the worker is not carried over: set
    the optimizer on the servers before training, as ``gluon.Trainer`` does.

    Raises:
        ConfigError: a scheduler class of the user's own, which cannot travel.
    """
    if scheduler is None:
        return None
    kind = type(scheduler).__name__
    warmup = {"warmup_steps": int(scheduler.warmup_steps), "warmup_begin_lr": float(scheduler.warmup_begin_lr),
              "warmup_mode": scheduler.warmup_mode}
    base = float(scheduler.warmup_final_lr)
    if not type(scheduler).__module__.startswith("mxnet."):
        kind = ""
    if kind == "FactorScheduler":
        out: hsched.LRScheduler = hsched.FactorScheduler(step=int(scheduler.step), factor=float(scheduler.factor),
                                                         stop_factor_lr=float(scheduler.stop_factor_lr),
                                                         base_lr=base, **warmup)
    elif kind == "MultiFactorScheduler":
        out = hsched.MultiFactorScheduler(step=[int(s) for s in scheduler.step], factor=float(scheduler.factor),
                                          base_lr=base, **warmup)
    elif kind == "PolyScheduler":
        out = hsched.PolyScheduler(max_update=int(scheduler.max_update), base_lr=float(scheduler.base_lr_orig),
                                   pwr=float(scheduler.power), final_lr=float(scheduler.final_lr), **warmup)
    elif kind == "CosineScheduler":
        out = hsched.CosineScheduler(max_update=int(scheduler.max_update), base_lr=float(scheduler.base_lr_orig),
                                     final_lr=float(scheduler.final_lr), **warmup)
    else:
        raise ConfigError(f"the lr scheduler {type(scheduler).__module__}.{type(scheduler).__name__} cannot travel "
                          "to hora's parameter servers (they rebuild MXNet's Factor, MultiFactor, Poly and Cosine "
                          "schedulers from their arguments; nothing is unpickled)")
    return out


def _multipliers(optimizer: Any, table: dict) -> dict[str, float]:
    """MXNet's per-index multipliers, with name-keyed ones resolved through ``idx2name`` where MXNet does."""
    out = {str(k): float(v) for k, v in table.items()}
    for index, name in getattr(optimizer, "idx2name", {}).items():
        if index not in table and name in table:
            out[str(index)] = float(table[name])
    return out


def hora_optimizer_of(optimizer: Any) -> hopt.Optimizer:
    """The hora optimizer that computes what ``optimizer`` (an ``mx.optimizer.Optimizer``) computes on MXNet's servers.

    Raises:
        ConfigError: a user's own Optimizer subclass (the message names the
            two ways out), a scheduler that cannot travel, or an invalid value.
    """
    if isinstance(optimizer, hopt.Optimizer):
        return optimizer
    if not isinstance(optimizer, mx.optimizer.Optimizer):
        raise ConfigError(f"set_optimizer takes an mx.optimizer.Optimizer or a hora one, got "
                          f"{type(optimizer).__name__}")
    name = type(optimizer).__name__.lower()
    cls = hopt.BUILTIN.get(name) if _builtin_class(optimizer) else None
    if cls is None:
        custom = hopt.registry.lookup(name)
        if custom is None or custom in hopt.BUILTIN.values():
            raise ConfigError(f"{type(optimizer).__module__}.{type(optimizer).__name__} is an optimizer of your own, "
                              "which hora's parameter servers cannot run: MXNet pickles optimizers to its servers, "
                              f"hora sends only data and runs code the servers have. Either {_WAYS_OUT}")
        cls = custom
    if optimizer.param_dict and any(p.lr_mult != 1 or p.wd_mult != 1 for p in optimizer.param_dict.values()):
        log.warning("gluon Parameters' lr_mult/wd_mult do not reach the parameter servers (MXNet's own servers drop "
                    "them too, with param_dict, when the optimizer is pickled); set them with "
                    "optimizer.set_lr_mult/set_wd_mult by key index instead")
    renamed = _RENAMED.get(cls.type_name, {})
    fields: dict[str, Any] = {}
    for field in cls._HYPER:
        attr = renamed.get(field, field)
        if cls is hopt.LBSGD and field == "begin_epoch":
            per_epoch = int(optimizer.updates_per_epoch)
            fields[field] = int(optimizer.init_updates) // per_epoch if per_epoch else 0
            continue
        if not hasattr(optimizer, attr):
            raise ConfigError(f"{type(optimizer).__name__} has no attribute {attr!r}, which hora's "
                              f"{cls.__name__} needs")
        value = getattr(optimizer, attr)
        fields[field] = value if isinstance(value, (bool, str)) or value is None else float(value)
    for field in ("warmup_epochs", "batch_scale", "updates_per_epoch", "num_epochs"):
        if field in fields:
            fields[field] = int(fields[field])
    scheduler = scheduler_of(optimizer.lr_scheduler)
    common = {"learning_rate": None if optimizer.lr is None else float(optimizer.lr), "wd": float(optimizer.wd),
              "rescale_grad": float(optimizer.rescale_grad),
              "clip_gradient": None if optimizer.clip_gradient is None else float(optimizer.clip_gradient),
              "lr_scheduler": scheduler, "begin_num_update": int(optimizer.begin_num_update),
              "multi_precision": bool(optimizer.multi_precision),
              "lr_mult": _multipliers(optimizer, optimizer.lr_mult),
              "wd_mult": _multipliers(optimizer, optimizer.wd_mult)}
    try:
        out = cls(**fields, **common)
    except TypeError as e:
        raise ConfigError(f"{type(optimizer).__name__}: {e}") from e
    return out


__all__ = ["hora_optimizer_of", "scheduler_of"]
