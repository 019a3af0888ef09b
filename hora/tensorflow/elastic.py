"""Elastic training for TensorFlow (``hvd.elastic`` of ``import hora.tensorflow as hvd``).

Horovod's ``horovod.tensorflow.elastic``: ``run``, ``TensorFlowState`` (a
list of ``tf.Variable`` objects, eagerly or in a TF1 session) and
``TensorFlowKerasState`` (a ``tf.keras`` model and optimizer).  The Keras
callbacks are in :mod:`hora.tensorflow.keras.elastic`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf

from hora._keras.compression_state import ElasticCompression, split_compressors
from hora._keras.elastic import KerasStateBase
from hora.core.elastic import ObjectState, State, run_fn
from hora.errors import HostsUpdatedInterrupt, InternalError

HorovodInternalError = InternalError
F = TypeVar("F", bound=Callable[..., Any])


def _reset() -> None:
    import hora.tensorflow as hvd

    hvd.shutdown()
    hvd.init()


def run(func: F) -> F:
    """Decorate ``func(state, ...)`` to survive lost peers and host changes (see :func:`hora.core.elastic.run_fn`).

    A collective inside a graph (``tf.function``, Keras's train step) that
    failed because a peer was lost surfaces as a TensorFlow error; it is
    turned into :class:`InternalError` here, so that the state is restored.
    """
    return run_fn(translate_lost_peers(func), _reset)


def translate_lost_peers(func: F) -> F:
    """``func`` whose TensorFlow errors caused by a lost peer are raised as :class:`InternalError`."""
    from hora.tensorflow.mpi_ops import lost_peer

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as e:
            if lost_peer(e) and not isinstance(e, InternalError):
                raise InternalError(e.message) from e
            raise

    return wrapper  # type: ignore[return-value]


class TensorFlowState(ObjectState):
    """``tf.Variable`` objects and plain attributes as elastic state (Horovod's ``TensorFlowState``).

    ``commit()`` keeps a NumPy copy of every variable, ``restore()`` assigns
    it back and ``sync()`` broadcasts rank 0's values (and attributes) to
    every rank.  Eagerly the variables must be given; in a TF1 graph they
    default to the graph's global variables, and the values move through
    ``session`` (default: the default session when the state is used).

    Args:
        variables: the variables to keep.
        session: the TF1 session that holds their values (graph mode only).
        **kwargs: plain attributes, as in :class:`~hora.core.elastic.ObjectState`.  A stateful
            compressor among them (the ``compression=`` of a ``DistributedGradientTape``) is
            committed with the variables, by reference: after a sync every rank has rank 0's
            step and factors and its residuals start from zero.
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        eager = tf.executing_eagerly()
        if variables is None:
            if eager:
                raise ValueError("TensorFlowState needs the variables when TensorFlow runs eagerly (a TF1 graph "
                                 "has global variables; eager code does not)")
            variables = tf.compat.v1.global_variables()
        self.variables = list(variables)
        self.session = session
        self._graph_ops: tuple[Any, list[Any], Any] | None = None
        if not eager:
            from hora.tensorflow.functions import broadcast_variables

            placeholders = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in self.variables]
            assign = tf.group(*[tf.compat.v1.assign(v, p) for v, p in zip(self.variables, placeholders,
                                                                            strict=True)])
            self._graph_ops = (broadcast_variables(self.variables, root_rank=0), placeholders, assign)
        self._values: list[np.ndarray] = self._read()
        compressors = split_compressors(kwargs)
        self._compression = [ElasticCompression(c, name) for name, c in compressors.items()]
        for name, c in compressors.items():
            setattr(self, name, c)
        super().__init__(**kwargs)

    def _session(self) -> Any:
        session = self.session or tf.compat.v1.get_default_session()
        if session is None:
            raise ValueError("TensorFlowState in a TF1 graph needs a session: pass session=, or use the state "
                             "inside `with session.as_default():`")
        return session

    def _read(self) -> list[np.ndarray]:
        if self._graph_ops is None:
            return [np.array(v.numpy(), copy=True) for v in self.variables]
        return [np.array(x, copy=True) for x in self._session().run(self.variables)]

    def save(self) -> None:
        self._values = self._read()
        for c in self._compression:
            c.save()
        super().save()

    def restore(self) -> None:
        if self._graph_ops is None:
            for v, value in zip(self.variables, self._values, strict=True):
                v.assign(value)
        else:
            _, placeholders, assign = self._graph_ops
            self._session().run(assign, feed_dict=dict(zip(placeholders, self._values, strict=True)))
        for c in self._compression:
            c.restore()
        super().restore()

    def sync(self) -> None:
        if self.variables:
            if self._graph_ops is None:
                from hora.tensorflow.functions import broadcast_variables

                broadcast_variables(self.variables, root_rank=0)
            else:
                self._session().run(self._graph_ops[0])
            self._values = self._read()
        for c in self._compression:
            c.sync()
        super().sync()


class TensorFlowKerasState(KerasStateBase):
    """A ``tf.keras`` model's weights, its optimizer's variables and plain attributes, as elastic state."""


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "run", "translate_lost_peers"]
