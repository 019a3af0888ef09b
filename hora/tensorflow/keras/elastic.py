"""Elastic training for ``tf.keras`` (``hvd.elastic`` of ``import hora.tensorflow.keras as hvd``).

Horovod's ``horovod.tensorflow.keras.elastic``: ``KerasState`` and the
callbacks ``CommitStateCallback``, ``UpdateBatchStateCallback`` and
``UpdateEpochStateCallback``, on ``tf.keras`` (Keras 3, or tf_keras).
"""

from __future__ import annotations

import tensorflow as tf

from hora._keras.elastic import CommitStateMixin, KerasStateBase, UpdateBatchStateMixin, UpdateEpochStateMixin
from hora.core.elastic import ObjectState, State
from hora.errors import HostsUpdatedInterrupt, InternalError
from hora.tensorflow.elastic import TensorFlowKerasState, run

HorovodInternalError = InternalError


class KerasState(KerasStateBase):
    """A ``tf.keras`` model's weights, its optimizer's variables and plain attributes, as elastic state."""


class CommitStateCallback(CommitStateMixin, tf.keras.callbacks.Callback):
    """Commit the state every ``batches_per_commit`` batches."""


class UpdateBatchStateCallback(UpdateBatchStateMixin, tf.keras.callbacks.Callback):
    """Keep ``state.batch`` current."""


class UpdateEpochStateCallback(UpdateEpochStateMixin, tf.keras.callbacks.Callback):
    """Keep ``state.epoch`` at the next epoch to run."""


__all__ = ["CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt", "KerasState", "ObjectState",
           "State", "TensorFlowKerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
