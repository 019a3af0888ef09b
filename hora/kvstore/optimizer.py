"""Optimizers that run inside a KVStore (locally or on parameter servers), with MXNet 1.9's rules.

The classes keep MXNet's names and arguments (``mx.optimizer.SGD``,
``mx.optimizer.Adam``, :func:`create`), and the update arithmetic follows
MXNet 1.9's kernels operation by operation, in the weight's dtype, so that
results agree to the last bit wherever the floating-point operations agree:

* **SGD** (``multi_sgd_update`` / ``sgd_mom_update``, MXNet's default path for
  dense arrays): ``g = clip(rescale_grad * grad)`` when clipping, and then
  ``mom = momentum * mom - (lr * wd) * w - lr * g``; ``w += mom``.  Without
  clipping the gradient term is ``(lr * rescale_grad) * grad``.  Without
  momentum there is no state and ``w += -(lr * wd) * w - lr * g``.
* **Adam** (``adam_update``): ``g = rescale_grad * grad + wd * w``, then
  clipped; ``mean = beta1 * mean + (1 - beta1) * g``;
  ``var = beta2 * var + (1 - beta2) * g * g``;
  ``w -= lr_t * mean / (sqrt(var) + epsilon)`` with the bias correction folded
  into the rate as MXNet does: ``lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)``,
  ``t`` being the key's own update count.

Clipping is on when ``clip_gradient`` is a positive number (MXNet ignores
``None``, 0 and negative values).  Update counts are kept per key and
``num_update`` is their maximum, which is what a learning-rate scheduler sees
(MXNet's rule); a key's count is bumped before its rate is read.

Deviations from MXNet, on purpose: sparse (row_sparse) gradients and
``lazy_update`` do not exist here (``lazy_update`` is accepted and ignored);
``param_idx2name``/``sym`` are not taken, so the automatic ``wd_mult = 0`` for
names not ending in ``_weight``/``_gamma`` does not happen (set
:meth:`Optimizer.set_wd_mult` explicitly).

The same code updates NumPy arrays and torch tensors (CPU or CUDA) without
importing torch: the few operations that differ (clip, sqrt, zeros, copy)
dispatch on the array type.  Optimizers travel as :meth:`Optimizer.spec`
dicts of plain data; :func:`create_updater` validates one and returns an
:class:`Updater`, whose state is saved in a msgpack format (raw array bytes
plus dtype and shape, never a pickle).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import numpy as np

from hora.errors import ConfigError
from hora.kvstore.arrays import converted as _astype
from hora.kvstore.arrays import copy_into as _copy_into
from hora.kvstore.arrays import is_numpy as _is_numpy
from hora.kvstore.arrays import numpy_of as to_numpy
from hora.kvstore.lr_scheduler import (
    FactorScheduler,
    LRScheduler,
    MultiFactorScheduler,
    PolyScheduler,
    _number,
    scheduler_from_spec,
)

Array = Any  # numpy.ndarray | torch.Tensor


# ----------------------------------------------------------------------------- array ops
def _np_dtype(x: Array) -> np.dtype:
    """The NumPy dtype whose arithmetic the update uses (float32 for bfloat16 tensors)."""
    if _is_numpy(x):
        return x.dtype
    name = str(x.dtype).removeprefix("torch.")
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(np.float32)


def _is_float(x: Array) -> bool:
    if _is_numpy(x):
        return x.dtype.kind == "f"
    return bool(x.dtype.is_floating_point)


def _in(dt: np.dtype, *values: float) -> float:
    """Product of ``values``, each rounded to ``dt`` and multiplied in ``dt`` (as MXNet's DType scalars)."""
    acc = dt.type(values[0])
    for v in values[1:]:
        acc = dt.type(acc * dt.type(v))
    return float(acc)


def _one_minus(dt: np.dtype, value: float) -> float:
    return float(dt.type(dt.type(1) - dt.type(value)))


def _clip(x: Array, bound: float) -> Array:
    if _is_numpy(x):
        return np.clip(x, -bound, bound, out=x)
    return x.clamp_(-bound, bound)


def _sqrt(x: Array) -> Array:
    return np.sqrt(x) if _is_numpy(x) else x.sqrt()


def _zeros_like(x: Array) -> Array:
    return np.zeros_like(x) if _is_numpy(x) else x.new_zeros(x.shape)


_BLOCK = 65536  # elements per block of a fused update: its five blocks of float32 (1.25 MiB) stay in cache


def _fusable(weight: Array, grad: Array, *states: Array | None) -> bool:
    """True when a NumPy update may run block by block: contiguous float arrays of one shape and dtype."""
    if not _is_numpy(weight) or not _is_numpy(grad) or weight.dtype.kind != "f":
        return False
    arrays = [weight, grad, *[s for s in states if s is not None]]
    return all(_is_numpy(a) and a.dtype == weight.dtype and a.shape == weight.shape and a.flags.c_contiguous
               for a in arrays) and all(a.flags.writeable for a in arrays if a is not grad)


# ------------------------------------------------------------------------------ optimizers
class Optimizer:
    """Base class of the KVStore optimizers (MXNet's ``mx.optimizer.Optimizer``).

    Args:
        learning_rate: the rate; ``None`` means 0.01, or the scheduler's
            ``base_lr`` when a scheduler is given.  When both are given and
            differ, ``learning_rate`` overrides the scheduler's ``base_lr``.
        wd: weight decay, added to the gradient as ``wd * weight``.
        rescale_grad: the gradient is multiplied by this first (often 1/batch).
        clip_gradient: clip the rescaled gradient to ``[-c, c]`` when ``c > 0``.
        lr_scheduler: an :class:`~hora.kvstore.lr_scheduler.LRScheduler` (or its spec).
        begin_num_update: the update count to start from.
        multi_precision: keep a float32 master copy of float16 weights.
        lr_mult, wd_mult: per-key multipliers of the rate and the decay.
    """

    type_name = ""
    _HYPER: tuple[str, ...] = ()  # subclass fields that belong in spec()

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
        self.clip_gradient = None if clip_gradient is None else _number("clip_gradient", clip_gradient)
        self.begin_num_update = _number("begin_num_update", begin_num_update, minimum=0, integer=True)
        if not isinstance(multi_precision, bool):
            raise ConfigError(f"multi_precision must be a bool, got {multi_precision!r}")
        self.multi_precision = multi_precision
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

    def _get_lr(self, index: str) -> float:
        lr = self.lr_scheduler(self.num_update) if self.lr_scheduler is not None else self.lr
        return lr * self.lr_mult.get(index, 1.0)

    def _get_wd(self, index: str) -> float:
        return self.wd * self.wd_mult.get(index, 1.0)

    def _clipping(self) -> bool:
        return bool(self.clip_gradient) and self.clip_gradient >= 0

    # --- states and updates -----------------------------------------------------------------------
    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        """The per-key state arrays for ``weight`` (empty for stateless rules)."""
        return {}

    def create_state_multi_precision(self, index: str, weight: Array) -> dict[str, Array]:
        """:meth:`create_state`, plus a float32 master copy of a float16 weight under ``multi_precision``."""
        if self.multi_precision and _np_dtype(weight) == np.float16:
            master = weight.astype(np.float32) if _is_numpy(weight) else weight.float()
            return {"weight32": master, **self.create_state(index, master)}
        return self.create_state(index, weight)

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        """Apply one update to ``weight`` in place."""
        raise NotImplementedError

    def update_multi_precision(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        """:meth:`update`, through the float32 master copy when the state has one."""
        master = state.get("weight32")
        if master is None:
            self.update(index, weight, grad, state)
            return
        inner = {k: v for k, v in state.items() if k != "weight32"}
        self.update(index, master, _astype(grad, master), inner)
        state.update(inner)
        _copy_into(weight, master)


class SGD(Optimizer):
    """Stochastic gradient descent with momentum and weight decay (MXNet's ``sgd``).

    ``mom = momentum * mom - lr * (wd * w + clip(rescale_grad * grad))``; ``w += mom``.
    """

    type_name = "sgd"
    _HYPER = ("momentum", "lazy_update")

    def __init__(self, learning_rate: float | None = None, momentum: float = 0.0, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None,
                 lr_scheduler: LRScheduler | Mapping | None = None, lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, wd=wd, rescale_grad=rescale_grad,
                         clip_gradient=clip_gradient, lr_scheduler=lr_scheduler, **kwargs)
        self.momentum = _number("momentum", momentum, minimum=0)
        if not isinstance(lazy_update, bool):
            raise ConfigError(f"lazy_update must be a bool, got {lazy_update!r}")
        self.lazy_update = lazy_update

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"mom": _zeros_like(weight)} if self.momentum != 0.0 else {}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        dt = _np_dtype(weight)
        mom = state.get("mom")
        if _fusable(weight, grad, mom):
            self._update_numpy(weight, grad, mom, lr, wd, dt)
            return
        if self._clipping():
            g = grad * _in(dt, self.rescale_grad)
            g = _clip(g, _in(dt, self.clip_gradient))
            g *= _in(dt, lr)
        else:
            g = grad * _in(dt, lr, self.rescale_grad)
        decay = weight * _in(dt, lr, wd)
        if mom is not None:
            mom *= _in(dt, self.momentum)
            mom -= decay
            mom -= g
            weight += mom
        else:
            decay += g
            weight -= decay

    def _update_numpy(self, weight: np.ndarray, grad: np.ndarray, mom: np.ndarray | None, lr: float, wd: float,
                      dt: np.dtype) -> None:
        """:meth:`update`'s operations, in the same order and dtype (so the same bits), run block by block
        into two scratch blocks: each block of the weight, gradient and momentum is read from memory once
        and stays in cache for all its operations, and no array of the weight's size is allocated."""
        w, g, m = weight.reshape(-1), grad.reshape(-1), None if mom is None else mom.reshape(-1)
        clipping = self._clipping()
        if clipping:
            rescale, bound, scale = _in(dt, self.rescale_grad), _in(dt, self.clip_gradient), _in(dt, lr)
        else:
            scale = _in(dt, lr, self.rescale_grad)
        decay_scale, momentum = _in(dt, lr, wd), _in(dt, self.momentum)
        block = min(w.size, _BLOCK)
        t_buf, d_buf = np.empty(block, dt), np.empty(block, dt)
        for lo in range(0, w.size, block):
            hi = min(w.size, lo + block)
            wb, t, d = w[lo:hi], t_buf[:hi - lo], d_buf[:hi - lo]
            if clipping:
                np.multiply(g[lo:hi], rescale, out=t)
                np.clip(t, -bound, bound, out=t)
                np.multiply(t, scale, out=t)
            else:
                np.multiply(g[lo:hi], scale, out=t)
            np.multiply(wb, decay_scale, out=d)
            if m is not None:
                mb = m[lo:hi]
                np.multiply(mb, momentum, out=mb)
                np.subtract(mb, d, out=mb)
                np.subtract(mb, t, out=mb)
                np.add(wb, mb, out=wb)
            else:
                np.add(d, t, out=d)
                np.subtract(wb, d, out=wb)


class Adam(Optimizer):
    """Adam (MXNet's ``adam``): L2 weight decay in the gradient, bias correction folded into the rate."""

    type_name = "adam"
    _HYPER = ("beta1", "beta2", "epsilon", "lazy_update")

    def __init__(self, learning_rate: float | None = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: LRScheduler | Mapping | None = None,
                 lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, wd=wd, rescale_grad=rescale_grad,
                         clip_gradient=clip_gradient, lr_scheduler=lr_scheduler, **kwargs)
        self.beta1 = _number("beta1", beta1, minimum=0)
        self.beta2 = _number("beta2", beta2, minimum=0)
        for name, b in (("beta1", self.beta1), ("beta2", self.beta2)):
            if b >= 1:
                raise ConfigError(f"{name} must be in [0, 1), got {b}")
        self.epsilon = _number("epsilon", epsilon, minimum=0)
        if not isinstance(lazy_update, bool):
            raise ConfigError(f"lazy_update must be a bool, got {lazy_update!r}")
        self.lazy_update = lazy_update

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"mean": _zeros_like(weight), "var": _zeros_like(weight)}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        t = self._index_update_count[index]
        lr *= math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        dt = _np_dtype(weight)
        g = grad * _in(dt, self.rescale_grad)
        g += weight * _in(dt, wd)
        if self._clipping():
            g = _clip(g, _in(dt, self.clip_gradient))
        mean, var = state["mean"], state["var"]
        mean *= _in(dt, self.beta1)
        mean += g * _one_minus(dt, self.beta1)
        var *= _in(dt, self.beta2)
        g2 = g * _one_minus(dt, self.beta2)
        g2 *= g
        var += g2
        step = mean * _in(dt, lr)
        den = _sqrt(var)
        den += _in(dt, self.epsilon)
        step /= den
        weight -= step


OPTIMIZERS: dict[str, type[Optimizer]] = {cls.type_name: cls for cls in (SGD, Adam)}

_BASE_FIELDS = {"learning_rate", "wd", "rescale_grad", "clip_gradient", "lr_scheduler", "begin_num_update",
                "multi_precision", "lr_mult", "wd_mult"}


def create(name: str, **kwargs: Any) -> Optimizer:
    """Create an optimizer by name, case-insensitively (MXNet's ``mx.optimizer.create``).

    Raises:
        ConfigError: the name is unknown (the valid ones are listed) or an
            argument is invalid.
    """
    if isinstance(name, Optimizer):
        return name
    cls = OPTIMIZERS.get(name.lower()) if isinstance(name, str) else None
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
    cls = OPTIMIZERS.get(kind.lower()) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigError(f"unknown optimizer type {kind!r}; valid types are: {', '.join(OPTIMIZERS)}")
    args = {k: v for k, v in spec.items() if k != "type"}
    valid = _BASE_FIELDS | set(cls._HYPER)
    unknown = sorted(map(str, set(args) - valid))
    if unknown:
        raise ConfigError(f"optimizer {cls.type_name!r} has no field(s) {unknown}; valid fields: {sorted(valid)}")
    for name in ("lr_mult", "wd_mult"):
        if args.get(name) is not None and not isinstance(args[name], Mapping):
            raise ConfigError(f"{name} must be a dict of key -> multiplier, got {type(args[name]).__name__}")
    return cls(**args)


# ------------------------------------------------------------------------------- updater
_STATE_FORMAT = "hora-kvstore-updater"
_STATE_VERSION = 1
_ARRAY_KINDS = "fiub"


def _pack_array(x: Array) -> dict[str, Any]:
    a = np.ascontiguousarray(to_numpy(x))
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def _unpack_array(d: Any, where: str) -> np.ndarray:
    if not isinstance(d, Mapping) or set(d) != {"dtype", "shape", "data"}:
        raise ConfigError(f"optimizer state {where}: expected an array record with dtype, shape and data")
    try:
        dtype = np.dtype(d["dtype"])
    except TypeError as e:
        raise ConfigError(f"optimizer state {where}: bad dtype {d['dtype']!r}") from e
    shape = d["shape"]
    if dtype.kind not in _ARRAY_KINDS or not isinstance(shape, list) or not all(
            isinstance(s, int) and s >= 0 for s in shape) or not isinstance(d["data"], bytes):
        raise ConfigError(f"optimizer state {where}: bad array record (dtype {dtype}, shape {shape!r})")
    if len(d["data"]) != dtype.itemsize * math.prod(shape):
        raise ConfigError(f"optimizer state {where}: {len(d['data'])} bytes do not hold a {dtype} array of "
                          f"shape {tuple(shape)}")
    return np.frombuffer(d["data"], dtype=dtype).reshape(shape).copy()


class Updater:
    """Applies an optimizer to stored values, keeping each key's state (MXNet's ``get_updater``).

    ``updater(key, grad, weight)`` updates ``weight`` in place.  Arrays may be
    NumPy arrays or torch tensors; a key's state lives beside its weight.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if not isinstance(optimizer, Optimizer):
            raise ConfigError(f"Updater needs a hora.kvstore.optimizer.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.states: dict[str, dict[str, Array]] = {}
        self._restored: set[str] = set()  # keys whose state came from bytes and awaits its weight

    def __call__(self, key: str, grad: Array, weight: Array) -> None:
        """Apply one update for ``key``: ``weight`` changes in place, the key's state advances."""
        key = str(key)
        if tuple(grad.shape) != tuple(weight.shape):
            raise ConfigError(f"key {key!r}: gradient shape {tuple(grad.shape)} does not match the weight's "
                              f"{tuple(weight.shape)}")
        if not _is_float(weight):
            raise ConfigError(f"key {key!r}: optimizers update floating-point values, but this key holds "
                              f"{weight.dtype}; store it as a float or push it without an optimizer")
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = self.optimizer.create_state_multi_precision(key, weight)
        elif key in self._restored or _misplaced(state, weight):
            self._conform(key, state, weight)
            self._restored.discard(key)
        self.optimizer.update_multi_precision(key, weight, _astype(grad, weight), state)

    def _conform(self, key: str, state: dict[str, Array], weight: Array) -> None:
        # Restored states are NumPy arrays in the saved dtype: move them beside the weight, in the
        # dtype the update runs in (float32 under a multi-precision master copy).
        wide = "weight32" in state
        for name, value in state.items():
            if _is_numpy(weight):
                dtype = np.dtype(np.float32) if wide else weight.dtype
                state[name] = np.array(to_numpy(value), dtype=dtype, copy=True)
            else:
                tensor = weight.new_tensor(to_numpy(value))
                state[name] = tensor.float() if wide else tensor.to(weight.dtype)

    # --- per-key state --------------------------------------------------------------------------
    def key_states(self, key: str) -> dict[str, np.ndarray]:
        """The key's state arrays as NumPy arrays, plus ``num_update``: its update count (0-d int64)."""
        key = str(key)
        out = {name: to_numpy(v).copy() for name, v in self.states.get(key, {}).items()}
        out["num_update"] = np.array(self.optimizer._index_update_count.get(key, 0), dtype=np.int64)
        return out

    def set_key_states(self, key: str, states: Mapping[str, np.ndarray]) -> None:
        """Replace the key's state with ``states`` (as :meth:`key_states` returns them)."""
        key = str(key)
        states = dict(states)
        count = states.pop("num_update", None)
        if count is not None:
            self.optimizer._index_update_count[key] = int(np.asarray(count))
            self.optimizer.num_update = max(self.optimizer.num_update, int(np.asarray(count)))
        self.states[key] = {name: to_numpy(v).copy() for name, v in states.items()}
        self._restored.add(key)

    # --- whole state ----------------------------------------------------------------------------
    def get_states(self, dump_optimizer: bool = False) -> bytes:
        """Every key's state and update count as bytes (msgpack; the optimizer's spec when asked)."""
        opt = self.optimizer
        doc = {
            "format": _STATE_FORMAT, "version": _STATE_VERSION,
            "optimizer": opt.spec() if dump_optimizer else None,
            "num_update": opt.num_update,
            "counts": dict(opt._index_update_count),
            "states": {k: {n: _pack_array(v) for n, v in s.items()} for k, s in self.states.items()},
        }
        return msgpack.packb(doc, use_bin_type=True)

    def set_states(self, data: bytes) -> None:
        """Restore what :meth:`get_states` wrote; an included optimizer spec replaces the optimizer.

        Raises:
            ConfigError: the bytes are not an updater state (truncated,
                another format, or a malformed record).
        """
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types
            raise ConfigError(f"not a hora optimizer-state file: {e}") from e
        if not isinstance(doc, Mapping) or doc.get("format") != _STATE_FORMAT:
            raise ConfigError("not a hora optimizer-state file (missing its format marker)")
        if doc.get("version") != _STATE_VERSION:
            raise ConfigError(f"optimizer-state version {doc.get('version')!r} is not supported "
                              f"(this hora reads version {_STATE_VERSION})")
        counts, states = doc.get("counts"), doc.get("states")
        if not isinstance(counts, Mapping) or not isinstance(states, Mapping):
            raise ConfigError("optimizer-state file is malformed: counts/states are not maps")
        new_states = {}
        for key, arrays in states.items():
            if not isinstance(arrays, Mapping):
                raise ConfigError(f"optimizer state of key {key!r} is malformed")
            new_states[str(key)] = {str(n): _unpack_array(a, f"{key}/{n}") for n, a in arrays.items()}
        new_counts = {str(k): _number(f"update count of key {k!r}", v, minimum=0, integer=True)
                      for k, v in counts.items()}
        num_update = _number("num_update", doc.get("num_update", 0), minimum=0, integer=True)
        if doc.get("optimizer") is not None:
            self.optimizer = optimizer_from_spec(doc["optimizer"])
        self.optimizer._index_update_count = new_counts
        self.optimizer.num_update = max(num_update, self.optimizer.begin_num_update)
        self.states = new_states
        self._restored = set(new_states)


def _misplaced(state: dict[str, Array], weight: Array) -> bool:
    """True when the state lives elsewhere than the weight (the weight moved to another device)."""
    if not state or _is_numpy(weight):
        return False
    first = next(iter(state.values()))
    return _is_numpy(first) or first.device != weight.device


def create_updater(spec: Mapping[str, Any] | Optimizer) -> Updater:
    """An :class:`Updater` for an optimizer spec (or an :class:`Optimizer`).

    Raises:
        ConfigError: the spec is invalid; the message names the bad type or field.
    """
    optimizer = spec if isinstance(spec, Optimizer) else optimizer_from_spec(spec)
    return Updater(optimizer)


def updater_for(optimizer: Optimizer | Mapping[str, Any] | str) -> Updater:
    """An :class:`Updater` for what ``set_optimizer`` accepts: an Optimizer, its spec dict, or a name.

    Raises:
        ConfigError: anything else, or an invalid spec or name.
    """
    if isinstance(optimizer, Optimizer):
        return Updater(optimizer)
    if isinstance(optimizer, Mapping):
        return create_updater(optimizer)
    if isinstance(optimizer, str):
        return Updater(create(optimizer))
    raise ConfigError(f"set_optimizer takes an Optimizer, its spec dict or a name, got {type(optimizer).__name__}")


def get_updater(optimizer: Optimizer) -> Callable[[str, Array, Array], None]:
    """MXNet's ``mx.optimizer.get_updater``: an :class:`Updater` around ``optimizer``."""
    return Updater(optimizer)


__all__ = ["Optimizer", "SGD", "Adam", "OPTIMIZERS", "create", "optimizer_from_spec", "create_updater",
           "get_updater", "updater_for", "Updater", "LRScheduler", "FactorScheduler", "MultiFactorScheduler",
           "PolyScheduler", "to_numpy"]
