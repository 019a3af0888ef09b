"""A user's own server optimizer, registered by name: the module a job names in HORA_PS_OPTIMIZER_MODULES."""

from __future__ import annotations

from typing import Any

import numpy as np

from hora.kvstore import optimizer as hopt


@hopt.register
class HalfStep(hopt.Optimizer):
    """``w -= lr * scale * grad``: a rule that is not MXNet's, for the tests of explicit registration."""

    type_name = "halfstep"
    _HYPER = ("scale",)

    def __init__(self, scale: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scale = float(scale)

    def update(self, index: str, weight: np.ndarray, grad: np.ndarray, state: dict) -> None:
        self._update_count(index)
        weight -= grad * np.float32(self._get_lr(index) * self.scale)
