"""Elastic training, framework-free: state objects, the retry loop, and the worker side of the driver's rendezvous.

What a binding builds on (``hora.torch.elastic`` does exactly this; a Ray
executor or another framework can too):

* :class:`State` / :class:`ObjectState` (:mod:`.state`): subclass ``State``
  with ``save``/``restore``/``sync`` for the framework's objects;
* :func:`run_fn` (:mod:`.loop`): ``run_fn(train, reset)`` with the
  binding's ``reset = shutdown(); init()``;
* the driver protocol (:mod:`.worker`): ``init()`` of a process started by
  ``hora run``'s elastic driver (``HORA_ELASTIC_DRIVER_ADDR`` set) calls
  :func:`~hora.core.elastic.worker.rendezvous` from
  :func:`hora.core.start_engine`, so the binding's ``init()`` needs no change.
  Another launcher can drive workers the same way by speaking
  :mod:`hora.elastic_wire` (``join`` and ``events``, see
  :mod:`hora.runner.elastic.driver`).

The exceptions are :class:`hora.errors.InternalError` (Horovod's
``HorovodInternalError``) and :class:`hora.errors.HostsUpdatedInterrupt`.
"""

from __future__ import annotations

from hora.core.elastic.loop import run_fn
from hora.core.elastic.notifications import HostUpdateResult
from hora.core.elastic.state import ObjectState, State
from hora.core.elastic.worker import WorkerRetired
from hora.errors import HostsUpdatedInterrupt, InternalError

HorovodInternalError = InternalError

__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "InternalError", "ObjectState", "State",
           "WorkerRetired", "run_fn"]
