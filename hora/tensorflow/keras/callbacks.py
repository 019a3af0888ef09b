"""Horovod's Keras callbacks for ``tf.keras`` (Keras 3, or tf_keras under ``TF_USE_LEGACY_KERAS=1``)."""

from __future__ import annotations

import tensorflow as tf

from hora._keras.callbacks import (
    BroadcastGlobalVariablesMixin,
    LearningRateScheduleMixin,
    LearningRateWarmupMixin,
    MetricAverageMixin,
    RootOnlyCheckpointMixin,
)


class BroadcastGlobalVariablesCallback(BroadcastGlobalVariablesMixin, tf.keras.callbacks.Callback):
    """Start every rank from the root's weights and optimizer state (``root_rank``, default 0)."""


class MetricAverageCallback(MetricAverageMixin, tf.keras.callbacks.Callback):
    """Average the epoch's metrics over the ranks, so ``History`` and later callbacks see the averages."""


class LearningRateScheduleCallback(LearningRateScheduleMixin, tf.keras.callbacks.Callback):
    """Learning rate ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``."""


class LearningRateWarmupCallback(LearningRateWarmupMixin, tf.keras.callbacks.Callback):
    """Gradual warmup from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``."""


class BestModelCheckpoint(RootOnlyCheckpointMixin, tf.keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint(save_best_only=True)`` that writes on rank 0 only (place it after MetricAverageCallback)."""


__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]
