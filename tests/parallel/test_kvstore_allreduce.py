"""dist_sync_allreduce on every rank of a `hora run` job: sums, broadcast, optimizer, compression.

Launched by tests/kvstore/test_allreduce.py (2 ranks, gloo and MPI) and with the
rest of tests/parallel by tests/test_multiprocess.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hora.kvstore as kvs
import hora.torch as hvd
from hora.errors import ConfigError
from hora.kvstore.compression import TwoBitCompressor


@pytest.fixture
def kv():
    store = kvs.create("dist_sync_allreduce")
    yield store
    store.close()


def test_identity_and_barrier(kv):
    assert kv.type == "dist_sync_allreduce"
    assert (kv.rank, kv.num_workers) == (hvd.rank(), hvd.size())
    kv.barrier()


def test_init_broadcasts_rank0_value(kv):
    r = kv.rank
    kv.init(["a", "b"], [torch.full((3,), float(r + 10)), np.full((2, 2), r + 1, np.int64)])
    a, b = torch.zeros(3), np.zeros((2, 2), np.int64)
    kv.pull(["a", "b"], out=[a, b])
    assert a.tolist() == [10.0] * 3 and b.tolist() == [[1, 1], [1, 1]]


def test_push_sums_devices_then_ranks(kv):
    r, n = kv.rank, kv.num_workers
    kv.init(0, torch.zeros(5))
    kv.push(0, [torch.full((5,), r + 1.0), torch.full((5,), 2.0 * (r + 1))])
    outs = [torch.zeros(5), np.zeros(5, np.float32)]
    kv.pull(0, out=outs)
    expected = 3.0 * sum(range(1, n + 1))
    assert outs[0].tolist() == [expected] * 5 and outs[1].tolist() == [expected] * 5


def test_many_keys_in_flight_keep_their_dtypes(kv):
    r, n = kv.rank, kv.num_workers
    dtypes = [np.float32, np.float64, np.int32, np.float16]
    keys = [f"k{i}" for i in range(16)]
    kv.init(keys, [np.zeros(i + 1, dtypes[i % 4]) for i in range(16)])
    kv.push(keys, [np.full(i + 1, r + i, dtypes[i % 4]) for i in range(16)])  # all in flight together
    outs = [np.zeros(i + 1, dtypes[i % 4]) for i in range(16)]
    kv.pull(keys, out=outs)
    for i, out in enumerate(outs):
        assert kv._store[keys[i]].dtype == dtypes[i % 4]
        assert out.tolist() == [sum(q + i for q in range(n))] * (i + 1), keys[i]


def test_without_optimizer_push_assigns(kv):
    kv.init("w", np.ones(2))
    kv.push("w", np.ones(2))
    kv.push("w", np.full(2, 5.0))  # the second push waits for the first: the value is replaced, not added
    out = np.zeros(2)
    kv.pull("w", out=out)
    assert out.tolist() == [5.0 * kv.num_workers] * 2


def test_optimizer_runs_identically_on_every_rank(kv):
    r, n = kv.rank, kv.num_workers
    w0 = np.linspace(-1, 1, 7).astype(np.float32)
    kv.init("w", w0)
    kv.set_optimizer(kvs.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=1.0 / n))
    ref = kvs.create_updater({"type": "sgd", "learning_rate": 0.1, "momentum": 0.9, "wd": 0.01,
                              "rescale_grad": 1.0 / n})
    w_ref = w0.copy()
    for step in range(3):
        grads = [np.full(7, (q + 1) * (step + 1) / 8.0, np.float32) for q in range(n)]
        kv.pushpull("w", grads[r], out=np.zeros(7, np.float32))
        total = grads[0].copy()
        for g in grads[1:]:
            total += g
        ref("w", total, w_ref)
    out = np.zeros(7, np.float32)
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out, w_ref)
    # every rank holds the same bits
    gathered = hvd.allgather(torch.from_numpy(out).view(1, -1))
    assert all(torch.equal(gathered[0], gathered[i]) for i in range(n))


def test_two_bit_compression_sums_every_ranks_quantised_push(kv):
    r, n = kv.rank, kv.num_workers
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("g", torch.zeros(19))
    ranks = [TwoBitCompressor(0.5) for _ in range(n)]  # every rank's residuals, replayed here
    rng = np.random.default_rng(7)
    for step in range(3):
        grads = [(rng.standard_normal(19) * 0.4).astype(np.float32) for _ in range(n)]
        kv.push("g", torch.from_numpy(grads[r]))
        out = torch.zeros(19)
        kv.pull("g", out=out)
        expected = ranks[0].decompress(ranks[0].compress("g", grads[0]), 19)
        for q in range(1, n):
            expected += ranks[q].decompress(ranks[q].compress("g", grads[q]), 19)
        np.testing.assert_array_equal(out.numpy(), expected, err_msg=f"step {step}")


def test_save_and_load_optimizer_states(kv, tmp_path_factory):
    kv.init("w", torch.ones(4))
    kv.set_optimizer(kvs.Adam(learning_rate=0.1))
    kv.push("w", torch.ones(4))
    path = tmp_path_factory.mktemp(f"rank{kv.rank}") / "opt.states"
    kv.save_optimizer_states(str(path))
    kv.load_optimizer_states(str(path))
    kv.push("w", torch.ones(4))
    out = torch.zeros(4)
    kv.pull("w", out=out)
    assert (out < 1).all()


def test_local_errors_need_no_collective(kv):
    with pytest.raises(ConfigError, match="has not been initialised"):
        kv.pull("missing", out=np.zeros(1))
    kv.init("k", np.zeros(2))
    with pytest.raises(ConfigError, match="already initialised"):
        kv.init("k", np.zeros(2))
    with pytest.raises(ConfigError, match="shape"):
        kv.push("k", np.zeros(3))
    with pytest.raises(ConfigError, match="dtype uint16"):
        kv.init("u", np.zeros(2, np.uint16))


def test_trainer_over_ranks_and_devices_equals_one_model_on_the_global_batch():
    n, r = hvd.size(), hvd.rank()

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))

    g = torch.Generator().manual_seed(3)
    steps = [[(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)] for _ in range(3)]
    ref = model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for per_rank in steps:
        opt.zero_grad()
        x = torch.cat([b[0] for b in per_rank])
        y = torch.cat([b[1] for b in per_rank])
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()

    mine = model()
    trainer = kvs.DataParallelTrainer(mine, kvs.SGD(learning_rate=0.05, momentum=0.9, rescale_grad=1.0 / n),
                                      devices=["cpu", "cpu"], work_load_list=[2, 1], kvstore="dist_sync_allreduce")
    for per_rank in steps:
        trainer.step(per_rank[r][0], per_rank[r][1], torch.nn.functional.mse_loss)
    trainer.close()
    for a, b in zip(mine.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
