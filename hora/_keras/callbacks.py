"""The logic of Horovod's Keras callbacks, mixed into each Keras's ``Callback`` by hora.keras and
hora.tensorflow.keras.

Semantics follow Horovod: the root's weights and optimizer state reach every
rank at the start of training; metrics are averaged over the ranks at the end
of each epoch, in place, so ``History`` and later callbacks see the averages;
the learning-rate warmup goes from ``lr / size`` to ``lr`` over the warmup
epochs, adjusted every batch; only rank 0 writes checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from hora.core import runtime
from hora.core.frontend import warmup_multiplier
from hora.core.ops import ReduceOp
from hora.core.runtime import global_process_set

from .numpy_collectives import allreduce_arrays, broadcast_variables, is_built, to_numpy, variables_of

log = logging.getLogger(__name__)


class BroadcastGlobalVariablesMixin:
    """Broadcast the model's and the optimizer's variables from ``root_rank``.

    After the first batch, when the optimizer has created its state (and a
    model given no input shape its weights), every rank gets the root's
    model and optimizer variables, as with Horovod.  A model that is already
    built at the start of training gets the root's weights then too, so
    that its first step is consistent as well.
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars: set[int] = set()
        for var in local_variables or ():
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var`` out of the broadcast (a worker-local variable)."""
        self._local_vars.add(id(var))

    def _broadcast(self, with_optimizer: bool) -> None:
        variables = [v for v in self.model.variables if id(v) not in self._local_vars]
        if with_optimizer:
            variables += variables_of(getattr(self.model, "optimizer", None))
        broadcast_variables(variables, self.root_rank)

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Every rank runs the same model code, so all of them take the same branch here.
        if is_built(self.model):
            self._broadcast(with_optimizer=False)

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.broadcast_done:
            return
        self._broadcast(with_optimizer=True)
        self.broadcast_done = True

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.on_batch_end(batch, logs)


class MetricAverageMixin:
    """Average every numeric entry of the epoch's logs over the ranks, in place, at the end of each epoch."""

    def __init__(self, device: str = "", *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.isreal(np.asarray(v, dtype=object)))
        if not keys:
            return
        values = np.array([float(np.asarray(logs[k])) for k in keys], dtype=np.float64)
        (averaged,) = allreduce_arrays([values], ReduceOp.AVERAGE, name=f"MetricAverageCallback.{epoch}")
        for k, v in zip(keys, averaged.tolist(), strict=True):
            logs[k] = v


def _get_float(value: Any) -> float:
    return float(to_numpy(value))


class LearningRateScheduleMixin:
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch`` and ``end_epoch``.

    With ``staircase`` the rate changes at the first batch of each epoch;
    otherwise every batch, at the fractional epoch ``epoch + batch /
    steps_per_epoch``.  With ``momentum_correction`` and an optimizer whose
    momentum is a variable, the momentum is scaled by new_lr / old_lr for
    that batch (Goyal et al.), then restored.  ``logs['lr']`` reports the rate
    at the end of each epoch.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        self.restore_momentum: float | None = None
        self._warned_momentum = False
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self) -> int:
        params = getattr(self, "params", None) or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError(f"Could not autodetect the number of steps per epoch; pass steps_per_epoch= to "
                         f"{type(self).__name__}()")

    def _adjust_learning_rate(self, epoch: float) -> None:
        opt = self.model.optimizer
        old_lr = _get_float(opt.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        opt.learning_rate = new_lr
        momentum = getattr(opt, "momentum", None)
        if self.momentum_correction and momentum is not None and old_lr > 0:
            if hasattr(momentum, "assign"):
                self.restore_momentum = _get_float(momentum)
                momentum.assign(self.restore_momentum * new_lr / old_lr)
            elif not self._warned_momentum and float(momentum) != 0.0:
                self._warned_momentum = True
                log.warning("%s: the optimizer's momentum is a Python number (compiled into the train step), so "
                            "momentum correction is skipped; pass momentum_correction=False to silence this",
                            type(self).__name__)

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = _get_float(self.model.optimizer.learning_rate)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.current_epoch is None:
            return
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None
                                                      and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.on_batch_begin(batch, logs)

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._restore_momentum_if_needed()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.on_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = _get_float(self.model.optimizer.learning_rate)


class LearningRateWarmupMixin(LearningRateScheduleMixin):
    """Horovod's gradual warmup: from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0, *args: Any, **kwargs: Any) -> None:
        def multiplier(epoch: float) -> float:
            # Horovod counts the batch being started as done, so the last warmup batch reaches initial_lr.
            epoch += 1.0 / self.steps_per_epoch
            return warmup_multiplier(epoch, runtime.current().engine.size, warmup_epochs)

        super().__init__(initial_lr, multiplier, 0, warmup_epochs, False, momentum_correction, steps_per_epoch,
                         *args, **kwargs)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and runtime.current().engine.rank == 0:
            log.info("Epoch %d: finished gradual learning rate warmup to %g.", epoch + 1,
                        _get_float(self.model.optimizer.learning_rate))


class RootOnlyCheckpointMixin:
    """Keras's ``ModelCheckpoint(save_best_only=True)``, writing on rank 0 only.

    Mixed in before the framework's ``ModelCheckpoint``.  Place the callback
    after ``MetricAverageCallback`` so that "best" is judged on the metrics
    averaged over all ranks.
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: Any = "epoch", save_weights_only: bool = False) -> None:
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,  # type: ignore[call-arg]
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if is_root_rank():
            super().on_train_batch_end(batch, logs)  # type: ignore[misc]

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if is_root_rank():
            super().on_epoch_end(epoch, logs)  # type: ignore[misc]


def is_root_rank() -> bool:
    """True on global rank 0, where checkpoints are written."""
    return runtime.current().engine.rank == 0


__all__ = ["BroadcastGlobalVariablesMixin", "LearningRateScheduleMixin", "LearningRateWarmupMixin",
           "MetricAverageMixin", "RootOnlyCheckpointMixin", "global_process_set", "is_root_rank"]
