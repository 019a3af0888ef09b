"""torch ``nn.Embedding(sparse=True)`` through ``hvd.DistributedOptimizer(..., kvstore=...)`` on real servers.

Run by tests/kvstore/test_ps_sparse.py under ``hora run -np 2 -s 2``: the
sparse COO gradients travel as row ids and rows (``push_rows``); the model
must reach the weights of the same model with a dense embedding, and of one
process training on both workers' batches.  ``pull_rows`` with a tensor of
row ids brings back just those rows.  Prints ``TORCH SPARSE OK``.
"""

from __future__ import annotations

import numpy as np
import torch

import hora.kvstore as kvs
import hora.torch as hvd

ROWS, DIM, BATCH, STEPS = 50, 4, 6, 5


def model(sparse: bool) -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Embedding(ROWS, DIM, sparse=sparse), torch.nn.Linear(DIM, 1))


def batches(workers: int) -> torch.Tensor:
    return torch.from_numpy(np.random.RandomState(5).randint(0, ROWS, size=(STEPS, workers, BATCH)))


def loss_of(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (net(x) ** 2).mean()


def train(kv, sparse: bool, rank: int, workers: int, tag: str) -> tuple[torch.nn.Module, object]:
    net = model(sparse)
    named = [(f"{tag}.{n}", p) for n, p in net.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5), named_parameters=named, kvstore=kv,
                                   server_optimizer="auto")
    for x in batches(workers):
        opt.zero_grad()
        loss_of(net, x[rank]).backward()
        if sparse:
            assert net[0].weight.grad.is_sparse
        opt.step()
    return net, opt


def main() -> None:
    kv = kvs.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    calls = []
    push_rows = kv.push_rows
    kv.push_rows = lambda *a: (calls.append(a[0]), push_rows(*a))  # record that the rows path carried them
    sparse_net, opt = train(kv, True, rank, workers, "sparse")
    assert calls == ["sparse.0.weight"] * STEPS, calls
    dense_net, _ = train(kv, False, rank, workers, "dense")
    ref = model(False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x in batches(workers):
        ref_opt.zero_grad()
        (sum(loss_of(ref, x[r]) for r in range(workers)) / workers).backward()
        ref_opt.step()
    start = model(False)[0].weight
    assert (sparse_net[0].weight - start).abs().max() > 1e-3, "the embedding did not train"
    for a, b, c in zip(sparse_net.parameters(), dense_net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    # a row_sparse_pull-style call: only the asked rows come back into the parameter
    weight = sparse_net[0].weight
    with torch.no_grad():
        weight.zero_()
    opt.pull_rows(weight, torch.tensor([3, 3, 7, 0]))
    asked = [0, 3, 7]
    torch.testing.assert_close(weight[asked], dense_net[0].weight[asked])
    others = [r for r in range(ROWS) if r not in asked]
    assert weight[others].abs().max() == 0
    out = torch.full((ROWS, DIM), 9.0)
    kv.row_sparse_pull("sparse.0.weight", out=out, row_ids=torch.tensor([7, 1]))
    torch.testing.assert_close(out[[1, 7]], dense_net[0].weight[[1, 7]].detach())
    assert out[[0, 2]].abs().max() == 0
    kv.barrier()
    kv.close()
    print("TORCH SPARSE OK", flush=True)


if __name__ == "__main__":
    main()
