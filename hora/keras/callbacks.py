"""Horovod's Keras callbacks for Keras 3 (any backend): ``hvd.callbacks.BroadcastGlobalVariablesCallback`` etc."""

from __future__ import annotations

import keras

from hora._keras.callbacks import (
    BroadcastGlobalVariablesMixin,
    LearningRateScheduleMixin,
    LearningRateWarmupMixin,
    MetricAverageMixin,
    RootOnlyCheckpointMixin,
)


class BroadcastGlobalVariablesCallback(BroadcastGlobalVariablesMixin, keras.callbacks.Callback):
    """Start every rank from the root's weights and optimizer state (``root_rank``, default 0)."""


class MetricAverageCallback(MetricAverageMixin, keras.callbacks.Callback):
    """Average the epoch's metrics over the ranks, so ``History`` and later callbacks see the averages."""


class LearningRateScheduleCallback(LearningRateScheduleMixin, keras.callbacks.Callback):
    """Learning rate ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``."""


class LearningRateWarmupCallback(LearningRateWarmupMixin, keras.callbacks.Callback):
    """Gradual warmup from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``."""


class BestModelCheckpoint(RootOnlyCheckpointMixin, keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint(save_best_only=True)`` that writes on rank 0 only (place it after MetricAverageCallback)."""


__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]
