"""hora's framework-neutral core: topology, backends, negotiation, execution.

Nothing here imports a deep-learning framework.  The engine works on
*buffers* (:mod:`hora.core.buffers`): NumPy arrays, which anything on the host
with DLPack or the buffer protocol can be viewed as, and torch tensors, which
keep their zero-copy path on the CPU and NCCL on CUDA.  The torch-specific
modules (``buffers/torch_ops.py``, ``backends/torch_dist.py``) load only when
a torch tensor is submitted or the gloo/NCCL engine is chosen; a NumPy job
on MPI never imports torch.

The binding contract
--------------------
A framework binding (``hora.torch``, ``hora.tensorflow``, ``hora.keras``,
``hora.mxnet``) supplies only:

* how to view its tensor as an engine buffer, and how to turn a result back
  into its own type (``Adapter.to_buffer`` / ``Adapter.from_buffer``);
* how to wait for its device stream before the engine reads an input
  (``Adapter.sync``);
* its autograd or gradient registration, and its optimizer wrapper, hooks or
  callbacks.

It submits every collective through one call,
:func:`hora.core.collectives.submit` (kind, tensors, name, op, scale factors,
process set, root or splits), which returns a
:class:`~hora.core.request.Handle`.  Generated names, the duplicate-name
check, request construction, output allocation, negotiation, fusion, stall
reports and errors live here, once; a binding copies none of it.
:func:`hora.core.runtime.init` / ``shutdown`` and the process-set calls are
shared by every binding in the process.

The path of one gradient
------------------------
1. ``loss.backward()`` fires the binding's hook for a parameter
   (``hora.torch.optimizer``), which calls ``collectives.submit(ALLREDUCE,
   [grad], name=..., op=Average)``.  ``submit`` views the tensor as a buffer,
   picks its array family, checks the name is free, builds a
   :class:`~hora.core.request.Request` and queues it on the
   :class:`~hora.core.engine.Engine`; the hook returns at once.
2. The engine runs a round (on its own thread, or on the thread that waits):
   every pending request's name is looked up in the name cache
   (:mod:`hora.core.negotiation`) and marked in an integer vector that the
   controller backend sums over all ranks.  New names and changed shapes are
   announced in a second phase; :func:`~hora.core.negotiation.resolve`
   derives, identically everywhere, the requests ready on all ranks, and
   fails on every rank the ones whose ranks disagree.
3. The :class:`~hora.core.executor.Executor` turns the ready list into
   backend calls: each allreduce gets a cached
   :data:`~hora.core.executor.AllreducePlan`; small tensors are packed into a
   fusion buffer through their family's ops, large ones reduced in their own
   memory, Average becomes Sum and a postscale.
4. The backend (:mod:`hora.core.backends`: MPI, gloo, NCCL) reduces the flat
   buffer in place; the executor scales and unpacks the result into the
   gradient and completes the handle.
5. ``optimizer.step()`` waits on the handles and steps.  A rank that never
   submits is named by :mod:`hora.core.stall`.

:func:`start_engine` (in :mod:`hora.core.startup`) is what ``init()`` calls:
it detects the topology, picks and connects the backends, and returns a
running :class:`~hora.core.engine.Engine`.
"""

from __future__ import annotations

from hora.core.engine import Engine
from hora.core.startup import choose_controller, start_engine
from hora.core.topology import Topology

__all__ = ["Engine", "Topology", "start_engine", "choose_controller"]
