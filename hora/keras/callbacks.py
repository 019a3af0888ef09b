"""Horovod's Keras callbacks for Keras 3 (any backend): ``hvd.callbacks.BroadcastGlobalVariablesCallback`` etc."""

from __future__ import annotations

from typing import Any

import keras

from hora._keras.callbacks import (
    BroadcastGlobalVariablesMixin,
    LearningRateScheduleMixin,
    LearningRateWarmupMixin,
    MetricAverageMixin,
    is_root_rank,
)


class BroadcastGlobalVariablesCallback(BroadcastGlobalVariablesMixin, keras.callbacks.Callback):
    """Start every rank from the root's weights and optimizer state (``root_rank``, default 0)."""


class MetricAverageCallback(MetricAverageMixin, keras.callbacks.Callback):
    """Average the epoch's metrics over the ranks, so ``History`` and later callbacks see the averages."""


class LearningRateScheduleCallback(LearningRateScheduleMixin, keras.callbacks.Callback):
    """Learning rate ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``."""


class LearningRateWarmupCallback(LearningRateWarmupMixin, keras.callbacks.Callback):
    """Gradual warmup from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``."""


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint(save_best_only=True)`` that writes on rank 0 only.

    Place it after ``MetricAverageCallback`` so that "best" is judged on the
    metrics averaged over all ranks.
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: Any = "epoch", save_weights_only: bool = False) -> None:
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if is_root_rank():
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if is_root_rank():
            super().on_epoch_end(epoch, logs)


__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]
