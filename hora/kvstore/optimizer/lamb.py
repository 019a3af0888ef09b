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
norms.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora.kvstore.arrays import math_pool
from hora.kvstore.lr_scheduler import _number
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
        self._step(index, weight, grad, state, None)

    def update_multi_precision(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        self._step(index, weight, grad, state, state.get("weight32"))

    def _step(self, index: str, weight: np.ndarray, grad: np.ndarray, state: dict[str, Array],
              master: np.ndarray | None) -> None:
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
        # multi_sum_sq of the weight as stored (float16 under multi_precision), an ordered sum: on its own
        # thread while the element-wise phase runs (it only reads the weight)
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
        r1, r2 = f(np.sqrt(w_ss.result())), f(np.sqrt(sum_sq(g_out)))
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


__all__ = ["LAMB"]
