"""Per-element adaptive rates: Adam, Adamax, Nadam, AdaGrad, AdaDelta, RMSProp, FTML and Ftrl, as MXNet 1.9 has them.

Adam, RMSProp, FTML and Ftrl are MXNet kernels (``adam_update`` ...); the
others are chains of NDArray operations in MXNet's Python.  Either way each
rule below performs the same operations in the same order and dtype; scalars
that MXNet computes in Python (bias corrections, Nadam's momentum schedule)
are computed here in Python doubles too, and rounded where MXNet rounds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hora.errors import ConfigError
from hora.kvstore.arrays import is_numpy as _is_numpy
from hora.kvstore.lr_scheduler import LRScheduler, _number
from hora.kvstore.optimizer import fused as _fused
from hora.kvstore.optimizer.base import (
    Array,
    Optimizer,
    blockwise,
    check_bool,
    check_fraction,
    clip_kernel,
    moments,
    np_dtype,
    one_minus,
    optional_number,
    powf,
    product,
    scalar,
    sign,
    zeros_like,
)


def _sqrt(x: Array) -> Array:
    return np.sqrt(x) if _is_numpy(x) else x.sqrt()


class Adam(Optimizer):
    """Adam (MXNet's ``adam``): L2 weight decay in the gradient, bias correction folded into the rate.

    ``g = clip(rescale_grad * grad + wd * w)``; ``mean = beta1 * mean + (1 - beta1) * g``;
    ``var = beta2 * var + (1 - beta2) * g * g``; ``w -= lr_t * mean / (sqrt(var) + epsilon)`` with
    ``lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)``, ``t`` being the key's own update count.  This
    rule also updates torch tensors in place.  Contiguous float32 NumPy keys go through the C loop of
    :mod:`.fused` when it is there and gives this rule's bits, else through the NumPy rule.
    """

    type_name = "adam"
    _HYPER = ("beta1", "beta2", "epsilon", "lazy_update")
    numpy_only = False

    def __init__(self, learning_rate: float | None = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: LRScheduler | Mapping | None = None,
                 lazy_update: bool = True, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, wd=wd, rescale_grad=rescale_grad,
                         clip_gradient=clip_gradient, lr_scheduler=lr_scheduler, **kwargs)
        self.beta1 = check_fraction("beta1", beta1)
        self.beta2 = check_fraction("beta2", beta2)
        self.epsilon = _number("epsilon", epsilon, minimum=0)
        self.lazy_update = check_bool("lazy_update", lazy_update)

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"mean": zeros_like(weight), "var": zeros_like(weight)}

    def lazy_rows(self) -> bool:
        """MXNet's ``adam_update`` takes row_sparse gradients lazily when ``lazy_update``."""
        return self.lazy_update

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, t = self._begin(index)
        lr *= math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        dt = np_dtype(weight)
        rescale, decay = product(dt, self.rescale_grad), product(dt, wd)
        bound = product(dt, self.clip_gradient) if self._clipping() else None
        b1, b1c, b2, b2c = product(dt, self.beta1), one_minus(dt, self.beta1), product(dt, self.beta2), one_minus(
            dt, self.beta2)
        s_lr, eps = product(dt, lr), product(dt, self.epsilon)
        scalars = (rescale, decay, bound, b1, b1c, b2, b2c, s_lr, eps)
        arrays = (weight, grad, state["mean"], state["var"])
        if not (_is_numpy(weight) and _is_numpy(grad)):
            _adam_torch(*arrays, scalars)
            return
        loop = _adam_loop() if dt == np.float32 else None
        if loop is not None and all(a.flags.c_contiguous for a in arrays):
            _adam_fused(loop, *arrays, scalars)  # one pass over memory instead of one per operation
        else:
            _adam_numpy(*arrays, scalars)


# Adam's scalars, each already rounded to the weight's dtype: rescale, decay, bound (None: no clipping), beta1,
# 1 - beta1, beta2, 1 - beta2, the bias-corrected rate and epsilon.
_AdamScalars = tuple[float, float, float | None, float, float, float, float, float, float]


def _adam_torch(w: Array, gr: Array, m: Array, v: Array, scalars: _AdamScalars) -> None:
    """Adam's rule on torch tensors, whole (Python numbers, already rounded, keep the tensors' dtype)."""
    rescale, decay, bound, b1, b1c, b2, b2c, lr, eps = scalars
    g = gr * rescale
    g += w * decay
    if bound is not None:
        g = g.clamp_(-bound, bound)
    m *= b1
    m += g * b1c
    v *= b2
    g2 = g * b2c
    g2 *= g
    v += g2
    step = m * lr
    den = _sqrt(v)
    den += eps
    step /= den
    w -= step


def _adam_numpy(weight: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, scalars: _AdamScalars) -> None:
    """Adam's rule in NumPy, in cache-sized blocks (the reference the fused loop is checked against)."""
    dt = weight.dtype
    # NumPy scalars keep NumPy's arithmetic in the dtype.
    rescale, decay, bound, b1, b1c, b2, b2c, lr, eps = (None if x is None else dt.type(x) for x in scalars)

    def rule(w: np.ndarray, gr: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, t: np.ndarray) -> None:
        np.multiply(gr, rescale, out=g)
        np.multiply(w, decay, out=t)
        g += t
        if bound is not None:
            clip_kernel(g, bound)
        moments(g, m, v, b1, b1c, b2, b2c, t)
        np.multiply(m, lr, out=g)
        np.sqrt(v, out=t)
        t += eps
        g /= t
        w -= g

    blockwise(rule, weight, grad, m, v, scratch=2)


def _adam_fused(loop: Any, weight: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray,
                scalars: _AdamScalars) -> None:
    """Adam's rule through the C loop of :mod:`.fused` (contiguous float32 arrays), in blocks on the threads."""
    rescale, decay, bound, *rest = scalars

    def rule(w: np.ndarray, gr: np.ndarray, mb: np.ndarray, vb: np.ndarray) -> None:
        loop(w.ctypes.data, gr.ctypes.data, mb.ctypes.data, vb.ctypes.data, w.size, rescale, decay,
             bound is not None, 0.0 if bound is None else bound, *rest)

    blockwise(rule, weight, grad, m, v)


def _adam_loop() -> Any:
    """The fused C loop for float32 Adam, once it has given :func:`_adam_numpy`'s bits on a probe (with and
    without clipping; :func:`.fused.probe_data`, compared by :func:`.fused.same_bits`); None where it cannot
    be used."""
    loops = _fused.checked(("hora_adam_f32",), _adam_probe)
    return None if loops is None else loops[0]


def _adam_probe(loops: tuple[Any, ...]) -> bool:
    w0, grads = _fused.probe_data()
    ok = True
    with np.errstate(all="ignore"):
        for scalars in ((0.5, 0.01, None, 0.9, 0.1, 0.999, 0.001, 0.002, 1e-8),
                        (1.0, 0.0, 0.3, 0.8, 0.2, 0.99, 0.01, 0.05, 1e-6)):
            f = tuple(None if x is None else float(np.float32(x)) for x in scalars)
            a, b = ([w0.copy(), np.zeros_like(w0), np.zeros_like(w0)] for _ in range(2))
            for g in grads:
                _adam_numpy(a[0], g, a[1], a[2], f)  # type: ignore[arg-type]
                _adam_fused(loops[0], b[0], g, b[1], b[2], f)  # type: ignore[arg-type]
            ok = ok and all(_fused.same_bits(x, y) for x, y in zip(a, b, strict=True))
    return ok


class Adamax(Optimizer):
    """Adamax (MXNet's ``adamax``): Adam with the infinity norm, ``u = max(beta2 * u, |g|)``."""

    type_name = "adamax"
    _HYPER = ("beta1", "beta2")

    def __init__(self, learning_rate: float | None = 0.002, beta1: float = 0.9, beta2: float = 0.999,
                 **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = check_fraction("beta1", beta1)
        self.beta2 = _number("beta2", beta2, minimum=0)

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"mean": zeros_like(weight), "u": zeros_like(weight)}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, t = self._begin(index)
        lr /= 1.0 - self.beta1 ** t
        dt = weight.dtype
        decay, s_lr = scalar(dt, wd), scalar(dt, lr)
        b1, b1c, b2 = scalar(dt, self.beta1), scalar(dt, 1.0 - self.beta1), scalar(dt, self.beta2)

        def rule(w: np.ndarray, gr: np.ndarray, m: np.ndarray, u: np.ndarray) -> None:
            g = self._rescaled(gr, dt, w, decay)
            m *= b1
            m += g * b1c
            np.maximum(u * b2, np.abs(g), out=u)
            w -= (m * s_lr) / u

        blockwise(rule, weight, grad, state["mean"], state["u"])


class Nadam(Optimizer):
    """Nesterov Adam (MXNet's ``nadam``).

    MXNet keeps the product of the momentum schedule (``m_schedule``) once per
    optimizer, and every update of any key multiplies it again: on a server,
    each key's update moves it in turn.  That is kept.
    """

    type_name = "nadam"
    _HYPER = ("beta1", "beta2", "epsilon", "schedule_decay")
    _SHARED = ("m_schedule",)

    def __init__(self, learning_rate: float | None = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, schedule_decay: float = 0.004, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = _number("beta1", beta1, minimum=0)
        self.beta2 = check_fraction("beta2", beta2)
        self.epsilon = _number("epsilon", epsilon, minimum=0)
        self.schedule_decay = _number("schedule_decay", schedule_decay)
        self.m_schedule = 1.0

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"mean": zeros_like(weight), "var": zeros_like(weight)}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, t = self._begin(index)
        momentum_t = self.beta1 * (1.0 - 0.5 * pow(0.96, t * self.schedule_decay))
        momentum_t_1 = self.beta1 * (1.0 - 0.5 * pow(0.96, (t + 1) * self.schedule_decay))
        self.m_schedule = self.m_schedule * momentum_t
        m_schedule_next = self.m_schedule * momentum_t_1
        dt = weight.dtype
        f = dt.type
        decay = f(wd)
        b1, b1c, b2, b2c = f(self.beta1), f(1.0 - self.beta1), f(self.beta2), f(1.0 - self.beta2)
        den_g, den_m, den_v = f(1.0 - self.m_schedule), f(1.0 - m_schedule_next), f(1.0 - pow(self.beta2, t))
        mt, mt1, s_lr, eps = f(1.0 - momentum_t), f(momentum_t_1), f(lr), f(self.epsilon)

        def rule(w: np.ndarray, gr: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
            g = self._rescaled(gr, dt, w, decay)
            m *= b1
            m += g * b1c
            v *= b2
            v += (g * b2c) * g
            bar = (g / den_g) * mt + (m / den_m) * mt1
            w -= (bar * s_lr) / (np.sqrt(v / den_v) + eps)

        blockwise(rule, weight, grad, state["mean"], state["var"])


class AdaGrad(Optimizer):
    """AdaGrad (MXNet's ``adagrad``): ``h += g * g``; ``w += (g / sqrt(h + eps) + wd * w) * -lr``."""

    type_name = "adagrad"
    _HYPER = ("eps",)

    def __init__(self, eps: float = 1e-7, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.eps = _number("eps", eps)

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"history": zeros_like(weight)}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, _ = self._begin(index)
        dt = weight.dtype
        scalars = tuple(scalar(dt, x) for x in (self.rescale_grad, self.eps, wd, -lr))
        h = state["history"]
        if self.clip_gradient is not None:  # MXNet's Python clip, whatever the sign of clip_gradient
            def clipped(gr: np.ndarray, g: np.ndarray) -> None:
                g[...] = self._rescaled(gr, dt)

            _adagrad_numpy(weight, grad, h, scalars, clipped)
            return
        loop = _adagrad_loop() if dt == np.float32 else None
        if loop is not None and all(a.flags.c_contiguous for a in (weight, grad, h)):
            _adagrad_fused(loop, weight, grad, h, scalars)
        else:
            _adagrad_numpy(weight, grad, h, scalars, lambda gr, g: np.multiply(gr, scalars[0], out=g))

    def lazy_rows(self) -> bool:
        """MXNet's AdaGrad sends row_sparse gradients to its sparse kernel, which touches only their rows."""
        return True

    def update_rows(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        """MXNet's ``sparse.adagrad_update`` on the pushed rows: ``w - (g / sqrt(h + eps)) * lr``, no decay.

        Raises:
            ConfigError: ``wd`` (times the key's ``wd_mult``) is not 0, which MXNet's sparse kernel refuses
                too ("sparse adagrad_update does not support wd").
        """
        self._through_master(self._sparse_rule, index, weight, grad, state)

    def _sparse_rule(self, index: str, weight: np.ndarray, grad: np.ndarray, state: dict[str, Array]) -> None:
        lr, wd, _ = self._begin(index)
        if wd != 0:
            raise ConfigError(f"AdaGrad's row_sparse update of key {index!r} does not take weight decay (wd={wd}), "
                              "as MXNet's sparse adagrad_update refuses it: set wd=0 (or wd_mult 0 for this key), "
                              "or push the key's gradient dense")
        dt = weight.dtype
        rescale, eps, s_lr = scalar(dt, self.rescale_grad), scalar(dt, self.eps), scalar(dt, lr)
        bound = scalar(dt, self.clip_gradient) if self._clipping() else None

        def rule(w: np.ndarray, gr: np.ndarray, h: np.ndarray, g: np.ndarray, t: np.ndarray) -> None:
            np.multiply(gr, rescale, out=g)
            if bound is not None:
                clip_kernel(g, bound)
            _adagrad_history(g, h, eps, t)
            g *= s_lr
            w -= g

        blockwise(rule, weight, grad, state["history"], scratch=2)


def _adagrad_history(g: np.ndarray, h: np.ndarray, eps: np.floating, t: np.ndarray) -> None:
    """``h += g * g``, then ``g /= sqrt(h + eps)``, in place (``t``: scratch): both of MXNet's AdaGrad kernels."""
    np.multiply(g, g, out=t)
    h += t
    np.add(h, eps, out=t)
    np.sqrt(t, out=t)
    g /= t


def _adagrad_numpy(weight: np.ndarray, grad: np.ndarray, h: np.ndarray, scalars: tuple[np.floating, ...],
                   rescaled: Callable[[np.ndarray, np.ndarray], Any]) -> None:
    """AdaGrad's dense rule in NumPy blocks; ``rescaled(grad, out)`` writes the rescaled (clipped) gradient."""
    _, eps, decay, neg_lr = scalars

    def rule(w: np.ndarray, gr: np.ndarray, hb: np.ndarray, g: np.ndarray, t: np.ndarray) -> None:
        rescaled(gr, g)
        _adagrad_history(g, hb, eps, t)
        np.multiply(w, decay, out=t)
        g += t
        g *= neg_lr
        w += g

    blockwise(rule, weight, grad, h, scratch=2)


def _adagrad_fused(loop: Any, weight: np.ndarray, grad: np.ndarray, h: np.ndarray,
                   scalars: tuple[np.floating, ...]) -> None:
    """AdaGrad's rule (no clipping) through the C loop of :mod:`.fused`, in blocks on the threads."""
    args = tuple(float(x) for x in scalars)

    def rule(w: np.ndarray, gr: np.ndarray, hb: np.ndarray) -> None:
        loop(w.ctypes.data, gr.ctypes.data, hb.ctypes.data, w.size, *args)

    blockwise(rule, weight, grad, h)


def _adagrad_loop() -> Any:
    """The fused C loop for float32 AdaGrad without clipping, once it has given :func:`_adagrad_numpy`'s bits on
    a probe (:func:`.fused.probe_data`, :func:`.fused.same_bits`); None where it cannot be used."""
    loops = _fused.checked(("hora_adagrad_f32",), _adagrad_probe)
    return None if loops is None else loops[0]


def _adagrad_probe(loops: tuple[Any, ...]) -> bool:
    w0, grads = _fused.probe_data()
    f = np.float32
    ok = True
    with np.errstate(all="ignore"):
        for scalars in ((f(0.5), f(1e-7), f(0.01), f(-0.1)), (f(1.0), f(1e-6), f(0.0), f(-0.02))):
            a, b = ([w0.copy(), np.zeros_like(w0)] for _ in range(2))
            for g in grads:
                _adagrad_numpy(a[0], g, a[1], scalars, lambda gr, out, s=scalars[0]: np.multiply(gr, s, out=out))
                _adagrad_fused(loops[0], b[0], g, b[1], scalars)
            ok = ok and all(_fused.same_bits(x, y) for x, y in zip(a, b, strict=True))
    return ok


class AdaDelta(Optimizer):
    """AdaDelta (MXNet's ``adadelta``): no learning rate; running averages of squared gradients and steps."""

    type_name = "adadelta"
    _HYPER = ("rho", "epsilon")

    def __init__(self, rho: float = 0.90, epsilon: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rho = _number("rho", rho)
        self.epsilon = _number("epsilon", epsilon)

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"acc_g": zeros_like(weight), "acc_delta": zeros_like(weight)}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        wd = self._get_wd(index)
        self._update_count(index)
        dt = weight.dtype
        f = dt.type
        rho, rest, eps, decay = f(self.rho), f(1.0 - self.rho), f(self.epsilon), f(wd)

        def rule(w: np.ndarray, gr: np.ndarray, acc_g: np.ndarray, acc_delta: np.ndarray) -> None:
            g = self._rescaled(gr, dt)  # MXNet scales the caller's gradient in place; here a copy
            acc_g *= rho
            acc_g += (g * rest) * g
            delta = np.sqrt(acc_delta + eps) / np.sqrt(acc_g + eps) * g
            acc_delta *= rho
            acc_delta += (delta * rest) * delta
            w -= delta + w * decay

        blockwise(rule, weight, grad, state["acc_g"], state["acc_delta"])


class RMSProp(Optimizer):
    """RMSProp (MXNet's ``rmsprop``: ``rmsprop_update``, or Graves' centered form ``rmspropalex_update``)."""

    type_name = "rmsprop"
    _HYPER = ("gamma1", "gamma2", "epsilon", "centered", "clip_weights")

    def __init__(self, learning_rate: float | None = 0.001, gamma1: float = 0.9, gamma2: float = 0.9,
                 epsilon: float = 1e-8, centered: bool = False, clip_weights: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.gamma1 = _number("gamma1", gamma1)
        self.gamma2 = _number("gamma2", gamma2)
        self.epsilon = _number("epsilon", epsilon)
        self.centered = check_bool("centered", centered)
        self.clip_weights = optional_number("clip_weights", clip_weights)

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        if self.centered:
            return {"n": zeros_like(weight), "g": zeros_like(weight), "delta": zeros_like(weight)}
        return {"n": zeros_like(weight)}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, _ = self._begin(index)
        dt = weight.dtype
        f = dt.type
        rescale, decay, g1, g1c, s_lr, eps = (f(self.rescale_grad), f(wd), f(self.gamma1),
                                              f(f(1) - f(self.gamma1)), f(lr), f(self.epsilon))
        g2 = f(self.gamma2)
        bound = f(self.clip_gradient) if self._clipping() else None
        wbound = f(self.clip_weights) if self.clip_weights and self.clip_weights >= 0 else None

        def grad_of(w: np.ndarray, gr: np.ndarray) -> np.ndarray:
            r = gr * rescale + w * decay
            return r if bound is None else clip_kernel(r, bound)

        def plain(w: np.ndarray, gr: np.ndarray, n: np.ndarray) -> None:
            r = grad_of(w, gr)
            n[...] = (r * r) * g1c + n * g1
            new = w - (r / np.sqrt(n + eps)) * s_lr
            w[...] = new if wbound is None else clip_kernel(new, wbound)

        def centered(w: np.ndarray, gr: np.ndarray, n: np.ndarray, gs: np.ndarray, delta: np.ndarray) -> None:
            r = grad_of(w, gr)
            n[...] = (r * g1c) * r + n * g1
            gs[...] = r * g1c + gs * g1
            delta[...] = delta * g2 - (r * s_lr) / np.sqrt((n - gs * gs) + eps)
            new = w + delta
            w[...] = new if wbound is None else clip_kernel(new, wbound)

        if self.centered:
            blockwise(centered, weight, grad, state["n"], state["g"], state["delta"])
        else:
            blockwise(plain, weight, grad, state["n"])


class FTML(Optimizer):
    """Follow the moving leader (MXNet's ``ftml``, ``ftml_update``)."""

    type_name = "ftml"
    _HYPER = ("beta1", "beta2", "epsilon")

    def __init__(self, beta1: float = 0.6, beta2: float = 0.999, epsilon: float = 1e-8, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.beta1 = _number("beta1", beta1)
        self.beta2 = _number("beta2", beta2)
        self.epsilon = _number("epsilon", epsilon)

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"d": zeros_like(weight), "v": zeros_like(weight), "z": zeros_like(weight)}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, t = self._begin(index)
        dt = weight.dtype
        f = dt.type
        one = f(1)
        s_lr, b1, b2, eps, decay, rescale = f(lr), f(self.beta1), f(self.beta2), f(self.epsilon), f(wd), f(
            self.rescale_grad)
        b1t, b2t = f(one - powf(b1, f(t))), f(one - powf(b2, f(t)))
        b1c, b2c = f(one - b1), f(one - b2)
        scale = f(b1t / s_lr)
        bound = f(self.clip_gradient) if self._clipping() else None

        def rule(w: np.ndarray, gr: np.ndarray, d: np.ndarray, v: np.ndarray, z: np.ndarray) -> None:
            g = gr * rescale + w * decay
            if bound is not None:
                clip_kernel(g, bound)
            v[...] = v * b2 + (g * g) * b2c
            d_t = (np.sqrt(v / b2t) + eps) * scale
            z[...] = (z * b1 + g * b1c) - (d_t - d * b1) * w
            d[...] = d_t
            w[...] = -z / d_t

        blockwise(rule, weight, grad, state["d"], state["v"], state["z"])


class Ftrl(Optimizer):
    """FTRL-proximal (MXNet's ``ftrl``, ``ftrl_update``).

    As in MXNet, ``learning_rate`` does not override a scheduler's ``base_lr``
    here (Ftrl keeps it to itself), and defaults to 0.1.
    """

    type_name = "ftrl"
    _HYPER = ("lamda1", "beta")

    def __init__(self, lamda1: float = 0.01, learning_rate: float | None = 0.1, beta: float = 1, **kwargs: Any
                 ) -> None:
        super().__init__(**kwargs)
        self.lamda1 = _number("lamda1", lamda1)
        self.beta = _number("beta", beta)
        self.lr = None if learning_rate is None else _number("learning_rate", learning_rate, minimum=0)

    def spec(self) -> dict[str, Any]:
        out = super().spec()
        out["learning_rate"] = self.lr
        return out

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"z": zeros_like(weight), "n": zeros_like(weight)}

    def lazy_rows(self) -> bool:
        """MXNet's ``ftrl_update`` on row_sparse values touches only the pushed rows, with the dense arithmetic."""
        return True

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        self._update_count(index)
        wd, lr = self._get_wd(index), self._get_lr(index)
        dt = weight.dtype
        f = dt.type
        s_lr, rescale, beta, l1, decay = f(lr), f(self.rescale_grad), f(self.beta), f(self.lamda1), f(wd)
        bound = f(self.clip_gradient) if self._clipping() else None

        def rule(w: np.ndarray, gr: np.ndarray, z: np.ndarray, n: np.ndarray) -> None:
            r = gr * rescale
            if bound is not None:
                clip_kernel(r, bound)
            sq = r * r
            z += r - ((np.sqrt(n + sq) - np.sqrt(n)) * w) / s_lr
            n += sq
            keep = (np.abs(z) > l1).astype(dt)
            w[...] = ((sign(z) * l1 - z) / ((beta + np.sqrt(n)) / s_lr + decay)) * keep

        blockwise(rule, weight, grad, state["z"], state["n"])


__all__ = ["Adam", "Adamax", "Nadam", "AdaGrad", "AdaDelta", "RMSProp", "FTML", "Ftrl"]
