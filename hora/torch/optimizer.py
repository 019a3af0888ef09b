"""``DistributedOptimizer``: gradients averaged across ranks while backward runs.

Each parameter gets a post-accumulate-grad hook.  When its gradient is final
for the step, the hook starts an asynchronous in-place allreduce of it and
returns, so communication overlaps the rest of backward.  ``step()`` waits
for the outstanding reductions, then runs the wrapped optimizer.

Where the engine does not overlap (one CPU core per rank, see
``EngineConfig.overlap``), nothing would run before ``step()`` anyway: the
hooks then only scale each gradient while it is still in cache, and
``step()`` submits them all as one grouped allreduce, which spares a request,
a handle and a negotiation entry per parameter.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from hora.core import runtime
from hora.core.compression import CastExchange, WireBuffers, is_builtin_cast, is_stateful
from hora.core.compression.base import FLOAT_DTYPES
from hora.core.objects import broadcast_object
from hora.core.ops import ReduceOp
from hora.core.runtime import global_process_set
from hora.errors import HoraError
from hora.torch import mpi_ops
from hora.torch.compression import Compression
from hora.torch.kvstore_optimizer import KVStoreOptimizer
from hora.torch.optimizer_base import WrappedOptimizer, parameter_names

log = logging.getLogger(__name__)

_SCALE_EARLY = (torch.float32, torch.float64)
# Handle keys of the deferred grouped allreduces (parameters use id(p) > 0, groups -1 - index).
_DEFERRED_SCALED = -(1 << 40)
_DEFERRED_REST = _DEFERRED_SCALED - 1


class _DistributedOptimizer(WrappedOptimizer):
    """Wraps a torch optimizer; see :func:`DistributedOptimizer`."""

    def __init__(self, optimizer, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set) -> None:
        # The wrapped optimizer owns param_groups and state; share them rather than copy,
        # so LR schedulers and state_dict() see one truth.
        self._opt = optimizer
        self._compression = compression
        self._wire = WireBuffers()  # fp16/bf16 casts: the wire copies are kept between steps
        self._process_set = process_set
        self._sparse_as_dense = sparse_as_dense
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        self.backward_passes_per_step = backward_passes_per_step
        op = ReduceOp(op)
        if op == ReduceOp.ADASUM:
            raise HoraError("op=hvd.Adasum is not supported by hora yet; use hvd.Average or hvd.Sum")
        if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor is only valid with op=hvd.Average")
        self._op = op
        # A stateful compressor (PowerSGD, error feedback) reduces the whole step at once in synchronize().
        self._stateful = is_stateful(compression)
        if self._stateful:
            compression.check_op(op)
        self._stateful_ready: set[int] = set()
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = float(gradient_predivide_factor)

        all_params = [p for g in optimizer.param_groups for p in g["params"]]
        self._names = parameter_names(all_params, named_parameters)
        #: Horovod's public mapping, parameter -> the name its gradient is reduced under.
        self._parameter_names = {p: self._names[id(p)] for p in all_params}
        self._params = [p for p in all_params if p.requires_grad]

        self._group_of: dict[int, int] = {}
        self._groups: list[list[torch.Tensor]] = []
        if groups is not None:
            if isinstance(groups, int):
                if groups < 0:
                    raise ValueError(f"groups={groups} must be >= 0")
                n = groups
                if n > 0:
                    size = -(-len(self._params) // n)
                    self._groups = [self._params[i : i + size] for i in range(0, len(self._params), size)]
            else:
                self._groups = [list(g) for g in groups]
            for gi, group in enumerate(self._groups):
                for p in group:
                    self._group_of[id(p)] = gi

        self._handles: dict[int, tuple[int, Any, list[torch.Tensor]]] = {}  # key -> (handle, ctxs, params)
        self._passes: dict[int, int] = {}
        self._group_ready: dict[int, list[torch.Tensor]] = {}
        self._densified: set[int] = set()  # sparse grads reduced as dense (sparse_as_dense)
        # Without overlap, ungrouped dense gradients wait here for one grouped allreduce in synchronize().
        self._defer = not runtime.current().engine.overlap
        self._deferred: dict[int, bool] = {}  # id(param) -> already divided by the set size
        self._synchronized = False
        self._should_synchronize = True
        # A rank outside the process set takes no part: its step() stays local, as in Horovod.
        self._included = bool(process_set.included())
        self._hooks = ([p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]
                       if self._included else [])
        self._casts = self._cast_exchange() if self._included else None

    def _cast_exchange(self) -> CastExchange | None:
        """fp16/bf16 without groups: each floating gradient is cast straight into one flat wire buffer.

        Its chunks go on the wire as soon as they are cast, in the reverse of
        the parameters' order (the order backward makes them in, and the same
        on every rank); see :mod:`hora.core.compression.cast`.
        """
        wire = getattr(self._compression, "wire_dtype", None)
        if not is_builtin_cast(self._compression) or wire is None or self._groups or self._op not in (
                ReduceOp.AVERAGE, ReduceOp.SUM):
            return None
        params = [p for p in reversed(self._params)
                  if str(p.dtype).removeprefix("torch.") in FLOAT_DTYPES - {wire} and not p.is_sparse]
        if not params:
            return None
        self._by_id = {id(p): p for p in params}
        return CastExchange(wire, [id(p) for p in params], params, [self._names[id(p)] for p in params],
                            op=self._op, prescale=self._prescale, postscale=self._postscale,
                            process_set=self._process_set)

    def _cast_grad(self, key: int) -> torch.Tensor | None:
        """The gradient the cast exchange reads and writes (None: a sparse one, reduced by allgather)."""
        p = self._by_id[key]
        if p.grad is not None and p.grad.is_sparse and not self._sparse_as_dense:
            return None
        return self._grad_of(p)

    # -------------------------------------------------------------- hooks
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        key = id(p)
        if key in self._handles or key in self._deferred or key in self._stateful_ready or (
                self._casts is not None and self._casts.added(key)) or (key in self._group_of and
                                    any(q is p for q in self._group_ready.get(self._group_of[key], []))):
            raise HoraError(
                "gradients were computed more than backward_passes_per_step times before step(); "
                "increase backward_passes_per_step to accumulate gradients locally, or call step() / "
                "synchronize() between backward passes"
            )
        self._passes[key] = self._passes.get(key, 0) + 1
        if self._passes[key] < self.backward_passes_per_step:
            return
        if self._stateful:
            self._stateful_ready.add(key)
            return
        self._submit(p)

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:
            # Unused on this rank this step: other ranks may have a gradient, so reduce zeros.
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            if not self._sparse_as_dense:
                raise HoraError(f"parameter {self._names[id(p)]!r} has a sparse gradient; it cannot be "
                                "reduced in a group: pass sparse_as_dense=True to DistributedOptimizer")
            p.grad = p.grad.to_dense()
            self._densified.add(id(p))
        return p.grad

    def _submit(self, p: torch.Tensor) -> None:
        gi = self._group_of.get(id(p))
        if gi is None:
            if p.grad is not None and p.grad.is_sparse and not self._sparse_as_dense:
                self._start_sparse(p)
                return
            if self._casts is not None and self._casts.covers(id(p)):
                self._casts.add(id(p), self._grad_of(p))
                return
            if self._defer:
                self._deferred[id(p)] = self._scale_early([self._grad_of(p)])
                return
            self._start([p], self._names[id(p)], id(p))
            return
        ready = self._group_ready.setdefault(gi, [])
        ready.append(p)
        if len(ready) == len(self._groups[gi]):
            del self._group_ready[gi]
            self._start(self._groups[gi], f"group.{gi}", -1 - gi)

    def _scale_early(self, grads: list[torch.Tensor]) -> bool:
        """For op=Average on float32/float64 gradients (no compression): divide by the set size now.

        Done while backward has just left the gradient in cache; the sum that
        follows then needs no division, which would read every gradient from
        memory once more (MLP benchmark: 10-14% more samples/s on MPI).  Half
        precision keeps the division after the sum, in float32.  Returns
        whether the gradients were scaled.
        """
        if self._op != ReduceOp.AVERAGE or self._compression is not Compression.none or not all(
                g.dtype in _SCALE_EARLY for g in grads):
            return False
        scale = self._prescale / self._process_set.size()
        for g in grads:
            g.mul_(scale)
        return True

    def _start(self, params: list[torch.Tensor], name: str, key: int, scaled: bool = False) -> None:
        """Submit the allreduce of ``params``' gradients (``scaled``: already divided by the set size)."""
        grads, ctxs = [], []
        for p in params:
            if self._compression is Compression.none:  # the uncompressed path stays as it was
                compressed, ctx = self._grad_of(p), None
            else:
                compressed, ctx = self._wire.compress(self._compression, self._grad_of(p), id(p))
            grads.append(compressed)
            ctxs.append(ctx)
        op, prescale = self._op, self._prescale
        if scaled or self._scale_early(grads):
            op, prescale = ReduceOp.SUM, 1.0
        handle = mpi_ops.grouped_allreduce_async_(
            grads, name=f"allreduce.{name}", op=op, prescale_factor=prescale,
            postscale_factor=self._postscale, process_set=self._process_set,
        ) if len(grads) > 1 or key < 0 else mpi_ops.allreduce_async_(
            grads[0], name=f"allreduce.{name}", op=op, prescale_factor=prescale,
            postscale_factor=self._postscale, process_set=self._process_set,
        )
        self._handles[key] = (handle, (grads, ctxs), params)

    def _start_deferred(self) -> None:
        """Submit the deferred gradients: one grouped allreduce of the scaled ones, one of the rest.

        Every rank submits the same parameters in the optimizer's order (those
        whose hooks did not fire carry zeros), so the requests are cached after
        the first step.
        """
        deferred, self._deferred = self._deferred, {}
        params = [p for p in self._params if id(p) in deferred]
        scaled = [p for p in params if deferred[id(p)]]
        rest = [p for p in params if not deferred[id(p)]]
        for part, key, is_scaled in ((scaled, _DEFERRED_SCALED, True), (rest, _DEFERRED_REST, False)):
            if part:
                name = f"{self._names[id(part[0])]}..{self._names[id(part[-1])]}"
                self._start(part, name, key, scaled=is_scaled)

    def _start_sparse(self, p: torch.Tensor) -> None:
        """Reduce a sparse gradient by allgathering its indices and values (no densifying)."""
        if self._op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise HoraError(f"sparse gradients support op=Average or op=Sum, not {self._op.name}")
        wait = mpi_ops.sparse_allreduce_async(p.grad, name=f"allreduce.{self._names[id(p)]}", op=self._op,
                                              process_set=self._process_set)
        self._handles[id(p)] = (wait, None, [p])

    # ----------------------------------------------------------- protocol
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; afterwards ``p.grad`` holds the averaged gradient.

        Parameters whose hooks did not fire this step (unused in the forward
        pass) are reduced too, with zero gradients, so every rank submits the
        same set of tensors and nothing hangs.
        """
        if not self._included:
            self._synchronized = True
            return
        if self._stateful:
            self._reduce_stateful()
        else:
            self._reduce_plain()
        for p in self._params:
            if id(p) in self._densified:
                p.grad = p.grad.to_sparse()
        self._densified.clear()
        self._handles.clear()
        self._passes.clear()
        self._stateful_ready.clear()
        self._synchronized = True

    def _reduce_plain(self) -> None:
        """Start what the hooks have not started yet, then wait for all of it."""
        for gi, ready in list(self._group_ready.items()):
            for p in self._groups[gi]:
                if not any(q is p for q in ready):
                    ready.append(p)
            del self._group_ready[gi]
            self._start(self._groups[gi], f"group.{gi}", -1 - gi)
        casts = self._casts
        for p in self._params:
            key = id(p)
            if key not in self._handles and key not in self._group_of and key not in self._deferred and not (
                    casts is not None and casts.added(key)):
                self._submit(p)
        for gi, group in enumerate(self._groups):
            if -1 - gi not in self._handles:
                self._start(group, f"group.{gi}", -1 - gi)
        if self._deferred:
            self._start_deferred()
        if casts is not None:
            casts.finish(self._cast_grad)
        for handle, payload, params in self._handles.values():
            if payload is None:  # a sparse gradient: the handle is a callable returning the sum
                params[0].grad = handle()
                continue
            grads, ctxs = payload
            mpi_ops.synchronize(handle)
            for p, g, ctx in zip(params, grads, ctxs, strict=True):
                if ctx is not None or g is not p.grad:
                    self._wire.decompress_into(self._compression, g, ctx, p.grad)

    def _reduce_stateful(self) -> None:
        """Hand every gradient of the step to the stateful compressor, which reduces them in place.

        All parameters go, in the optimizer's order, whether or not their hooks
        fired (unused ones carry zeros), so every rank hands over the same list.
        """
        for p in self._params:
            if not self._grad_of(p).is_contiguous():
                p.grad = p.grad.contiguous()
        self._compression.reduce([p.grad for p in self._params], [self._names[id(p)] for p in self._params],
                                 op=self._op, prescale=self._prescale, postscale=self._postscale,
                                 process_set=self._process_set)

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                # Horovod's wording, which scripts and tests look for.
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return self._opt.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles or self._deferred or self._stateful_ready or (self._casts is not None and self._casts.pending):
            raise HoraError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); that would discard gradients still being reduced"
            )
        self._opt.zero_grad(set_to_none=set_to_none)

    def clear_pending(self) -> None:
        """Forget gradients in flight: their collectives failed with the ring they were submitted to.

        Elastic training (``hora.torch.elastic.TorchState``) calls this when it
        restores or syncs the optimizer after a reset.
        """
        self._handles.clear()
        self._deferred.clear()
        self._passes.clear()
        self._group_ready.clear()
        self._densified.clear()
        self._stateful_ready.clear()
        if self._casts is not None:
            self._casts.reset()
        self._synchronized = False

    def state_dict(self) -> dict:
        """The wrapped optimizer's state, plus a stateful compressor's (under ``'hora_compression'``)."""
        state = self._opt.state_dict()
        if self._stateful:
            state["hora_compression"] = self._compression.state_dict()
        return state

    def sync_compression(self, root_rank: int = 0) -> None:
        """Give every rank the root's compressor step and factors, residuals from zero (no-op when stateless).

        ``hvd.broadcast_optimizer_state`` calls this, and so does an elastic
        sync after a new rendezvous: the ranks then agree again, whatever the
        new world size.
        """
        if not self._stateful or not self._included:
            return
        is_root = runtime.current().engine.rank == root_rank
        state = broadcast_object(self._compression.shared_state_dict() if is_root else None, root_rank,
                                 name="broadcast_compression_state", process_set=self._process_set)
        self._compression.load_shared_state_dict(state)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`; the compressor's part (when present) goes to the compressor."""
        state_dict = dict(state_dict)
        compression = state_dict.pop("hora_compression", None)
        self._opt.load_state_dict(state_dict)
        if compression is not None and self._stateful:
            self._compression.load_state_dict(compression)


def DistributedOptimizer(  # noqa: N802 - Horovod's public name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression=Compression.none,
    backward_passes_per_step: int = 1,
    op=ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=global_process_set,
    kvstore: Any = None,
    server_optimizer: Any = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Args:
        optimizer: any torch optimizer.
        named_parameters: ``model.named_parameters()``; names make tensors
            identifiable in errors and timelines.
        compression: ``hvd.Compression.none``, ``.fp16`` or ``.bf16`` (casts), or a stateful
            compressor, one per optimizer: ``hvd.Compression.fp16.with_error_feedback()``,
            ``hvd.Compression.powersgd(rank=...)``.  A stateful one reduces every gradient of
            the step at ``step()`` (groups then change nothing) and its state is part of
            ``state_dict()``.
        backward_passes_per_step: backward passes accumulated locally per step.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: divide by this before the sum and by
            ``size / factor`` after it (for fp16 range).
        num_groups / groups: reduce parameters in fixed groups (an int, or
            lists of parameters) instead of one by one.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        process_set: reduce over this process set only.
        kvstore: route gradients through a parameter-server KVStore instead of
            allreduce: a type name (``'dist_sync'``, ``'dist_async'``,
            ``'dist_sync_allreduce'``, ``'local'``...) or a
            :class:`hora.kvstore.KVStore`.  See :mod:`hora.torch.kvstore_optimizer`.
        server_optimizer: with ``kvstore``: ``None`` (update on the workers;
            the default except for ``dist_async``), ``'auto'`` (run this torch
            SGD/Adam on the servers) or a :mod:`hora.kvstore.optimizer` object.
    """
    if kvstore is not None:
        unsupported = {
            "compression": compression is not Compression.none, "op": ReduceOp(op) != ReduceOp.AVERAGE,
            "gradient_predivide_factor": gradient_predivide_factor != 1.0, "groups": bool(groups or num_groups),
            "process_set": process_set is not global_process_set,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"{', '.join(bad)} apply to the allreduce path, not to kvstore=; for compression use "
                             "kvstore.set_gradient_compression({'type': '2bit', 'threshold': ...})")

        return KVStoreOptimizer(optimizer, named_parameters, kvstore, server_optimizer, backward_passes_per_step)
    if server_optimizer is not None:
        raise ValueError("server_optimizer= needs kvstore=: the allreduce path updates on the workers")
    if num_groups and groups is None:
        groups = num_groups
    return _DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                                 gradient_predivide_factor, groups, sparse_as_dense, process_set)
