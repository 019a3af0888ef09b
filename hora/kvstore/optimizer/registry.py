"""The optimizers the stores know by name: MXNet 1.9.1's eighteen, plus any a job registers explicitly.

An optimizer travels to the parameter servers as its :meth:`Optimizer.spec`
(a name and plain numbers), and a server rebuilds it from this registry, so
only code that is installed and named runs there; nothing is unpickled.  A
user's own rule joins the registry with :func:`register` in a module that the
job lists in ``HORA_PS_OPTIMIZER_MODULES`` (read by
:func:`hora.config.ps_optimizer_modules`): every server and worker imports
those modules before looking a name up.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from typing import Any

from hora.config import ps_optimizer_modules
from hora.errors import ConfigError
from hora.kvstore.optimizer.adaptive import FTML, AdaDelta, AdaGrad, Adam, Adamax, Ftrl, Nadam, RMSProp
from hora.kvstore.optimizer.base import Optimizer
from hora.kvstore.optimizer.lamb import LAMB
from hora.kvstore.optimizer.misc import DCASGD, SGLD, Test
from hora.kvstore.optimizer.sgd import LARS, LBSGD, NAG, SGD, Signum, ccSGD

#: MXNet 1.9.1's registered optimizers, by their registry names.
BUILTIN: dict[str, type[Optimizer]] = {cls.type_name: cls for cls in (
    SGD, Signum, FTML, LARS, LBSGD, LAMB, DCASGD, NAG, SGLD, ccSGD, Adam, AdaGrad, RMSProp, AdaDelta, Ftrl,
    Adamax, Nadam, Test)}

OPTIMIZERS: dict[str, type[Optimizer]] = dict(BUILTIN)

_BASE_FIELDS = {"learning_rate", "wd", "rescale_grad", "clip_gradient", "lr_scheduler", "begin_num_update",
                "multi_precision", "lr_mult", "wd_mult"}
_loaded: set[str] = set()
_lock = threading.Lock()


def register(cls: type[Optimizer]) -> type[Optimizer]:
    """Add an :class:`Optimizer` subclass to the registry under its ``type_name`` (usable as a decorator).

    Raises:
        ConfigError: not an Optimizer subclass, no ``type_name``, or the name
            of one of MXNet's optimizers (which cannot be replaced).
    """
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise ConfigError(f"register() takes a hora.kvstore.optimizer.Optimizer subclass, got {cls!r}")
    name = cls.type_name.lower() if isinstance(cls.type_name, str) else ""
    if not name:
        raise ConfigError(f"{cls.__name__} needs a type_name (the name workers and servers know it by)")
    if name in BUILTIN and BUILTIN[name] is not cls:
        raise ConfigError(f"{name!r} is MXNet's {BUILTIN[name].__name__}; register {cls.__name__} under another name")
    OPTIMIZERS[name] = cls
    return cls


def load_modules() -> None:
    """Import the modules named in ``HORA_PS_OPTIMIZER_MODULES`` (once each).

    Raises:
        ConfigError: a module cannot be imported (the message names it and the variable).
    """
    for name in ps_optimizer_modules():
        with _lock:
            if name in _loaded:
                continue
            try:
                importlib.import_module(name)
            except Exception as e:
                raise ConfigError(f"HORA_PS_OPTIMIZER_MODULES names {name!r}, which does not import here: "
                                  f"{type(e).__name__}: {e}") from e
            _loaded.add(name)


def lookup(name: Any) -> type[Optimizer] | None:
    """The class registered as ``name`` (case-insensitive), after importing the job's modules; None if none."""
    if not isinstance(name, str):
        return None
    cls = OPTIMIZERS.get(name.lower())
    if cls is None:
        load_modules()
        cls = OPTIMIZERS.get(name.lower())
    return cls


def create(name: str | Optimizer, **kwargs: Any) -> Optimizer:
    """Create an optimizer by name, case-insensitively (MXNet's ``mx.optimizer.create``).

    Raises:
        ConfigError: the name is unknown (the valid ones are listed) or an
            argument is invalid.
    """
    if isinstance(name, Optimizer):
        return name
    cls = lookup(name)
    if cls is None:
        raise ConfigError(f"unknown optimizer {name!r}; valid optimizers are: {', '.join(OPTIMIZERS)}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # an argument the optimizer does not take
        raise ConfigError(f"optimizer {cls.type_name!r}: {e}") from e


def optimizer_from_spec(spec: Mapping[str, Any]) -> Optimizer:
    """Rebuild an optimizer from :meth:`Optimizer.spec` output, checking every field.

    Raises:
        ConfigError: not a dict, an unknown ``type``, or a field the type does
            not take; the message names it and lists the valid ones.
    """
    if not isinstance(spec, Mapping):
        raise ConfigError(f"an optimizer spec must be a dict, got {type(spec).__name__}")
    kind = spec.get("type")
    cls = lookup(kind)
    if cls is None:
        raise ConfigError(f"unknown optimizer type {kind!r}; valid types are: {', '.join(OPTIMIZERS)} (a rule of "
                          "your own runs on the servers once registered in a module named by "
                          "HORA_PS_OPTIMIZER_MODULES)")
    args = {k: v for k, v in spec.items() if k != "type"}
    valid = _BASE_FIELDS | set(cls._HYPER)
    unknown = sorted(map(str, set(args) - valid))
    if unknown:
        raise ConfigError(f"optimizer {cls.type_name!r} has no field(s) {unknown}; valid fields: {sorted(valid)}")
    for name in ("lr_mult", "wd_mult"):
        if args.get(name) is not None and not isinstance(args[name], Mapping):
            raise ConfigError(f"{name} must be a dict of key -> multiplier, got {type(args[name]).__name__}")
    try:
        return cls(**args)
    except TypeError as e:
        raise ConfigError(f"optimizer {cls.type_name!r}: {e}") from e


__all__ = ["BUILTIN", "OPTIMIZERS", "register", "load_modules", "lookup", "create", "optimizer_from_spec"]
