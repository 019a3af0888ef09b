"""Data parallelism over the devices of one process, through a KVStore (MXNet's Module on N contexts).

:class:`DataParallelTrainer` keeps one replica of a torch model per device.
Each :meth:`~DataParallelTrainer.step` splits the batch by ``work_load_list``
(MXNet's rule, :func:`~hora.kvstore.local.split_input_slice`), runs forward
and backward on every replica (in threads, so devices overlap), pushes every
parameter's per-device gradients to the KVStore, which sums them and updates
the weight once, and pulls the new weight back into every replica.

Each replica's loss is weighted by its share of the batch, so that with a
``mean``-reduced loss the summed gradient is exactly the gradient of the mean
over the whole batch: training equals one model trained on the whole batch
(up to floating-point rounding).  This holds for models without
batch-dependent layers; BatchNorm statistics are computed per replica, and
floating-point buffers are averaged over the replicas after every step.

With a ``dist_sync_allreduce`` (or ``dist_*``) store the gradients are also
summed over the worker processes; give the optimizer ``rescale_grad=1/num_workers``
to average them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from hora.errors import ConfigError
from hora.kvstore import create as create_kvstore
from hora.kvstore.base import KVStore
from hora.kvstore.local import check_work_load_list, split_input_slice
from hora.kvstore.optimizer import Optimizer

Batch = torch.Tensor | Sequence[torch.Tensor]


class DataParallelTrainer:
    """Train a torch model on several devices of one process, summing gradients in a KVStore.

    Args:
        model: the model; it becomes the replica on ``devices[0]`` (moved there)
            and holds the trained weights.
        optimizer: a :class:`~hora.kvstore.optimizer.Optimizer`, its spec dict,
            or a name (``'sgd'``) for :func:`hora.kvstore.optimizer.create`.
        devices: one entry per replica (``'cpu'`` may repeat; ``'cuda:0'``...).
        work_load_list: relative speed of each device; the batch is split in
            proportion (default: evenly).
        kvstore: a store type name (``'device'``, ``'local'``,
            ``'dist_sync_allreduce'`` ...) or a KVStore object.
        loss_reduction: ``'mean'`` when ``loss_fn`` averages over its samples
            (each replica's loss is then weighted by its share of the batch),
            ``'sum'`` when it sums.
        threads: run the replicas in threads (otherwise one after another).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optimizer | dict | str,
                 devices: Sequence[str | torch.device] = ("cpu", "cpu"),
                 work_load_list: Sequence[float] | None = None, kvstore: str | KVStore = "device",
                 loss_reduction: str = "mean", threads: bool = True) -> None:
        if not devices:
            raise ConfigError("DataParallelTrainer needs at least one device")
        self.devices = [torch.device(d) for d in devices]
        loads = list(work_load_list) if work_load_list is not None else [1] * len(self.devices)
        if len(loads) != len(self.devices):
            raise ConfigError(f"work_load_list has {len(loads)} entries for {len(self.devices)} devices; "
                              "give one relative speed per device")
        self.work_load_list = check_work_load_list(loads)
        if loss_reduction not in ("mean", "sum"):
            raise ConfigError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.loss_reduction = loss_reduction
        if isinstance(kvstore, KVStore):
            self.kvstore = kvstore
        elif kvstore in ("local", "device"):
            self.kvstore = create_kvstore(kvstore, work_load_list=loads)
        else:
            self.kvstore = create_kvstore(kvstore)
        self.kvstore.set_optimizer(optimizer)

        self.model = model.to(self.devices[0])
        self.replicas = [self.model] + [copy.deepcopy(self.model).to(d) for d in self.devices[1:]]
        self._names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self._params = [dict(r.named_parameters()) for r in self.replicas]
        self.kvstore.init(self._names, [self._params[0][n].detach() for n in self._names])
        self._pull()  # every replica starts from the stored (rank 0's) weights
        self._pool = ThreadPoolExecutor(len(self.replicas), "hora-replica") if threads and len(
            self.replicas) > 1 else None

    def step(self, data: Batch, target: Batch | None, loss_fn: Callable[..., torch.Tensor]) -> float:
        """One training step on a batch: split, forward/backward per device, sum, update, broadcast.

        Args:
            data: the inputs, a tensor or a sequence of tensors (split along dim 0).
            target: the targets (split the same way), or None.
            loss_fn: ``loss_fn(output, target)`` (or ``loss_fn(output)`` when
                target is None), reduced as ``loss_reduction`` says.

        Returns:
            The loss over the whole batch (mean or sum, as ``loss_fn``).
        """
        inputs = [data] if isinstance(data, torch.Tensor) else list(data)
        batch = int(inputs[0].shape[0])
        slices = split_input_slice(batch, self.work_load_list)

        def run(i: int) -> float:
            replica, device, part = self.replicas[i], self.devices[i], slices[i]
            for p in self._params[i].values():
                p.grad = None
            xs = [x[part].to(device, non_blocking=True) for x in inputs]
            out = replica(*xs)
            if target is None:
                loss = loss_fn(out)
            else:
                ys = [target[part]] if isinstance(target, torch.Tensor) else [t[part] for t in target]
                loss = loss_fn(out, *[y.to(device, non_blocking=True) for y in ys])
            if self.loss_reduction == "mean":
                loss = loss * ((part.stop - part.start) / batch)
            loss.backward()
            return float(loss.detach())

        if self._pool is not None:
            losses = list(self._pool.map(run, range(len(self.replicas))))
        else:
            losses = [run(i) for i in range(len(self.replicas))]
        grads = []
        for name in self._names:
            per_device = []
            for params in self._params:
                p = params[name]
                per_device.append(p.grad if p.grad is not None else torch.zeros_like(p))
            grads.append(per_device)
        self.kvstore.push(self._names, grads)
        self._pull()
        self._sync_buffers()
        return float(sum(losses))

    def _pull(self) -> None:
        self.kvstore.pull(self._names, out=[[params[n].data for params in self._params] for n in self._names])

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        if len(self.replicas) == 1:
            return
        buffers = [dict(r.named_buffers()) for r in self.replicas]
        for name, first in buffers[0].items():
            if first.is_floating_point():
                total = sum(b[name].to(first.device) for b in buffers[1:]) + first
                first.copy_(total / len(buffers))
            for b in buffers[1:]:
                b[name].copy_(first)

    def close(self) -> None:
        """Stop the worker threads and close the store.  Idempotent."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.kvstore.close()

    def __enter__(self) -> DataParallelTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["DataParallelTrainer"]
