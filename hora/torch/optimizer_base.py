"""What every hora optimizer wrapper shares: parameter naming and a torch optimizer that wraps another.

Both :class:`hora.torch.optimizer.DistributedOptimizer` (allreduce) and
:class:`hora.torch.kvstore_optimizer.KVStoreOptimizer` (parameter servers)
build on :class:`WrappedOptimizer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def parameter_names(params: list[torch.Tensor],
                    named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> dict[int, str]:
    """Map ``id(parameter)`` to the name its gradient travels under.

    Names come from ``named_parameters`` (usually ``model.named_parameters()``),
    which must be unique and cover every parameter of the optimizer; without
    it parameters are named ``param.<index>``.
    """
    if named_parameters is None:
        return {id(p): f"param.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names in named_parameters must be unique; duplicated: {dups}")
    ids = {id(p) for _, p in named}
    missing = [p for p in params if id(p) not in ids]
    if missing:
        raise ValueError(f"named_parameters was specified, but {len(missing)} optimizer parameter(s) are "
                         "not in it; pass model.named_parameters() of the model being optimized")
    return {id(p): n for n, p in named}


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch optimizer that wraps another and shares its state.

    The wrapped optimizer owns ``param_groups`` and ``state``; properties, not
    copies, expose them, so LR schedulers and ``state_dict()`` see one truth
    (``load_state_dict()`` replaces the wrapped optimizer's lists).
    """

    _opt: torch.optim.Optimizer
    _hooks: list
    _should_synchronize: bool

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block, ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer then behaves like the one it wraps)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @property
    def param_groups(self) -> list[dict]:
        return self._opt.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self._opt.param_groups = value

    @property
    def state(self) -> dict:
        return self._opt.state

    @state.setter
    def state(self, value: dict) -> None:
        self._opt.state = value

    @property
    def defaults(self) -> dict:
        return self._opt.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self._opt.defaults = value

    def state_dict(self) -> dict:
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self._opt.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: fall through to the wrapped optimizer.
        if name == "_opt":
            raise AttributeError(name)
        return getattr(self._opt, name)

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._opt!r})"
