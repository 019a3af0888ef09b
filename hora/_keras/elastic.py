"""Elastic training for Keras, written once for hora.keras and hora.tensorflow.keras: the state and the callbacks.

:class:`KerasStateBase` keeps a model's weights and its optimizer's
variables as NumPy copies at each commit, puts them back on restore, and
syncs them from rank 0 (building the optimizer first on a worker that has
not stepped yet, so every rank broadcasts the same variables).  A stateful
compressor of the optimizer (or passed as a keyword argument) is committed
with them; a sync after a new rendezvous gives every rank rank 0's step and
factors and starts every residual from zero.  The callback
mixins drive a state from ``model.fit``: commit every N batches, and keep
``state.batch`` and ``state.epoch`` current, so that ``fit(initial_epoch=
state.epoch)`` resumes where the last commit was.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hora.core import runtime
from hora.core.elastic import ObjectState
from hora.core.objects import broadcast_object

from .compression_state import ElasticCompression, split_compressors
from .numpy_collectives import broadcast_variables, require_built, to_numpy, variables_of
from .optimizer import compressor_of


def _rank() -> int:
    return runtime.current().engine.rank


class KerasStateBase(ObjectState):
    """Elastic state of a Keras model and optimizer plus plain attributes (Horovod's ``KerasState``).

    Args:
        model: the Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        **kwargs: plain attributes, as in :class:`~hora.core.elastic.ObjectState`; a stateful
            compressor among them (one a ``DistributedGradientTape`` uses) is committed as the
            optimizer's is.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        require_built(model, "KerasState")  # its weights are what a commit saves (Horovod refuses it too)
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._saved_weights: list[np.ndarray] = []
        self._saved_optimizer: list[np.ndarray] = []
        self._save_variables()
        compressors = split_compressors(kwargs)
        own = compressor_of(self.optimizer)
        if own is not None:
            compressors.setdefault("optimizer", own)
        self._compression = [ElasticCompression(c, name) for name, c in compressors.items()]
        for name, c in compressors.items():
            if name != "optimizer":
                setattr(self, name, c)
        super().__init__(bcast_object=broadcast_object, get_rank=_rank, **kwargs)

    def _optimizer_variables(self) -> list[Any]:
        return variables_of(self.optimizer)

    def _save_variables(self) -> None:
        self._saved_weights = [np.array(w, copy=True) for w in self.model.get_weights()]
        self._saved_optimizer = [np.array(to_numpy(v), copy=True) for v in self._optimizer_variables()]

    def save(self) -> None:
        self._save_variables()
        for c in self._compression:
            c.save()
        super().save()

    def restore(self) -> None:
        self.model.set_weights(self._saved_weights)
        variables = self._optimizer_variables()
        if len(variables) == len(self._saved_optimizer):
            for var, value in zip(variables, self._saved_optimizer, strict=True):
                var.assign(value)
        for c in self._compression:
            c.restore()
        super().restore()

    def sync(self) -> None:
        build = getattr(self.optimizer, "build", None)
        if build is not None and not getattr(self.optimizer, "built", True):
            build(self.model.trainable_variables)  # a worker that never stepped has no slots yet
        broadcast_variables(list(self.model.variables) + self._optimizer_variables(), 0)
        self._save_variables()  # a restore after the sync goes back to rank 0's values, not this rank's old ones
        for c in self._compression:
            c.sync()
        super().sync()


class CommitStateMixin:
    """Commit ``state`` every ``batches_per_commit`` batches (Horovod's ``CommitStateCallback``)."""

    def __init__(self, state: ObjectState, batches_per_commit: int = 1, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit={batches_per_commit} must be >= 1")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.on_batch_end(batch, logs)


class UpdateBatchStateMixin:
    """Keep ``state.batch`` at the number of batches done in this epoch (Horovod's ``UpdateBatchStateCallback``)."""

    def __init__(self, state: ObjectState, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = state

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch + 1

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.on_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateMixin:
    """Keep ``state.epoch`` at the next epoch to run (Horovod's ``UpdateEpochStateCallback``).

    Pass ``initial_epoch=state.epoch`` to ``fit`` so that a reset resumes there.
    """

    def __init__(self, state: ObjectState, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = state

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = epoch + 1


__all__ = ["CommitStateMixin", "KerasStateBase", "UpdateBatchStateMixin", "UpdateEpochStateMixin"]
