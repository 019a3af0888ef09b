"""DCASGD, SGLD and Test: MXNet's remaining registered optimizers, written as MXNet 1.9 computes them."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hora.errors import ConfigError
from hora.kvstore.lr_scheduler import _number
from hora.kvstore.optimizer.base import Array, Optimizer, blockwise, scalar, zeros_like


class DCASGD(Optimizer):
    """Delay-compensated asynchronous SGD (MXNet's ``dcasgd``), without momentum.

    ``mom = -lr * (g + wd * w + lamda * g * g * (w - w_prev))``; ``w_prev = w``;
    ``w += mom``, where ``w_prev`` starts as the weight the key was created with.
    MXNet 1.9.1 fails on the first update when ``momentum`` is not 0 (it tests
    an NDArray's truth value), so that is refused here when the optimizer is made.
    """

    type_name = "dcasgd"
    _HYPER = ("momentum", "lamda")

    def __init__(self, momentum: float = 0.0, lamda: float = 0.04, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = _number("momentum", momentum)
        if self.momentum != 0.0:
            raise ConfigError(f"DCASGD with momentum={momentum}: MXNet 1.9.1's DCASGD fails on its first update "
                              "whenever momentum is not 0, so hora refuses it too; use momentum=0")
        self.lamda = _number("lamda", lamda)

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"previous": np.array(weight, copy=True)}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, _ = self._begin(index)
        dt = weight.dtype
        decay, lamda, neg_lr = scalar(dt, wd), scalar(dt, self.lamda), scalar(dt, -lr)

        def rule(w: np.ndarray, gr: np.ndarray, prev: np.ndarray) -> None:
            g = self._rescaled(gr, dt)
            mom = (g + w * decay + ((g * lamda) * g) * (w - prev)) * neg_lr
            prev[...] = w
            w += mom

        blockwise(rule, weight, grad, state["previous"])


class SGLD(Optimizer):
    """Stochastic gradient Langevin dynamics (MXNet's ``sgld``).

    ``w += -lr/2 * (g + wd * w)``, then ``w += N(0, sqrt(lr))``.  The first
    step is MXNet's to the last bit; the noise comes from NumPy's generator
    (seeded from the OS), so it matches MXNet's in distribution only.
    """

    type_name = "sgld"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

    def noise(self, shape: tuple[int, ...], dtype: np.dtype, std: float) -> np.ndarray:
        """Gaussian noise of standard deviation ``std`` (a test may replace this to check the rest exactly)."""
        return self._rng.normal(0.0, std, size=shape).astype(dtype)

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        lr, wd, _ = self._begin(index)
        dt = weight.dtype
        decay, half = scalar(dt, wd), scalar(dt, -lr / 2)

        def rule(w: np.ndarray, gr: np.ndarray) -> None:
            g = self._rescaled(gr, dt)
            w += (g + w * decay) * half

        blockwise(rule, weight, grad)
        weight += self.noise(weight.shape, dt, float(np.sqrt(lr)))


class Test(Optimizer):
    """MXNet's ``test`` optimizer: ``w += rescale_grad * grad``, and the state holds the new weight.

    No rate, no decay, and no update count, as in MXNet.
    """

    type_name = "test"

    def create_state(self, index: str, weight: Array) -> dict[str, Array]:
        return {"weight": zeros_like(weight)}

    def update(self, index: str, weight: Array, grad: Array, state: dict[str, Array]) -> None:
        weight += grad * scalar(weight.dtype, self.rescale_grad)
        np.copyto(state["weight"], weight)


__all__ = ["DCASGD", "SGLD", "Test"]
