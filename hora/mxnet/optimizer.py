"""Data-parallel training for MXNet: ``DistributedOptimizer`` (Module, custom loops) and ``DistributedTrainer`` (Gluon).

Both average the gradients over the ranks of a process set with hora's
allreduce, in place, before the wrapped optimizer updates the weights.  All
gradients of one step are submitted before the first wait, so the engine
negotiates them in one round and fuses the small ones into one backend call.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import warnings
from collections.abc import Sequence
from typing import Any

import mxnet as mx

from hora.core.compression import is_stateful
from hora.core.ops import ReduceOp
from hora.core.request import Handle
from hora.core.runtime import ProcessSet, global_process_set
from hora.mxnet import mpi_ops
from hora.mxnet.buffers import on_host
from hora.mxnet.compression import Compression, NDArrayCompressor

log = logging.getLogger(__name__)


def split_list(items: Sequence[Any], groups: int) -> list[list[Any]]:
    """``items`` cut into ``groups`` consecutive, nearly equal parts (the first ones one longer)."""
    items = list(items)
    groups = max(1, min(groups, len(items)))
    size, extra = divmod(len(items), groups)
    out, start = [], 0
    for g in range(groups):
        end = start + size + (1 if g < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _check_predivide(factor: float) -> float:
    factor = float(factor)
    if factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {factor}")
    return factor


def allreduce_grads(grads: Sequence[mx.nd.NDArray], names: Sequence[str], num_groups: int, predivide: float,
                    process_set: ProcessSet) -> None:
    """Average ``grads`` over the process set in place: submit them all, then wait for all.

    With ``num_groups > 0`` the gradients travel as that many grouped
    allreduces (one negotiation each); otherwise one allreduce per gradient,
    which the engine fuses by itself.  Gradients split the average as
    ``1/predivide`` before the sum and ``predivide/size`` after it.
    """
    if not grads:
        return
    pending: list[tuple[Handle | None, list[mx.nd.NDArray]]] = []
    if num_groups > 0:
        batches = [(g, n) for g, n in zip(split_list(grads, num_groups), split_list(names, num_groups), strict=True)]
        units = [(list(g), f"{n[0]}:{n[-1]}") for g, n in batches]
    else:
        units = [([g], n) for g, n in zip(grads, names, strict=True)]
    for tensors, name in units:
        if all(on_host(t) for t in tensors):
            # Every gradient is submitted before the first wait, and that wait runs the round: one
            # negotiation for the step and the fullest fusion buffers, without waking the engine's thread
            # after each submission to negotiate the first few on their own.
            h = mpi_ops.allreduce_async_(tensors, ReduceOp.AVERAGE, name, 1.0 / predivide, predivide, process_set,
                                         wake=False)
            pending.append((h, tensors))
        else:  # GPU arrays: the blocking path copies through the host
            mpi_ops.grouped_allreduce_(tensors, name=name, op=ReduceOp.AVERAGE, prescale_factor=1.0 / predivide,
                                       postscale_factor=predivide, process_set=process_set)
    for h, _ in pending:
        h.wait()


def _set_size(process_set: ProcessSet) -> int:
    size = process_set.size()
    return 1 if size is None else size


class DistributedOptimizer(mx.optimizer.Optimizer):
    """An MXNet optimizer that averages every gradient over the ranks before the wrapped optimizer's update.

    Use it with the Module API (``mod.fit(..., optimizer=hvd.DistributedOptimizer(opt))``,
    ``kvstore=None``) or call ``update``/``update_multi_precision`` in a
    custom loop.  Attributes not defined here are the wrapped optimizer's.

    Args:
        optimizer: the ``mx.optimizer.Optimizer`` that updates the weights.
        gradient_predivide_factor: the average is split as ``1/f`` before the
            sum and ``f/size`` after it.
        num_groups: > 0 sends the gradients of a multi-index update as this
            many grouped allreduces.
        process_set: average over these ranks only; a rank outside the set
            updates with its own gradients.
        compression: ``hvd.Compression.fp16`` sends float gradients as float16.  A
            stateful compressor (``hvd.Compression.powersgd(rank=...)``,
            ``hvd.Compression.fp16.with_error_feedback()``) is copied once per
            distinct update call (an index, or the indices MXNet aggregates
            into one call), since each call applies its gradients at once; its
            state is :meth:`state_dict`, and travels in ``gluon.Trainer.save_states``,
            which pickles this optimizer with the updater states.
    """

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set,
                 compression: Any = Compression.none) -> None:
        self._optimizer = optimizer
        self._gradient_predivide_factor = _check_predivide(gradient_predivide_factor)
        self._num_groups = int(num_groups)
        self._process_set = process_set
        self._compression = compression
        self._compressors: dict[str, Any] = {}
        self._pending_compression: dict[str, Any] = {}

    _OWN = frozenset({"_optimizer", "_gradient_predivide_factor", "_num_groups", "_process_set", "_compression",
                      "_compressors", "_pending_compression"})

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") or item in self._OWN:
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __getstate__(self) -> dict[str, Any]:
        # What gluon's Trainer.save_states pickles with the updater states (MXNet's own __getstate__ expects
        # a param_dict here, which lives on the wrapped optimizer).  A stateful compressor travels as its
        # state dict, so that loading it applies the rule for residuals saved by another rank or world size.
        state = {k: v for k, v in self.__dict__.items() if k != "_compressors"}
        state["_pending_compression"] = self.state_dict()["compression"]
        if self._process_set is global_process_set:
            state["_process_set"] = None  # the loading process's own global set
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_compressors", {})
        if self._process_set is None:
            object.__setattr__(self, "_process_set", global_process_set)

    def __setattr__(self, item: str, value: Any) -> None:
        # Module and Trainer set hyper-parameters (rescale_grad, idx2name...) on the optimizer they were
        # given: they must land on the wrapped one, which does the update.
        if item in self._OWN:
            object.__setattr__(self, item, value)
        else:
            setattr(self._optimizer, item, value)

    def create_state(self, index: Any, weight: mx.nd.NDArray) -> Any:
        """The wrapped optimizer's state for ``weight``."""
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index: Any, weight: mx.nd.NDArray) -> Any:
        """The wrapped optimizer's multi-precision state for ``weight``."""
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index: Any, grad: Any) -> None:
        if not self._process_set.included() or _set_size(self._process_set) == 1:
            return
        if isinstance(index, (tuple, list)):
            grads, names = list(grad), [str(i) for i in index]
        else:
            grads, names = [grad], [str(index)]
        if is_stateful(self._compression):
            self._reduce_compressed(grads, names)
            return
        compression = self._compression
        sent, ctxs = [], []
        for g in grads:
            s, ctx = compression.compress(g)
            sent.append(s)
            ctxs.append(ctx)
        allreduce_grads(sent, names, self._num_groups, self._gradient_predivide_factor, self._process_set)
        for g, s, ctx in zip(grads, sent, ctxs, strict=True):
            if s is not g:
                g[:] = compression.decompress(s, ctx)

    def _reduce_compressed(self, grads: list[mx.nd.NDArray], names: list[str]) -> None:
        """One update call's gradients through its own copy of the stateful compressor."""
        key = ",".join(names)
        compressor = self._compressors.get(key)
        if compressor is None:
            compressor = self._compressors[key] = copy.deepcopy(self._compression)
            if key in self._pending_compression:
                compressor.load_state_dict(self._pending_compression.pop(key))
        arrays = [g.asnumpy() for g in grads]
        predivide = self._gradient_predivide_factor
        compressor.reduce(arrays, names, op=ReduceOp.AVERAGE, prescale=1.0 / predivide, postscale=predivide,
                          process_set=self._process_set)
        for g, a in zip(grads, arrays, strict=True):
            g[:] = a

    def state_dict(self) -> dict[str, Any]:
        """The stateful compressor's state, per update call (``{}`` without one): this rank's, save it per rank."""
        states = {key: c.state_dict() for key, c in self._compressors.items()}
        return {"compression": {**self._pending_compression, **states}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict`; each update call's part is applied at its next update."""
        for key, value in state.get("compression", {}).items():
            if key in self._compressors:
                self._compressors[key].load_state_dict(value)
            else:
                self._pending_compression[key] = value

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Average ``grad`` (one array, or a list matching a list of indices), then update ``weight``."""
        self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """As :meth:`update`, for the wrapped optimizer's multi-precision path."""
        self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr: float) -> None:
        """Set the wrapped optimizer's learning rate."""
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: dict) -> None:
        """Set the wrapped optimizer's per-parameter learning-rate multipliers."""
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: dict) -> None:
        """Set the wrapped optimizer's per-parameter weight-decay multipliers."""
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` whose ``step`` averages the gradients over the ranks with hora's allreduce.

    It replaces the KVStore: pass it the parameters and optimizer a
    ``gluon.Trainer`` would get; ``step(batch_size)`` takes the per-rank
    batch size.

    Args:
        params: the parameters (``net.collect_params()``, a dict or a list).
        optimizer: an optimizer name or ``mx.optimizer.Optimizer``.
        optimizer_params: the optimizer's keyword arguments when ``optimizer`` is a name.
        compression: ``hvd.Compression.fp16`` sends float gradients as float16; a stateful
            compressor (``hvd.Compression.powersgd(rank=...)``,
            ``hvd.Compression.fp16.with_error_feedback()``) reduces the whole step, its state
            saved by :meth:`save_states`.
        gradient_predivide_factor: the average is split as ``1/f`` before the
            sum and ``f/size`` after it.
        prefix: distinguishes the tensor names when several trainers run in one program.
        num_groups: > 0 sends the gradients as this many grouped allreduces.
        process_set: average over these ranks only.
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: dict | None = None,
                 compression: type[NDArrayCompressor] | Any = Compression.none, gradient_predivide_factor: float = 1.0,
                 prefix: str | None = None, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer takes a plain optimizer, not a DistributedOptimizer; "
                          "the wrapped optimizer is used", stacklevel=2)
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if isinstance(params, (list, tuple)):
            params = sorted(params, key=lambda p: p.name)  # the same order on every rank
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._compression = compression
        self._gradient_predivide_factor = _check_predivide(gradient_predivide_factor)
        self._prefix = prefix or ""
        self._num_groups = int(num_groups)
        self._process_set = process_set

    def _allreduce_grads(self) -> None:
        ps = self._process_set
        if not ps.included() or _set_size(ps) == 1:
            return
        if is_stateful(self._compression):
            self._allreduce_compressed()
            return
        grads, names, restore = [], [], []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grad = param.list_grad()[0]
            sent, ctx = self._compression.compress(grad)
            grads.append(sent)
            names.append(f"{self._prefix}{i}")
            if sent is not grad:
                restore.append((grad, sent, ctx))
        allreduce_grads(grads, names, self._num_groups, self._gradient_predivide_factor, ps)
        for grad, sent, ctx in restore:
            grad[:] = self._compression.decompress(sent, ctx)

    def _allreduce_compressed(self) -> None:
        """The step's gradients through the stateful compressor, as NumPy copies reduced in place."""
        grads, names = [], []
        for i, param in enumerate(self._params):
            if param.grad_req != "null":
                grads.append(param.list_grad()[0])
                names.append(f"{self._prefix}{i}")
        arrays = [g.asnumpy() for g in grads]
        predivide = self._gradient_predivide_factor
        self._compression.reduce(arrays, names, op=ReduceOp.AVERAGE, prescale=1.0 / predivide, postscale=predivide,
                                 process_set=self._process_set)
        for g, a in zip(grads, arrays, strict=True):
            g[:] = a

    def save_states(self, fname: str) -> None:
        """MXNet's trainer states to ``fname``; a stateful compressor's to ``fname + '.compression'``.

        Each rank's residuals are its own: save on every rank (to its own file) to resume exactly.
        """
        super().save_states(fname)
        if is_stateful(self._compression):
            with open(f"{fname}.compression", "wb") as f:
                pickle.dump(self._compression.state_dict(), f)

    def load_states(self, fname: str) -> None:
        """Load what :meth:`save_states` wrote (the compressor's file only where it exists)."""
        super().load_states(fname)
        path = f"{fname}.compression"
        if is_stateful(self._compression) and os.path.exists(path):
            with open(path, "rb") as f:
                self._compression.load_state_dict(pickle.load(f))  # noqa: S301 - the user's own checkpoint
