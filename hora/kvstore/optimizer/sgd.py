"""The SGD family: SGD (and its old alias ccSGD), NAG, Signum, LARS and LBSGD, as MXNet 1.9 computes them.

On a server MXNet's updater hands the optimizer one key at a time, so SGD and
LARS take their "aggregated" path (``multi_sgd_update``, ``multi_lars`` and
``preloaded_multi_sgd_update``) for one array; LBSGD, NAG and Signum call
their single-array kernels.  Each rule below is that kernel's arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from hora.errors import ConfigError
from hora.kvstore.arrays import is_numpy as _is_numpy
from hora.kvstore.lr_scheduler import LRScheduler, _number
from hora.kvstore.optimizer.base import (
    Array,
    Optimizer,
    blockwise,
    check_bool,
    clip_kernel,
    np_dtype,
    one_minus,
    product,
    scalar,
    sign,
    sum_sq,
    zeros_like,
)


def _clip(x: Array, bound: float) -> Array:
    if _is_numpy(x):
        return np.clip(x, -bound, bound, out=x)
    return x.clamp_(-bound, bound)


def _fusable(weight: Array, grad: Array, *states: Array | None) -> bool:
    """True when a NumPy update may run block by block: contiguous float arrays of one shape and dtype."""
    if not _is_numpy(weight) or not _is_numpy(grad) or weight.dtype.kind != "f":
        return False
    arrays = [weight, grad, *[s for s in states if s is not None]]
    return all(_is_numpy(a) and a.dtype == weight.dtype and a.shape == weight.shape and a.flags.c_contiguous
               for a in arrays) and all(a.flags.writeable for a in arrays if a is not grad)


class SGD(Optimizer):
    """Stochastic gradient descent with momentum and weight decay (MXNet's ``sgd``, ``multi_sgd_update``).

    ``mom = momentum * mom - (lr * wd) * w - lr * clip(rescale_grad * grad)``;
    ``w += mom``.  Without clipping the gradient term is
    ``(lr * rescale_grad) * grad``; without momentum there is no state.  This
    rule also updates torch tensors (CPU or CUDA) in place.
    """

    type_name = "sgd"
    _HYPER = ("momentum", "lazy_update")
    numpy_only = False

    def __init__(self, learning_rate: float | None = None, momentum: float = 0.0, wd: float = 0.0,
                 rescale_grad: float = 1.0, clip_gradient: float | None = None,
                 lr_scheduler: LRScheduler | Mapping | None = None, lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, wd=wd, rescale_grad=rescale_grad,
                         clip_gradient=clip_gradient, lr_scheduler=lr_scheduler, **kwargs)
        self.momentum = _number("momentum", momentum, minimum=0)
        self.lazy_update = check_bool("lazy_update", lazy_update)

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"mom": zeros_like(weight)} if self.momentum != 0.0 else {}

    def lazy_rows(self) -> bool:
        """MXNet's ``sgd_update``/``sgd_mom_update`` take row_sparse gradients lazily when ``lazy_update``."""
        return self.lazy_update

    def update_rows(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        """The lazy update of the pushed rows.  With momentum, MXNet's lazy ``sgd_mom_update`` does the dense
        rule's arithmetic; without, its sparse ``sgd_update`` computes ``(1 - lr*wd) * w - (lr*rescale) * g``
        (``lr * clip(rescale * g)`` when clipping), which rounds differently from the dense rule."""
        if state.get("mom") is not None or "weight32" in state or not (_is_numpy(weight) and _is_numpy(grad)):
            super().update_rows(index, weight, grad, state)
            return
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        dt = np_dtype(weight)
        keep = dt.type(one_minus(dt, product(dt, lr, wd)))
        clipping = self._clipping()
        if clipping:
            rescale, bound, s_lr = (dt.type(product(dt, self.rescale_grad)), dt.type(product(dt, self.clip_gradient)),
                                    dt.type(product(dt, lr)))
        else:
            scale = dt.type(product(dt, lr, self.rescale_grad))

        def rule(w: np.ndarray, g: np.ndarray, t: np.ndarray) -> None:
            if clipping:
                np.multiply(g, rescale, out=t)
                clip_kernel(t, bound)
                t *= s_lr
            else:
                np.multiply(g, scale, out=t)
            w *= keep
            w -= t

        blockwise(rule, weight, grad, scratch=1)

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        self._update_count(index)
        self._step(weight, grad, state.get("mom"), self._get_lr(index), self._get_wd(index), self.momentum)

    def _step(self, weight: Array, grad: Array, mom: Array | None, lr: float, wd: float, momentum: float) -> None:
        """One ``multi_sgd(_mom)_update`` of ``weight`` with these rate, decay and momentum."""
        dt = np_dtype(weight)
        if _fusable(weight, grad, mom):
            self._update_numpy(weight, grad, mom, lr, wd, momentum, dt)
            return
        if self._clipping():
            g = grad * product(dt, self.rescale_grad)
            g = _clip(g, product(dt, self.clip_gradient))
            g *= product(dt, lr)
        else:
            g = grad * product(dt, lr, self.rescale_grad)
        decay = weight * product(dt, lr, wd)
        if mom is not None:
            mom *= product(dt, momentum)
            mom -= decay
            mom -= g
            weight += mom
        else:
            decay += g
            weight -= decay

    def _update_numpy(self, weight: np.ndarray, grad: np.ndarray, mom: np.ndarray | None, lr: float, wd: float,
                      momentum_: float, dt: np.dtype) -> None:
        """:meth:`_step`'s operations, in the same order and dtype (so the same bits), block by block into two
        scratch blocks: no array of the weight's size is allocated."""
        clipping = self._clipping()
        if clipping:
            rescale, bound, scale = (dt.type(product(dt, self.rescale_grad)), dt.type(product(dt, self.clip_gradient)),
                                     dt.type(product(dt, lr)))
        else:
            scale = dt.type(product(dt, lr, self.rescale_grad))
        decay_scale, momentum = dt.type(product(dt, lr, wd)), dt.type(product(dt, momentum_))

        def rule(wb: np.ndarray, gb: np.ndarray, mb: np.ndarray | None, t: np.ndarray, d: np.ndarray) -> None:
            if clipping:
                np.multiply(gb, rescale, out=t)
                np.clip(t, -bound, bound, out=t)
                np.multiply(t, scale, out=t)
            else:
                np.multiply(gb, scale, out=t)
            np.multiply(wb, decay_scale, out=d)
            if mb is not None:
                np.multiply(mb, momentum, out=mb)
                np.subtract(mb, d, out=mb)
                np.subtract(mb, t, out=mb)
                np.add(wb, mb, out=wb)
            else:
                np.add(d, t, out=d)
                np.subtract(wb, d, out=wb)

        blockwise(rule, weight, grad, mom, scratch=2)


class ccSGD(SGD):  # noqa: N801 - MXNet's registered name
    """MXNet's deprecated ``ccsgd``: the same rule as :class:`SGD`."""

    type_name = "ccsgd"


class NAG(Optimizer):
    """Nesterov accelerated gradient (MXNet's ``nag``: ``nag_mom_update``; plain ``sgd_update`` without momentum).

    ``mom = momentum * mom``; ``w' = w - mom + (momentum + 1) * (mom - lr * (g + wd * w))``;
    ``mom -= lr * (g + wd * w')``: MXNet's kernel writes the new weight over the old one before it
    updates the momentum, whose decay term therefore reads the new weight.  That is kept.
    """

    type_name = "nag"
    _HYPER = ("momentum",)

    def __init__(self, momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = _number("momentum", momentum, minimum=0)

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"mom": zeros_like(weight)} if self.momentum != 0.0 else {}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, _ = self._begin(index)
        mom = state.get("mom")
        if mom is None:
            sgd_kernel(weight, grad, lr, wd, self.rescale_grad, self.clip_gradient if self._clipping() else None)
            return
        dt = weight.dtype
        s_mom, s_lr, s_wd, s_rescale = (scalar(dt, v) for v in (self.momentum, lr, wd, self.rescale_grad))
        s_mom1 = dt.type(s_mom + dt.type(1))
        bound = scalar(dt, self.clip_gradient) if self._clipping() else None

        def rule(w: np.ndarray, g: np.ndarray, m: np.ndarray) -> None:
            m *= s_mom
            r = g * s_rescale
            if bound is not None:
                clip_kernel(r, bound)
            w[...] = (w - m) + (m - (r + w * s_wd) * s_lr) * s_mom1
            m -= (r + w * s_wd) * s_lr  # the kernel writes the weight first, so the decay here sees the new one

        blockwise(rule, weight, grad, mom)


def sgd_kernel(weight: np.ndarray, grad: np.ndarray, lr: float, wd: float, rescale_grad: float,
               clip: float | None) -> None:
    """MXNet's single-array ``sgd_update``: ``w = (1 - lr*wd) * w - lr * clip(rescale_grad * grad)``, in place.

    Without clipping the gradient term is ``(lr * rescale_grad) * grad``.
    """
    dt = weight.dtype
    s_lr, s_rescale = scalar(dt, lr), scalar(dt, rescale_grad)
    keep = dt.type(dt.type(1) - dt.type(s_lr * scalar(dt, wd)))
    bound = None if clip is None else scalar(dt, clip)

    def rule(w: np.ndarray, g: np.ndarray) -> None:
        if bound is not None:
            t = clip_kernel(g * s_rescale, bound) * s_lr
        else:
            t = g * dt.type(s_lr * s_rescale)
        w *= keep
        w -= t

    blockwise(rule, weight, grad)


def sgd_mom_kernel(weight: np.ndarray, grad: np.ndarray, mom: np.ndarray, lr: float, wd: float,
                   momentum: float, rescale_grad: float, clip: float | None) -> None:
    """MXNet's single-array ``sgd_mom_update``: ``mom = momentum*mom - (lr*wd)*w - lr*clip(...)``; ``w += mom``."""
    dt = weight.dtype
    s_lr, s_rescale, s_mom = scalar(dt, lr), scalar(dt, rescale_grad), scalar(dt, momentum)
    s_decay = dt.type(s_lr * scalar(dt, wd))
    bound = None if clip is None else scalar(dt, clip)

    def rule(w: np.ndarray, g: np.ndarray, m: np.ndarray) -> None:
        if bound is not None:
            t = clip_kernel(g * s_rescale, bound) * s_lr
        else:
            t = g * dt.type(s_lr * s_rescale)
        m *= s_mom
        m -= w * s_decay
        m -= t
        w += m

    blockwise(rule, weight, grad, mom)


class Signum(Optimizer):
    """signSGD and Signum (MXNet's ``signum``): a step of ``lr`` against the sign of the (momentum) gradient.

    With momentum: ``mom = momentum*mom - (1-momentum)*wd*w - (1-momentum)*clip(rescale*grad)``,
    ``w = (1 - lr*wd_lh) * w + lr * sign(mom)``; without: ``w = (1 - lr*wd) * w - lr * sign(grad)``.
    """

    type_name = "signum"
    _HYPER = ("momentum", "wd_lh")

    def __init__(self, learning_rate: float | None = 0.01, momentum: float = 0.9, wd_lh: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = _number("momentum", momentum, minimum=0)
        self.wd_lh = _number("wd_lh", wd_lh)

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"mom": zeros_like(weight)} if self.momentum != 0.0 else {}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, _ = self._begin(index)
        dt = weight.dtype
        s_lr = scalar(dt, lr)
        mom = state.get("mom")
        if mom is None:  # signsgd_update ignores rescale_grad and clip_gradient, as MXNet's kernel does
            keep = dt.type(dt.type(1) - dt.type(s_lr * scalar(dt, wd)))

            def plain(w: np.ndarray, g: np.ndarray) -> None:
                step = sign(g) * s_lr
                w *= keep
                w -= step

            blockwise(plain, weight, grad)
            return
        s_mom, s_rescale = scalar(dt, self.momentum), scalar(dt, self.rescale_grad)
        rest = dt.type(dt.type(1) - s_mom)
        s_decay = dt.type(rest * scalar(dt, wd))
        keep = dt.type(dt.type(1) - dt.type(s_lr * scalar(dt, self.wd_lh)))
        bound = scalar(dt, self.clip_gradient) if self._clipping() else None

        def rule(w: np.ndarray, g: np.ndarray, m: np.ndarray) -> None:
            r = g * s_rescale
            if bound is not None:
                clip_kernel(r, bound)
                r *= rest
            else:
                r = g * dt.type(rest * s_rescale)
            m *= s_mom
            m -= w * s_decay
            m -= r
            w *= keep
            w += sign(m) * s_lr

        blockwise(rule, weight, grad, mom)


_NO_LARS = ("gamma", "beta", "bias")  # LARS leaves these rates alone (by the key's name)


class LARS(SGD):
    """Layer-wise adaptive rate scaling (MXNet's ``lars``, as its server runs it: ``multi_lars`` + ``multi_sgd``).

    The rate of a key whose name does not end in gamma/beta/bias becomes
    ``lr * eta * |w| / (|g| * rescale_grad + wd * |w| + eps)`` (norms from
    float32 sums of squares; plain ``lr`` when a norm is 0).  With
    ``momentum_correction`` the momentum is scaled by ``cur_lr / last_lr``, the
    ratio of the scheduler's last two rates: MXNet keeps those two once per
    optimizer, so on a server they move with every key's update in turn.
    """

    type_name = "lars"
    _HYPER = ("momentum", "lazy_update", "eta", "eps", "momentum_correction")
    _SHARED = ("last_lr", "cur_lr")
    numpy_only = True

    def __init__(self, momentum: float = 0.0, lazy_update: bool = True, eta: float = 0.001, eps: float = 0,
                 momentum_correction: bool = True, **kwargs: Any) -> None:
        super().__init__(momentum=momentum, lazy_update=lazy_update, **kwargs)
        self.eta = _number("eta", eta)
        self.eps = _number("eps", eps)
        self.momentum_correction = check_bool("momentum_correction", momentum_correction)
        self.last_lr: float | None = None
        self.cur_lr: float | None = None

    def _base_lr(self) -> float:
        if self.cur_lr is not None:
            self.last_lr = self.cur_lr
        lr = super()._base_lr()
        if self.cur_lr is None:
            self.last_lr = lr
        self.cur_lr = lr
        return lr

    def lazy_rows(self) -> bool:
        """LARS scales the rate by norms over the whole key: its row_sparse pushes take the dense rule."""
        return False

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        self.update_multi_precision(index, weight, grad, state)

    def update_multi_precision(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, _ = self._begin(index)
        momentum = self.momentum
        if self.momentum_correction and self.last_lr != 0:
            momentum = self.momentum * (self.cur_lr / self.last_lr)
        if not index.endswith(_NO_LARS):
            # multi_sum_sq reads the arrays the updater got: the float16 weight itself under multi_precision.
            w_ss, g_ss = sum_sq(weight), sum_sq(grad)
            lr = float(_lars_rate(np.float32(lr), w_ss, g_ss, np.float32(wd), self.eta, self.eps,
                                  self.rescale_grad))
        master = state.get("weight32")
        target = weight if master is None else master
        self._step(target, grad.astype(np.float32) if master is not None else grad, state.get("mom"), lr, wd,
                   momentum)
        if master is not None:
            np.copyto(weight, master, casting="unsafe")


def _lars_rate(lr: np.float32, w_ss: np.float32, g_ss: np.float32, wd: np.float32, eta: float, eps: float,
               rescale: float) -> np.float32:
    """The ``multi_lars`` kernel, in float32."""
    f = np.float32
    w_norm = f(np.sqrt(w_ss))
    if not (w_norm > 0 and g_ss > 0):
        return lr
    den = f(f(f(np.sqrt(g_ss)) * f(rescale)) + f(wd * w_norm))
    den = f(den + f(eps))
    return f(f(f(lr * f(eta)) * w_norm) / den)


_WARMUPS = ("linear", "power2", "sqrt", "lars")


class LBSGD(Optimizer):
    """Large-batch SGD with warmup (MXNet's ``lbsgd``), as MXNet's server runs it.

    Gradients are accumulated over ``batch_scale`` updates of a key; every
    ``batch_scale``-th update applies their mean with ``lr * lbmult`` through
    ``sgd(_mom)_update``, and the others run ``sgd_update`` with rate 0.  Two
    MXNet quirks are kept: the rate is read *before* the update count moves;
    and the first accumulation of a key holds MXNet's server's merge buffer
    itself, not a copy, so by the next update of that key it holds the new
    gradient (in ``dist_sync`` MXNet's first window sums the latest gradient
    twice; later windows accumulate copies).
    """

    type_name = "lbsgd"
    _HYPER = ("momentum", "warmup_strategy", "warmup_epochs", "batch_scale", "updates_per_epoch", "begin_epoch",
              "num_epochs")

    def __init__(self, momentum: float = 0.0, multi_precision: bool = False, warmup_strategy: str = "linear",
                 warmup_epochs: int = 5, batch_scale: int = 1, updates_per_epoch: int = 32, begin_epoch: int = 0,
                 num_epochs: int = 60, **kwargs: Any) -> None:
        super().__init__(multi_precision=multi_precision, **kwargs)
        self.momentum = _number("momentum", momentum, minimum=0)
        if warmup_strategy not in _WARMUPS and not isinstance(warmup_strategy, str):
            raise ConfigError(f"warmup_strategy must be a string such as {_WARMUPS}, got {warmup_strategy!r}")
        self.warmup_strategy = warmup_strategy
        self.warmup_epochs = _number("warmup_epochs", warmup_epochs, minimum=0, integer=True)
        self.batch_scale = _number("batch_scale", batch_scale, minimum=1, integer=True)
        self.updates_per_epoch = _number("updates_per_epoch", updates_per_epoch, minimum=0, integer=True)
        self.begin_epoch = _number("begin_epoch", begin_epoch, minimum=0, integer=True)
        self.num_epochs = _number("num_epochs", num_epochs, minimum=0, integer=True)
        self.init_updates = self.begin_epoch * self.updates_per_epoch

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        out = {"cum_grad": np.zeros(weight.shape, weight.dtype), "num_cums": np.zeros((), np.int64),
               "cum_mode": np.zeros((), np.int64)}
        if self.momentum != 0.0:
            out["mom"] = np.zeros(weight.shape, weight.dtype)
        return out

    def _lbmult(self, nup: int) -> float:
        nwup = self.warmup_epochs * self.updates_per_epoch
        maxmult = float(self.batch_scale)
        if nup >= nwup:
            return maxmult
        if nwup <= 1:
            return 1.0
        if self.warmup_strategy == "linear":
            return 1.0 + (maxmult - 1) * nup / nwup
        if self.warmup_strategy == "power2":
            return 1.0 + (maxmult - 1) * (nup * nup) / (nwup * nwup)
        if self.warmup_strategy == "sqrt":
            return 1.0 + (maxmult - 1) * math.sqrt(float(nup) / nwup)
        return 1.0

    @staticmethod
    def _lars(weight: np.ndarray, grad: np.ndarray, wd: float) -> float:
        w2 = float((weight * weight).sum())  # MXNet: multiply(v, v).asnumpy().sum()
        g2 = float((grad * grad).sum())
        lars = math.sqrt(w2 / (g2 + wd * w2 + 1e-18))
        return min(max(lars, 0.01), 100.0)

    # Accumulation modes, as MXNet's cumgrads entry for a key stands: none yet, the caller's gradient
    # buffer itself (the first accumulation), an array of our own, or the number 0 after a reset.
    _NONE, _ALIASED, _OWN, _ZERO = 0, 1, 2, 3

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        self._update(index, weight, grad, state, aliased=True)

    def update_multi_precision(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        master = state.get("weight32")
        if master is None:
            self._update(index, weight, grad, state, aliased=True)
            return
        # MXNet hands update() a fresh float32 copy of the gradient here: nothing aliases the buffer.
        inner = {k: v for k, v in state.items() if k != "weight32"}
        self._update(index, master, grad.astype(np.float32), inner, aliased=False)
        np.copyto(weight, master, casting="unsafe")

    def _update(self, index: str, weight: np.ndarray, grad: np.ndarray, state: dict[str, Array],
                aliased: bool) -> None:
        lr, wd = self._get_lr(index), self._get_wd(index)
        self._update_count(index)
        mode, num = int(state["cum_mode"]), int(state["num_cums"])
        cum = state["cum_grad"]
        if mode != self._NONE and num > 0:
            if mode == self._ALIASED and aliased:
                np.add(grad, grad, out=cum)  # the stored entry *is* the buffer, which now holds this gradient
            elif mode in (self._ALIASED, self._OWN):
                np.add(cum, grad, out=cum)
            else:
                np.copyto(cum, grad)  # 0 + grad
            mode, num = self._OWN, num + 1
        else:
            np.copyto(cum, grad)
            mode, num = (self._ALIASED if aliased else self._OWN), self.init_updates + 1
        state["cum_mode"][...], state["num_cums"][...] = mode, num
        if num % self.batch_scale != 0:
            sgd_kernel(weight, grad, 0.0, wd, 1.0, None)
            return
        mean = cum / scalar(weight.dtype, self.batch_scale)
        mult = self._lars(weight, mean, wd) if self.warmup_strategy == "lars" else self._lbmult(num)
        lr = lr * mult
        clip = self.clip_gradient if self._clipping() else None
        mom = state.get("mom")
        if mom is not None:
            sgd_mom_kernel(weight, mean, mom, lr, wd, self.momentum, self.rescale_grad, clip)
        else:
            sgd_kernel(weight, mean, lr, wd, self.rescale_grad, clip)
        state["cum_mode"][...] = self._ZERO


__all__ = ["SGD", "ccSGD", "NAG", "Signum", "LARS", "LBSGD", "sgd_kernel", "sgd_mom_kernel"]
