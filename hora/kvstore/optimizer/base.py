"""The optimizer base class and the array arithmetic every update rule shares.

MXNet's update kernels compute element by element in the weight's dtype, with
their scalar arguments (rate, decay, betas) first rounded to that dtype; its
Python-level rules (AdaGrad, Nadam...) chain NDArray operations, each rounded
to the dtype.  Here the same operations run in NumPy, in the same order and
dtype, so results agree to the last bit: :func:`scalar` rounds a Python number
to the dtype, :func:`blockwise` runs an element-wise rule over cache-sized
blocks (same operations, same bits, much less memory traffic), and
:func:`sum_sq` is MXNet's CPU ``multi_sum_sq`` (a sequential float32 sum, the
same bits from vector operations: :mod:`.ordered_sum`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hora.errors import ConfigError
from hora.kvstore.arrays import converted as _astype
from hora.kvstore.arrays import copy_into as _copy_into
from hora.kvstore.arrays import is_numpy as _is_numpy
from hora.kvstore.arrays import math_pool
from hora.kvstore.lr_scheduler import LRScheduler, _number, scheduler_from_spec
from hora.kvstore.optimizer.ordered_sum import ordered_add

Array = Any  # numpy.ndarray | torch.Tensor

BLOCK = 65536  # elements per block of a blockwise update: a few float32 blocks stay in cache


# ----------------------------------------------------------------------------- array ops
def np_dtype(x: Array) -> np.dtype:
    """The NumPy dtype whose arithmetic the update uses (float32 for bfloat16 tensors)."""
    if _is_numpy(x):
        return x.dtype
    name = str(x.dtype).removeprefix("torch.")
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(np.float32)


def is_float(x: Array) -> bool:
    """True for a floating-point array or tensor."""
    if _is_numpy(x):
        return x.dtype.kind == "f"
    return bool(x.dtype.is_floating_point)


def scalar(dt: np.dtype, value: float) -> np.floating:
    """``value`` rounded to ``dt``: how MXNet hands a Python number to a kernel or an NDArray operation."""
    return dt.type(value)


def product(dt: np.dtype, *values: float) -> float:
    """Product of ``values``, each rounded to ``dt`` and multiplied in ``dt`` (as a kernel's DType scalars)."""
    acc = dt.type(values[0])
    for v in values[1:]:
        acc = dt.type(acc * dt.type(v))
    return float(acc)


def one_minus(dt: np.dtype, value: float) -> float:
    """``1 - value`` computed in ``dt`` (a kernel's ``1.f - beta``)."""
    return float(dt.type(dt.type(1) - dt.type(value)))


def clip_kernel(x: np.ndarray, bound: np.floating) -> np.ndarray:
    """A kernel's ``clip::Map(x, bound)`` (``bound >= 0``), in place."""
    return np.clip(x, -bound, bound, out=x)


def clip_op(x: np.ndarray, lo: np.floating, hi: np.floating) -> np.ndarray:
    """The NDArray ``clip(x, lo, hi)`` operator: above ``hi`` gives ``hi``, else below ``lo`` gives ``lo``.

    The same as ``np.clip`` when ``lo <= hi``; MXNet's Python rules pass
    ``-c, c`` for any ``c`` that is not None, so a negative ``c`` reaches here.
    """
    if lo <= hi:
        return np.clip(x, lo, hi)
    return np.where(x > hi, hi, np.where(x < lo, lo, x)).astype(x.dtype, copy=False)


def sign(x: np.ndarray) -> np.ndarray:
    """A kernel's ``(x > 0) - (x < 0)`` in ``x``'s dtype (0 for NaN, unlike ``np.sign``)."""
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


def blockwise(fn: Callable[..., None], *arrays: np.ndarray | None, scratch: int | Sequence[Any] = 0,
              scratch_dtype: Any = None, parallel: bool = True) -> None:
    """Run the element-wise rule ``fn(*blocks, *scratch_blocks)`` over the flat arrays, block by block.

    ``None`` entries pass through as ``None``.  Each block of every array is
    read from memory once and stays in cache for all of the rule's operations;
    the operations and their order are the rule's own, so the bits are too.
    ``scratch`` buffers of a block's length (in ``scratch_dtype``, default the
    first array's dtype; or one per dtype when ``scratch`` lists dtypes) are
    handed to every call, so a rule written with ``out=`` allocates nothing
    per block.  A large array is cut into a few
    contiguous runs of blocks that threads update at once (NumPy releases the
    GIL): the result does not depend on it, since every element is updated
    alone.  A rule whose blocks must come in order (a running sum) passes
    ``parallel=False``.
    """
    flat = [None if a is None else a.reshape(-1) for a in arrays]
    first = next(a for a in flat if a is not None)
    n = first.size
    block = max(1, min(n, BLOCK))
    dtypes = [scratch_dtype or first.dtype] * scratch if isinstance(scratch, int) else list(scratch)

    def run(lo: int, hi: int) -> None:
        bufs = [np.empty(min(block, hi - lo), dt) for dt in dtypes]
        for start in range(lo, hi, block):
            end = min(hi, start + block)
            fn(*[None if a is None else a[start:end] for a in flat], *[b[:end - start] for b in bufs])

    runs = min(_THREADS, n // (PARALLEL_BLOCKS * block)) if parallel else 1
    if runs <= 1:
        run(0, n)
        return
    per = -(-n // runs // block) * block  # whole blocks per run
    futures = [math_pool().submit(run, lo, min(n, lo + per)) for lo in range(0, n, per)]
    for f in futures:
        f.result()


PARALLEL_BLOCKS = 8  # an array of fewer blocks than this per thread is updated by the calling thread alone
_THREADS = max(1, min(4, os.cpu_count() or 1))


def moments(g: np.ndarray, m: np.ndarray, v: np.ndarray, b1: np.floating, b1c: np.floating, b2: np.floating,
            b2c: np.floating, scratch: np.ndarray) -> None:
    """Adam's and LAMB's ``m = b1*m + (1-b1)*g`` and ``v = b2*v + ((1-b2)*g)*g``, in place, in the kernels' order."""
    m *= b1
    np.multiply(g, b1c, out=scratch)
    m += scratch
    v *= b2
    np.multiply(g, b2c, out=scratch)
    scratch *= g
    v += scratch


def sum_sq(x: np.ndarray) -> np.float32:
    """MXNet's CPU ``multi_sum_sq`` of one array: ``sum += x[i] * x[i]`` in float32, in order."""
    acc = SumSq()
    blockwise(acc.add, x, scratch=3, scratch_dtype=np.float32, parallel=False)
    return acc.total


class SumSq:
    """A running ``multi_sum_sq``: :meth:`add` takes consecutive blocks in order; ``total`` is the float32 sum.

    Each block's squares are added to the running total in order, with the
    bits of the sequential loop (:func:`~hora.kvstore.optimizer.ordered_sum.ordered_add`),
    without an array of the input's size.
    """

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = np.float32(0)

    def add(self, x: np.ndarray, scratch: np.ndarray, scratch2: np.ndarray, scratch3: np.ndarray) -> None:
        """Add the squares of the block ``x`` (``scratch*``: float32 buffers of its length)."""
        if x.size == 0:
            return
        if x.dtype == np.float32:
            np.multiply(x, x, out=scratch)
        else:  # a float16 square rounds to float16 first, as the kernel's half_t product does
            np.copyto(scratch, x * x, casting="unsafe")
        self.total = ordered_add(self.total, scratch, scratch2, scratch3)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else a ConfigError naming ``name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be a bool, got {value!r}")
    return value


def check_fraction(name: str, value: Any) -> float:
    """A number in ``[0, 1)`` (a decay rate such as ``beta1``)."""
    v = _number(name, value, minimum=0)
    if v >= 1:
        raise ConfigError(f"{name} must be in [0, 1), got {v}")
    return v


def optional_number(name: str, value: Any) -> float | None:
    """None, or a finite number."""
    return None if value is None else _number(name, value)


# ------------------------------------------------------------------------------ optimizers
class Optimizer:
    """Base class of the KVStore optimizers (MXNet's ``mx.optimizer.Optimizer``).

    Args:
        learning_rate: the rate; ``None`` means 0.01, or the scheduler's
            ``base_lr`` when a scheduler is given.  When both are given and
            differ, ``learning_rate`` overrides the scheduler's ``base_lr``.
        wd: weight decay, added to the gradient as ``wd * weight``.
        rescale_grad: the gradient is multiplied by this first (often 1/batch).
        clip_gradient: clip the rescaled gradient to ``[-c, c]``.
        lr_scheduler: an :class:`~hora.kvstore.lr_scheduler.LRScheduler` (or its spec).
        begin_num_update: the update count to start from.
        multi_precision: keep a float32 master copy of float16 weights.
        lr_mult, wd_mult: per-key multipliers of the rate and the decay.

    A subclass sets ``type_name`` (its registry name), ``_HYPER`` (its own
    constructor fields, which :meth:`spec` carries) and ``_SHARED`` (attributes
    that MXNet keeps once per optimizer rather than per key, such as Nadam's
    momentum schedule; they are saved with every key's state).  Rules written
    for NumPy only (``numpy_only``) update torch tensors through a host copy.
    """

    type_name = ""
    _HYPER: tuple[str, ...] = ()
    _SHARED: tuple[str, ...] = ()
    numpy_only = True

    def __init__(self, learning_rate: float | None = None, wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: LRScheduler | Mapping | None = None,
                 begin_num_update: int = 0, multi_precision: bool = False,
                 lr_mult: Mapping[Any, float] | None = None, wd_mult: Mapping[Any, float] | None = None) -> None:
        if isinstance(lr_scheduler, Mapping):
            lr_scheduler = scheduler_from_spec(lr_scheduler)
        if lr_scheduler is not None and not isinstance(lr_scheduler, LRScheduler):
            raise ConfigError(f"lr_scheduler must be an LRScheduler or its spec, got {type(lr_scheduler).__name__}")
        self.lr_scheduler = lr_scheduler
        if lr_scheduler is None and learning_rate is None:
            learning_rate = 0.01
        self.lr = None if learning_rate is None else _number("learning_rate", learning_rate, minimum=0)
        if lr_scheduler is not None and self.lr is not None and lr_scheduler.base_lr != self.lr:
            lr_scheduler.base_lr = self.lr  # MXNet: the optimizer's learning_rate wins
        self.wd = _number("wd", wd)
        self.rescale_grad = _number("rescale_grad", rescale_grad)
        self.clip_gradient = optional_number("clip_gradient", clip_gradient)
        self.begin_num_update = _number("begin_num_update", begin_num_update, minimum=0, integer=True)
        self.multi_precision = check_bool("multi_precision", multi_precision)
        self.num_update = self.begin_num_update
        self._index_update_count: dict[str, int] = {}
        self.lr_mult: dict[str, float] = {}
        self.wd_mult: dict[str, float] = {}
        self.set_lr_mult(lr_mult or {})
        self.set_wd_mult(wd_mult or {})

    # --- spec ---------------------------------------------------------------------------------
    def spec(self) -> dict[str, Any]:
        """Plain data describing this optimizer (msgpack-able); :func:`create_updater` takes it."""
        out: dict[str, Any] = {"type": self.type_name, "learning_rate": self.lr, "wd": self.wd,
                               "rescale_grad": self.rescale_grad, "clip_gradient": self.clip_gradient,
                               "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.spec(),
                               "begin_num_update": self.begin_num_update, "multi_precision": self.multi_precision,
                               "lr_mult": dict(self.lr_mult), "wd_mult": dict(self.wd_mult)}
        for name in self._HYPER:
            out[name] = getattr(self, name)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()})"

    # --- rates -------------------------------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        """The current rate (the scheduler's value at ``num_update`` when there is one)."""
        if self.lr_scheduler is not None:
            return self.lr_scheduler(self.num_update)
        return self.lr

    def set_learning_rate(self, lr: float) -> None:
        """Set a new rate; an error when a scheduler owns the rate (as in MXNet)."""
        if self.lr_scheduler is not None:
            raise ConfigError("this optimizer has an lr_scheduler, which sets the learning rate; "
                              "set_learning_rate() only works without one")
        self.lr = _number("learning_rate", lr, minimum=0)

    def set_lr_mult(self, args_lr_mult: Mapping[Any, float]) -> None:
        """Per-key learning-rate multipliers (keys as in the KVStore; int keys match their str form)."""
        self.lr_mult = {str(k): _number(f"lr_mult[{k!r}]", v) for k, v in dict(args_lr_mult).items()}

    def set_wd_mult(self, args_wd_mult: Mapping[Any, float]) -> None:
        """Per-key weight-decay multipliers."""
        self.wd_mult = {str(k): _number(f"wd_mult[{k!r}]", v) for k, v in dict(args_wd_mult).items()}

    def _update_count(self, index: str) -> None:
        count = self._index_update_count.get(index, self.begin_num_update) + 1
        self._index_update_count[index] = count
        self.num_update = max(count, self.num_update)

    def _begin(self, index: str) -> tuple[float, float, int]:
        """Count an update of ``index``, then return its rate, decay and count (most rules' order in MXNet)."""
        self._update_count(index)
        return self._get_lr(index), self._get_wd(index), self._index_update_count.get(index, 0)

    def _base_lr(self) -> float:
        return self.lr_scheduler(self.num_update) if self.lr_scheduler is not None else self.lr

    def _get_lr(self, index: str) -> float:
        return self._base_lr() * self.lr_mult.get(index, 1.0)

    def _get_wd(self, index: str) -> float:
        return self.wd * self.wd_mult.get(index, 1.0)

    def _clipping(self) -> bool:
        """Whether a kernel clips: MXNet passes ``clip_gradient`` only when truthy, and kernels clip at >= 0."""
        return bool(self.clip_gradient) and self.clip_gradient >= 0

    def _rescaled(self, grad: np.ndarray, dt: np.dtype, weight: np.ndarray | None = None,
                  decay: np.floating | None = None) -> np.ndarray:
        """The Python rules' ``grad * rescale_grad`` (``+ weight * decay`` when given), then
        ``clip(-c, c)`` whenever ``clip_gradient`` is not None."""
        g = grad * scalar(dt, self.rescale_grad)
        if weight is not None:
            g = g + weight * decay
        if self.clip_gradient is not None:
            c = scalar(dt, self.clip_gradient)
            g = clip_op(g, -c, c)
        return g

    # --- shared state ---------------------------------------------------------------------------
    def shared_state(self) -> dict[str, float]:
        """The attributes MXNet keeps once per optimizer (``_SHARED``), as plain numbers."""
        return {name: getattr(self, name) for name in self._SHARED}

    def set_shared_state(self, values: Mapping[str, float]) -> None:
        """Restore what :meth:`shared_state` returned (unknown names are ignored)."""
        for name in self._SHARED:
            if name in values:
                setattr(self, name, None if values[name] is None else float(values[name]))

    # --- states and updates -----------------------------------------------------------------------
    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        """The per-key state arrays for ``weight`` (empty for stateless rules)."""
        return {}

    def create_state_multi_precision(self, index: str, weight: Array) -> dict[str, Array]:
        """:meth:`create_state`, plus a float32 master copy of a float16 weight under ``multi_precision``."""
        if self.multi_precision and np_dtype(weight) == np.float16:
            master = weight.astype(np.float32) if _is_numpy(weight) else weight.float()
            return {"weight32": master, **self.create_state(index, master)}
        return self.create_state(index, weight)

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        """Apply one update to ``weight`` in place."""
        raise NotImplementedError

    def update_multi_precision(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        """:meth:`update`, through the float32 master copy when the state has one."""
        self._through_master(self.update, index, weight, grad, state)

    def _through_master(self, rule: Callable[[str, Array, Array, dict[str, Array]], None], index: str,
                        weight: Array, grad: Array, state: dict[str, Array]) -> None:
        """Run ``rule`` on the float32 master copy when the state has one (MXNet's
        ``update_multi_precision``), then cast it back into ``weight``; else on ``weight`` itself."""
        master = state.get("weight32")
        if master is None:
            rule(index, weight, grad, state)
            return
        inner = {k: v for k, v in state.items() if k != "weight32"}
        rule(index, master, _astype(grad, master), inner)
        state.update(inner)
        _copy_into(weight, master)

    # --- row_sparse gradients -----------------------------------------------------------------------
    def lazy_rows(self) -> bool:
        """Whether a row_sparse gradient updates only its rows (MXNet has a lazy or sparse kernel for it).

        When False, the server scatters the rows into a zero gradient and runs the dense rule over the whole
        key, which is what MXNet does for an optimizer without such a kernel.  When True, the rule must
        update each element from that element's weight, gradient and state alone (no norms).
        """
        return False

    def update_rows(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        """The lazy update of the pushed rows (``weight``, ``grad`` and ``state`` hold just those rows).

        By default the dense rule, which is MXNet's lazy kernel for SGD, Adam and Ftrl; AdaGrad overrides
        it with MXNet's sparse kernel, whose arithmetic differs from its dense rule.
        """
        self.update_multi_precision(index, weight, grad, state)


def zeros_like(x: Array, dtype: Any = None) -> Array:
    """Zeros of ``x``'s shape, in ``dtype`` (default: ``x``'s), NumPy or torch as ``x``."""
    if _is_numpy(x):
        return np.zeros(x.shape, dtype or x.dtype)
    return x.new_zeros(x.shape) if dtype is None else x.new_zeros(x.shape, dtype=_torch_dtype(dtype))


def _torch_dtype(dtype: Any) -> Any:
    import torch

    return getattr(torch, np.dtype(dtype).name)


def _libm_powf() -> Callable[[float, float], float] | None:
    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        fn = libm.powf
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_float, (ctypes.c_float, ctypes.c_float)
    return fn


_POWF = _libm_powf()


def powf(base: np.float32, exp: np.float32) -> np.float32:
    """C's ``powf``, which MXNet's float kernels call: NumPy's float32 power differs in the last bit
    on some versions, so the C library's own is called where it can be found."""
    if _POWF is None:
        return np.float32(np.power(np.float32(base), np.float32(exp)))
    return np.float32(_POWF(float(base), float(exp)))




__all__ = ["Optimizer", "Array", "BLOCK", "np_dtype", "is_float", "scalar", "product", "one_minus", "clip_kernel",
           "clip_op", "sign", "blockwise", "moments", "sum_sq", "SumSq", "check_bool", "check_fraction",
           "optional_number", "zeros_like", "powf"]
