"""``DistributedOptimizer(..., kvstore=...)``: gradients through a KVStore (parameter servers).

The allreduce optimizer averages gradients among the workers.  This one
pushes each gradient to a :mod:`hora.kvstore` store as soon as backward
produces it (a post-accumulate-grad hook), and ``step()`` pulls:

* with a **server optimizer** the servers hold the weights and update them;
  ``step()`` pulls the new weights into the parameters, and the wrapped
  torch optimizer only describes the update (its type, LR, momentum...).
  ``dist_async`` always works this way: MXNet's asynchronous store is only
  meaningful with the update on the servers.
* without one, the store sums the gradients of all workers; ``step()`` pulls
  the sum into ``p.grad``, divides by the number of workers and runs the
  wrapped torch optimizer locally on every worker.

Every worker starts from worker 0's weights: ``init`` stores them and every
worker pulls them back, which is the KVStore way of broadcasting parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from hora.errors import ConfigError, HoraError
from hora.torch.optimizer_base import WrappedOptimizer, parameter_names

log = logging.getLogger(__name__)


def server_optimizer_from_torch(optimizer: torch.optim.Optimizer, num_workers: int) -> Any:
    """Describe a torch ``SGD`` or ``Adam`` as the equivalent :mod:`hora.kvstore.optimizer` object.

    The servers see the *sum* of the workers' gradients, each already a mean
    over its own batch, so ``rescale_grad = 1 / num_workers`` turns the sum
    into the average, as MXNet's Module does for ``dist`` stores.

    Raises:
        ConfigError: the optimizer type or one of its options has no server
            equivalent, or param groups use different hyper-parameters.
    """
    from hora.kvstore import optimizer as kvopt

    groups = optimizer.param_groups
    keys = ("lr", "momentum", "weight_decay", "betas", "eps")
    first = {k: groups[0].get(k) for k in keys}
    if any({k: g.get(k) for k in keys} != first for g in groups[1:]):
        raise ConfigError("a server optimizer applies one set of hyper-parameters to every key; this torch "
                          "optimizer has param groups with different lr/momentum/weight_decay")
    g = groups[0]
    rescale = 1.0 / num_workers
    if isinstance(optimizer, torch.optim.SGD):
        if g.get("nesterov") or g.get("dampening", 0.0) or g.get("maximize"):
            raise ConfigError("SGD with nesterov, dampening or maximize has no server-side equivalent; "
                              "use plain momentum SGD, or server_optimizer=None to update on the workers")
        return kvopt.SGD(learning_rate=float(g["lr"]), momentum=float(g.get("momentum", 0.0)),
                         wd=float(g.get("weight_decay", 0.0)), rescale_grad=rescale)
    if type(optimizer) is torch.optim.Adam:
        if g.get("amsgrad") or g.get("maximize"):
            raise ConfigError("Adam with amsgrad or maximize has no server-side equivalent")
        beta1, beta2 = g["betas"]
        return kvopt.Adam(learning_rate=float(g["lr"]), beta1=float(beta1), beta2=float(beta2),
                          epsilon=float(g["eps"]), wd=float(g.get("weight_decay", 0.0)), rescale_grad=rescale)
    raise ConfigError(f"{type(optimizer).__name__} cannot run on the parameter servers (SGD and Adam can); pass "
                      "server_optimizer=hora.kvstore.optimizer.<Optimizer>(...) yourself, or server_optimizer=None "
                      "to update on the workers")


class KVStoreOptimizer(WrappedOptimizer):
    """Wraps a torch optimizer; gradients go through a KVStore.  See :func:`DistributedOptimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable | None, kvstore: Any,
                 server_optimizer: Any, backward_passes_per_step: int) -> None:
        from hora import kvstore as kvs

        self._opt = optimizer
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        self.backward_passes_per_step = backward_passes_per_step
        self._kv = kvs.create(kvstore) if isinstance(kvstore, str) else kvstore
        if not isinstance(self._kv, kvs.KVStore):
            raise TypeError(f"kvstore must be a KVStore type name or a hora.kvstore.KVStore, "
                            f"got {type(kvstore).__name__}")
        all_params = [p for g in optimizer.param_groups for p in g["params"]]
        self._names = parameter_names(all_params, named_parameters)
        self._params = [p for p in all_params if p.requires_grad]
        self._key = {id(p): self._names[id(p)] for p in self._params}

        if server_optimizer is None and self._kv.type == "dist_async":
            server_optimizer = "auto"  # asynchronous pushes only make sense when the servers update
        if isinstance(server_optimizer, str):
            if server_optimizer != "auto":
                raise ConfigError(f"server_optimizer={server_optimizer!r}: use None, 'auto' or a "
                                  "hora.kvstore.optimizer.Optimizer")
            server_optimizer = server_optimizer_from_torch(optimizer, self._kv.num_workers)
        self._server_update = server_optimizer is not None

        keys = [self._key[id(p)] for p in self._params]
        with torch.no_grad():
            self._kv.init(keys, [p.detach() for p in self._params])
            if self._server_update:
                self._kv.set_optimizer(server_optimizer)
            self._kv.pull(keys, out=[p.detach() for p in self._params])

        self._passes: dict[int, int] = {}
        self._pushed: set[int] = set()
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]

    @property
    def kvstore(self) -> Any:
        """The :class:`hora.kvstore.KVStore` the gradients go through."""
        return self._kv

    def pull_parameters(self) -> None:
        """Copy the weights the servers hold into the parameters, without pushing.

        Useful at the end of ``dist_async`` training, when workers finish at
        different times: after a ``kvstore.barrier()`` every worker pulls the
        same final weights.
        """
        if not self._server_update:
            raise HoraError("pull_parameters() needs the update on the servers; without a server optimizer "
                            "every worker already holds the same weights")
        with torch.no_grad():
            self._kv.pull([self._key[id(p)] for p in self._params], out=[p.detach() for p in self._params])

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        key = id(p)
        if key in self._pushed:
            raise HoraError("gradients were computed more than backward_passes_per_step times before step(); "
                            "increase backward_passes_per_step, or call step() between backward passes")
        self._passes[key] = self._passes.get(key, 0) + 1
        if self._passes[key] >= self.backward_passes_per_step:
            self._push([p])

    def _push(self, params: list[torch.Tensor]) -> None:
        dense = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # unused this step here; other workers may have a gradient
            self._pushed.add(id(p))
            if p.grad.is_sparse and self._push_rows(p):
                continue
            if p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            dense.append(p)
        if dense:
            self._kv.push([self._key[id(p)] for p in dense], [p.grad for p in dense])

    def _push_rows(self, p: torch.Tensor) -> bool:
        """Push a sparse COO gradient of whole rows (``nn.Embedding(sparse=True)``) as row ids and rows only;
        False when the store or the gradient's layout cannot (it is then pushed dense)."""
        push_rows = getattr(self._kv, "push_rows", None)
        if push_rows is None or p.dim() < 2 or p.grad.sparse_dim() != 1:
            return False
        grad = p.grad.coalesce()
        push_rows(self._key[id(p)], grad.indices()[0], grad.values())
        return True

    def pull_rows(self, param: torch.Tensor, row_ids: torch.Tensor) -> None:
        """Copy the servers' rows ``row_ids`` of ``param`` into it, and only those (MXNet's row_sparse_pull).

        For an embedding whose next batch reads a few rows: only they travel.
        Needs the update on the servers and a parameter-server store.

        Raises:
            HoraError: no server update, or the store cannot pull rows.
        """
        pull_rows = getattr(self._kv, "pull_rows", None)
        if not self._server_update or pull_rows is None:
            raise HoraError("pull_rows() needs the update on the servers of a parameter-server store "
                            "(kvstore='dist_sync' or 'dist_async' with a server optimizer)")
        ids, rows = pull_rows(self._key[id(param)], row_ids)
        with torch.no_grad():
            param[torch.from_numpy(ids).to(param.device)] = torch.from_numpy(rows).to(param.device, param.dtype)

    def synchronize(self) -> None:
        """Push what backward has not pushed yet, then pull: weights (server update) or summed gradients."""
        self._push([p for p in self._params if id(p) not in self._pushed])
        keys = [self._key[id(p)] for p in self._params]
        with torch.no_grad():
            if self._server_update:
                self._kv.pull(keys, out=[p.detach() for p in self._params])
            else:
                for p in self._params:
                    if p.grad.is_sparse:  # the pulled sum of rows pushed by several workers is dense
                        p.grad = torch.zeros_like(p)
                self._kv.pull(keys, out=[p.grad for p in self._params])
                scale = 1.0 / self._kv.num_workers
                for p in self._params:
                    p.grad.mul_(scale)
        self._pushed.clear()
        self._passes.clear()
        self._synchronized = True

    def step(self, closure=None):
        loss = None
        if self._server_update and closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
        self._synchronized = False
        if self._server_update:
            return loss  # the servers applied the update; the pulled weights are already in place
        return self._opt.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pushed:
            raise HoraError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step(); "
                            "that would discard gradients already pushed to the KVStore")
        self._opt.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        where = "server" if self._server_update else "worker"
        return f"DistributedOptimizer({self._opt!r}, kvstore={self._kv.type!r}, update on {where})"
