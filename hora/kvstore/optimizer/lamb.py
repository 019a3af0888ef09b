"""LAMB (MXNet's ``lamb``): Adam's direction, scaled per key by the trust ratio ``|w| / |g|``.

MXNet's server hands its updater one key at a time, and the updater (LAMB
sets ``aggregate_num``) passes it on as a list of one, so LAMB runs the
fused ``multi_lamb_update``: the moments and the direction ``g`` in float32
(``mean / (1 - beta1**t)`` with ``powf``; the division by
``sqrt(var) + epsilon`` and the decay term added in double, as the kernel's
C ``sqrt`` makes them), the norms as square roots of
sequential float32 sums of squares (``multi_sum_sq``, of the weight as
stored: float16 under ``multi_precision``), then ``w -= lr * (r1 / r2) * g``
on the float32 master copy when there is one.  A key split across servers is
one array per server there, as here, so each server's shard takes its own
norms.  Contiguous float32 keys without a master copy take the C loops of
:mod:`.fused` (the direction in one pass, each sum of squares as MXNet's
sequential loop) when they are there and give the NumPy phases' bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora.kvstore.arrays import is_numpy as _is_numpy
from hora.kvstore.arrays import math_pool
from hora.kvstore.lr_scheduler import _number
from hora.kvstore.optimizer import fused as _fused
from hora.kvstore.optimizer.base import (
    Array,
    Optimizer,
    blockwise,
    check_bool,
    clip_kernel,
    moments,
    optional_number,
    powf,
    sum_sq,
    zeros_like,
)


class LAMB(Optimizer):
    """Layer-wise adaptive moments (MXNet's ``lamb``)."""

    type_name = "lamb"
    _HYPER = ("beta1", "beta2", "epsilon", "lower_bound", "upper_bound", "bias_correction")

    def __init__(self, learning_rate: float | None = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-6, lower_bound: float | None = None, upper_bound: float | None = None,
                 bias_correction: bool = True, **kwargs: Any) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = _number("beta1", beta1)
        self.beta2 = _number("beta2", beta2)
        self.epsilon = _number("epsilon", epsilon)
        self.lower_bound = optional_number("lower_bound", lower_bound)
        self.upper_bound = optional_number("upper_bound", upper_bound)
        self.bias_correction = check_bool("bias_correction", bias_correction)
        # The direction ``g``'s buffer (the largest key's size), kept for the next update: a weight-sized
        # buffer allocated afresh every step pays its page faults each time.  Updates taking it at once
        # (not on a server, whose updater lock serializes them) each find it or allocate their own.
        self._spare: list[np.ndarray] = []

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"mean": zeros_like(weight), "var": zeros_like(weight)}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        self._step(index, weight, grad, state, None, _loops_for(weight, grad, state))

    def update_multi_precision(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        master = state.get("weight32")
        self._step(index, weight, grad, state, master, None if master is not None else _loops_for(weight, grad, state))

    def _step(self, index: str, weight: np.ndarray, grad: np.ndarray, state: dict[str, Array],
              master: np.ndarray | None, loops: tuple[Any, ...] | None) -> None:
        """One update; ``loops`` (the C direction and sum of squares of :mod:`.fused`, for contiguous float32
        arrays without a master copy) replace the NumPy phases when given."""
        self._update_count(index)
        f = np.float32
        lr, wd = f(self._get_lr(index)), f(self._get_wd(index))
        t = f(self._index_update_count[index])
        rescale, b1, b2, eps = f(self.rescale_grad), f(self.beta1), f(self.beta2), f(self.epsilon)
        b1c, b2c = f(f(1) - b1), f(f(1) - b2)
        den_mean, den_var = f(f(1) - powf(b1, t)), f(f(1) - powf(b2, t))
        bound = f(self.clip_gradient) if self._clipping() else None
        w32 = master if master is not None else weight
        try:
            spare = self._spare.pop()
        except IndexError:
            spare = None
        if spare is None or spare.size < weight.size:
            spare = np.empty(weight.size, f)
        g_out = spare[:weight.size].reshape(weight.shape)
        if loops is not None:
            w_ss, g_ss = self._direction_fused(loops, weight, grad, state, g_out, (
                float(rescale), bound is not None, 0.0 if bound is None else float(bound), float(b1), float(b1c),
                float(b2), float(b2c), self.bias_correction, float(den_mean), float(den_var), float(eps), float(wd)))
        else:
            w_ss, g_ss = self._direction_numpy(weight, w32, grad, state, g_out, rescale, bound, b1, b1c, b2, b2c,
                                               den_mean, den_var, eps, wd)
        r1, r2 = f(np.sqrt(w_ss)), f(np.sqrt(g_ss))
        if self.lower_bound and self.lower_bound >= 0:  # passed when truthy, applied when >= 0
            r1 = max(r1, f(self.lower_bound))
        if self.upper_bound and self.upper_bound >= 0:
            r1 = min(r1, f(self.upper_bound))
        ratio = f(1) if (r1 == 0 or r2 == 0) else f(r1 / r2)
        lr_adjusted = f(lr * ratio)

        def step2(w: np.ndarray, g: np.ndarray, scaled: np.ndarray) -> None:
            np.multiply(g, lr_adjusted, out=scaled)
            w -= scaled

        blockwise(step2, w32, g_out, scratch=1, scratch_dtype=f)
        self._spare[:] = [spare]  # the largest key's size, reused by every key
        if master is not None:
            np.copyto(weight, master, casting="unsafe")

    def _direction_numpy(self, weight: np.ndarray, w32: np.ndarray, grad: np.ndarray, state: dict[str, Array],
                         g_out: np.ndarray, rescale: np.float32, bound: np.float32 | None, b1: np.float32,
                         b1c: np.float32, b2: np.float32, b2c: np.float32, den_mean: np.float32,
                         den_var: np.float32, eps: np.float32, wd: np.float32) -> tuple[np.float32, np.float32]:
        """The moments and the direction into ``g_out`` in NumPy; the sums of squares of the weight (as stored:
        float16 under multi_precision) and of the direction."""
        f = np.float32
        # multi_sum_sq of the weight, an ordered sum: on its own thread while the element-wise phase runs (it
        # only reads the weight)
        w_ss = math_pool().submit(sum_sq, weight)

        def step1(w: np.ndarray, gr: np.ndarray, m: np.ndarray, v: np.ndarray, out: np.ndarray, r: np.ndarray,
                  t: np.ndarray, d: np.ndarray, q: np.ndarray) -> None:
            if gr.dtype == f:
                np.multiply(gr, rescale, out=r)
            else:  # the float16 gradient as float32 first (multi_precision)
                np.copyto(r, gr)
                r *= rescale
            if bound is not None:
                clip_kernel(r, bound)
            moments(r, m, v, b1, b1c, b2, b2c, t)
            if self.bias_correction:
                np.divide(m, den_mean, out=r)
                np.divide(v, den_var, out=t)
            else:
                np.copyto(r, m)
                np.copyto(t, v)
            # The kernel's unqualified sqrt is C's double sqrt: the direction is formed in double.
            np.sqrt(t, out=q, dtype=np.float64)
            q += np.float64(eps)
            np.divide(r, q, out=d)
            np.multiply(w, wd, out=t)
            d += t
            np.copyto(out, d, casting="same_kind")

        blockwise(step1, w32, grad, state["mean"], state["var"], g_out, scratch=(f, f, np.float64, np.float64))
        return w_ss.result(), sum_sq(g_out)

    @staticmethod
    def _direction_fused(loops: tuple[Any, ...], weight: np.ndarray, grad: np.ndarray, state: dict[str, Array],
                         g_out: np.ndarray, args: tuple) -> tuple[np.float32, np.float32]:
        """:meth:`_direction_numpy` through the C loops: the direction in blocks on the threads, then the two
        ordered sums of squares, one sequential loop each, on two threads."""
        direction, squares = loops

        def step1(w: np.ndarray, gr: np.ndarray, m: np.ndarray, v: np.ndarray, out: np.ndarray) -> None:
            direction(w.ctypes.data, gr.ctypes.data, m.ctypes.data, v.ctypes.data, out.ctypes.data, w.size, *args)

        blockwise(step1, weight, grad, state["mean"], state["var"], g_out)
        w_ss = math_pool().submit(squares, weight.ctypes.data, weight.size)
        g_ss = np.float32(squares(g_out.ctypes.data, g_out.size))
        return np.float32(w_ss.result()), g_ss


def _loops_for(weight: Array, grad: Array, state: dict[str, Array]) -> tuple[Any, ...] | None:
    """The C loops when this update can take them (contiguous float32 NumPy arrays) and they passed the probe."""
    arrays = (weight, grad, state.get("mean"), state.get("var"))
    if not all(_is_numpy(a) and a.dtype == np.float32 and a.flags.c_contiguous for a in arrays):
        return None
    return _lamb_loops()


def _lamb_loops() -> tuple[Any, ...] | None:
    """The fused direction and sum-of-squares loops, once a probe update through them (with and without
    clipping and bias correction; :func:`.fused.probe_data`, and the same with finite weights so that the
    norms are checked too) gave the NumPy phases' bits (:func:`.fused.same_bits`); None where they cannot be
    used."""
    return _fused.checked(("hora_lamb_direction_f32", "hora_sum_sq_f32"), _probe)


def _probe(loops: tuple[Any, ...]) -> bool:
    w0, grads = _fused.probe_data()
    finite = w0.copy()
    finite[~np.isfinite(finite)] = 1.0  # the norms are NaN with a NaN weight: here they and the ratio count
    ok = True
    with np.errstate(all="ignore"):
        for start in (w0, finite):
            for kwargs in ({"learning_rate": 0.01, "wd": 0.01},
                           {"learning_rate": 0.02, "bias_correction": False, "clip_gradient": 0.5,
                            "rescale_grad": 0.5}):
                results = []
                for with_loops in (loops, None):
                    opt, w = LAMB(**kwargs), start.copy()
                    state = opt.create_state("p", w)
                    for g in grads:
                        opt._step("p", w, g, state, None, with_loops)
                    results.append((w, state["mean"], state["var"]))
                ok = ok and all(_fused.same_bits(a, b) for a, b in zip(*results, strict=True))
    return ok

__all__ = ["LAMB"]
