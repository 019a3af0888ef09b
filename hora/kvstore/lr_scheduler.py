"""Learning-rate schedules with MXNet 1.9's names, arguments and arithmetic.

A scheduler maps ``num_update`` (the largest number of updates any key has
received, as MXNet counts it) to a learning rate.  Like MXNet's, the
schedulers keep a little state (the decayed ``base_lr``) and catch up with a
``while`` loop, so a fresh scheduler handed a large ``num_update`` (after a
restore) returns the same rate as one that saw every step.

Every scheduler describes itself as plain data with :meth:`LRScheduler.spec`
(its constructor arguments), which is how a schedule travels to parameter
servers: as data, never as a pickle.  :func:`scheduler_from_spec` rebuilds it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from hora.errors import ConfigError

log = logging.getLogger(__name__)

_WARMUP_MODES = ("linear", "constant")


def _number(name: str, value: Any, *, minimum: float | None = None, integer: bool = False) -> float:
    """Check that ``value`` is a finite real number (an int when ``integer``), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if integer and not (isinstance(value, int) or float(value).is_integer()):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value) if integer else float(value)


class LRScheduler:
    """Base class: a learning rate as a function of the update count, with optional warmup.

    Args:
        base_lr: the rate after warmup.
        warmup_steps: number of updates spent warming up (0: none).
        warmup_begin_lr: the rate at update 0 of the warmup.
        warmup_mode: ``linear`` (ramp from ``warmup_begin_lr`` to ``base_lr``)
            or ``constant`` (stay at ``warmup_begin_lr``).
    """

    type_name = ""

    def __init__(self, base_lr: float = 0.01, warmup_steps: int = 0, warmup_begin_lr: float = 0.0,
                 warmup_mode: str = "linear") -> None:
        self.base_lr = _number("base_lr", base_lr)
        self.warmup_steps = _number("warmup_steps", warmup_steps, minimum=0, integer=True)
        self.warmup_begin_lr = _number("warmup_begin_lr", warmup_begin_lr)
        self.warmup_final_lr = self.base_lr
        if self.warmup_begin_lr > self.warmup_final_lr:
            raise ConfigError(f"warmup_begin_lr ({warmup_begin_lr}) must not exceed base_lr ({base_lr})")
        if warmup_mode not in _WARMUP_MODES:
            raise ConfigError(f"warmup_mode must be one of {_WARMUP_MODES}, got {warmup_mode!r}")
        self.warmup_mode = warmup_mode

    def get_warmup_lr(self, num_update: int) -> float:
        """The rate during warmup (``num_update < warmup_steps``)."""
        if self.warmup_mode == "linear":
            step = (self.warmup_final_lr - self.warmup_begin_lr) * float(num_update) / float(self.warmup_steps)
            return self.warmup_begin_lr + step
        return self.warmup_begin_lr

    def __call__(self, num_update: int) -> float:
        raise NotImplementedError

    def _warmup_spec(self) -> dict[str, Any]:
        return {"warmup_steps": self.warmup_steps, "warmup_begin_lr": self.warmup_begin_lr,
                "warmup_mode": self.warmup_mode}

    def spec(self) -> dict[str, Any]:
        """The constructor arguments as plain data (msgpack/JSON-able), with ``type``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.spec().items() if k != "type")
        return f"{type(self).__name__}({args})"


class FactorScheduler(LRScheduler):
    """Multiply the rate by ``factor`` every ``step`` updates, never going below ``stop_factor_lr``.

    ``lr = base_lr * factor ** floor((num_update - 1) / step)``, clamped at
    ``stop_factor_lr`` (MXNet's rule: the rate changes once ``num_update``
    exceeds a multiple of ``step``).
    """

    type_name = "factor"

    def __init__(self, step: int, factor: float = 1.0, stop_factor_lr: float = 1e-8, base_lr: float = 0.01,
                 warmup_steps: int = 0, warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self._base_lr_arg = self.base_lr
        self.step = _number("step", step, minimum=1, integer=True)
        self.factor = _number("factor", factor)
        if self.factor > 1.0:
            raise ConfigError(f"factor must be at most 1 so that the rate decreases, got {factor}")
        self.stop_factor_lr = _number("stop_factor_lr", stop_factor_lr)
        self.count = 0

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        while num_update > self.count + self.step:
            self.count += self.step
            self.base_lr *= self.factor
            if self.base_lr < self.stop_factor_lr:
                self.base_lr = self.stop_factor_lr
                log.debug("update %d: learning rate reached its floor %.5e", num_update, self.base_lr)
            else:
                log.debug("update %d: learning rate now %.5e", num_update, self.base_lr)
        return self.base_lr

    def spec(self) -> dict[str, Any]:
        return {"type": self.type_name, "step": self.step, "factor": self.factor,
                "stop_factor_lr": self.stop_factor_lr, "base_lr": self._base_lr_arg, **self._warmup_spec()}


class MultiFactorScheduler(LRScheduler):
    """Multiply the rate by ``factor`` each time ``num_update`` passes one of the increasing ``step`` values."""

    type_name = "multifactor"

    def __init__(self, step: list[int], factor: float = 1.0, base_lr: float = 0.01, warmup_steps: int = 0,
                 warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self._base_lr_arg = self.base_lr
        if not isinstance(step, (list, tuple)) or not step:
            raise ConfigError(f"step must be a non-empty list of increasing update counts, got {step!r}")
        steps = [_number(f"step[{i}]", s, minimum=1, integer=True) for i, s in enumerate(step)]
        for i in range(1, len(steps)):
            if steps[i] <= steps[i - 1]:
                raise ConfigError(f"step must be strictly increasing, got {list(step)}")
        self.step = steps
        self.factor = _number("factor", factor)
        if self.factor > 1.0:
            raise ConfigError(f"factor must be at most 1 so that the rate decreases, got {factor}")
        self.cur_step_ind = 0
        self.count = 0

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        while self.cur_step_ind < len(self.step):
            if num_update <= self.step[self.cur_step_ind]:
                return self.base_lr
            self.count = self.step[self.cur_step_ind]
            self.cur_step_ind += 1
            self.base_lr *= self.factor
            log.debug("update %d: learning rate now %.5e", num_update, self.base_lr)
        return self.base_lr

    def spec(self) -> dict[str, Any]:
        return {"type": self.type_name, "step": list(self.step), "factor": self.factor,
                "base_lr": self._base_lr_arg, **self._warmup_spec()}


class PolyScheduler(LRScheduler):
    """Polynomial decay from ``base_lr`` to ``final_lr`` over ``max_update`` updates.

    ``lr = final_lr + (base_lr - final_lr) * (1 - (n - warmup) / (max_update - warmup)) ** pwr``
    for ``n <= max_update``, then constant.  As in MXNet, the curve uses the
    ``base_lr`` given to the constructor, even if an optimizer's
    ``learning_rate`` later overrides the scheduler's ``base_lr``.
    """

    type_name = "poly"

    def __init__(self, max_update: int, base_lr: float = 0.01, pwr: float = 2, final_lr: float = 0.0,
                 warmup_steps: int = 0, warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.max_update = _number("max_update", max_update, minimum=1, integer=True)
        self.power = _number("pwr", pwr)
        self.final_lr = _number("final_lr", final_lr)
        self.base_lr_orig = self.base_lr
        self.max_steps = self.max_update - self.warmup_steps
        if self.max_steps < 1:
            raise ConfigError(f"max_update ({max_update}) must exceed warmup_steps ({warmup_steps})")

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update <= self.max_update:
            frac = 1.0 - float(num_update - self.warmup_steps) / float(self.max_steps)
            self.base_lr = self.final_lr + (self.base_lr_orig - self.final_lr) * pow(frac, self.power)
        return self.base_lr

    def spec(self) -> dict[str, Any]:
        return {"type": self.type_name, "max_update": self.max_update, "base_lr": self.base_lr_orig,
                "pwr": self.power, "final_lr": self.final_lr, **self._warmup_spec()}


class CosineScheduler(LRScheduler):
    """Cosine decay from ``base_lr`` to ``final_lr`` over ``max_update`` updates (after any warmup).

    ``lr = final_lr + (base_lr - final_lr) * (1 + cos(pi * (n - warmup) / (max_update - warmup))) / 2``
    for ``n <= max_update``, then constant; like :class:`PolyScheduler` it
    uses the ``base_lr`` given to the constructor.
    """

    type_name = "cosine"

    def __init__(self, max_update: int, base_lr: float = 0.01, final_lr: float = 0.0, warmup_steps: int = 0,
                 warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.max_update = _number("max_update", max_update, minimum=1, integer=True)
        self.final_lr = _number("final_lr", final_lr)
        self.base_lr_orig = self.base_lr
        self.max_steps = self.max_update - self.warmup_steps

    def __call__(self, num_update: int) -> float:
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update <= self.max_update:
            phase = math.pi * (num_update - self.warmup_steps) / self.max_steps
            self.base_lr = self.final_lr + (self.base_lr_orig - self.final_lr) * (1 + math.cos(phase)) / 2
        return self.base_lr

    def spec(self) -> dict[str, Any]:
        return {"type": self.type_name, "max_update": self.max_update, "base_lr": self.base_lr_orig,
                "final_lr": self.final_lr, **self._warmup_spec()}


SCHEDULERS: dict[str, type[LRScheduler]] = {
    cls.type_name: cls for cls in (FactorScheduler, MultiFactorScheduler, PolyScheduler, CosineScheduler)
}

_FIELDS = {
    "factor": {"step", "factor", "stop_factor_lr", "base_lr", "warmup_steps", "warmup_begin_lr", "warmup_mode"},
    "multifactor": {"step", "factor", "base_lr", "warmup_steps", "warmup_begin_lr", "warmup_mode"},
    "poly": {"max_update", "base_lr", "pwr", "final_lr", "warmup_steps", "warmup_begin_lr", "warmup_mode"},
    "cosine": {"max_update", "base_lr", "final_lr", "warmup_steps", "warmup_begin_lr", "warmup_mode"},
}


def scheduler_from_spec(spec: Mapping[str, Any]) -> LRScheduler:
    """Rebuild a scheduler from :meth:`LRScheduler.spec` output.

    Raises:
        ConfigError: ``spec`` is not a dict, names an unknown type, or has a
            field the type does not take (the message names it).
    """
    if not isinstance(spec, Mapping):
        raise ConfigError(f"an lr_scheduler spec must be a dict, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind not in SCHEDULERS:
        raise ConfigError(f"unknown lr_scheduler type {kind!r}; valid types are: {', '.join(SCHEDULERS)}")
    args = {k: v for k, v in spec.items() if k != "type"}
    unknown = sorted(set(args) - _FIELDS[kind])
    if unknown:
        raise ConfigError(f"lr_scheduler {kind!r} has no field(s) {unknown}; valid fields: {sorted(_FIELDS[kind])}")
    try:
        return SCHEDULERS[kind](**args)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"lr_scheduler {kind!r}: {e}") from e


__all__ = ["LRScheduler", "FactorScheduler", "MultiFactorScheduler", "PolyScheduler", "CosineScheduler", "SCHEDULERS",
           "scheduler_from_spec"]
