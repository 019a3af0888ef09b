"""The 'local' and 'device' KVStores and DataParallelTrainer, in one process."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import hora.kvstore as kvs
from hora.errors import ConfigError
from hora.kvstore.compression import TwoBitCompressor
from hora.kvstore.local import split_input_slice

TYPES = ["local", "device"]
CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("kv_type", TYPES)
def test_push_sums_device_values_and_pull_broadcasts(kv_type):
    kv = kvs.create(kv_type)
    kv.init(3, torch.zeros(2, 3))
    kv.push(3, [torch.ones(2, 3), torch.full((2, 3), 2.0), np.full((2, 3), 4.0, np.float32)])
    outs = [torch.empty(2, 3), np.empty((2, 3), np.float32)]
    kv.pull(3, out=outs)
    assert torch.equal(outs[0], torch.full((2, 3), 7.0))
    np.testing.assert_array_equal(outs[1], np.full((2, 3), 7.0))


@pytest.mark.parametrize("kv_type", TYPES)
def test_without_optimizer_push_assigns_the_sum(kv_type):
    """MXNet's default updater is ASSIGN: a second push replaces the value, it does not accumulate."""
    kv = kvs.create(kv_type)
    kv.init("w", np.ones(4, np.float32))
    kv.push("w", [np.ones(4, np.float32)] * 2)
    kv.push("w", [np.full(4, 3.0, np.float32)] * 2)
    out = np.zeros(4, np.float32)
    kv.pull("w", out=out)
    np.testing.assert_array_equal(out, np.full(4, 6.0))


def test_list_forms_and_int_and_str_keys():
    kv = kvs.create("local")
    kv.init([5, 7], [np.zeros(2), np.zeros(3)])
    kv.push([5, 7], [[np.ones(2), np.ones(2)], np.full(3, 2.0)])
    a, b1, b2 = np.zeros(2), np.zeros(3), np.zeros(3)
    kv.pull([5, 7], out=[a, [b1, b2]])
    assert a.tolist() == [2.0, 2.0] and b1.tolist() == b2.tolist() == [2.0] * 3
    with pytest.raises(ConfigError, match="do not mix int and str keys"):
        kv.init("x", np.zeros(1))
    s = kvs.create("local")
    s.init(["a", "b"], [torch.zeros(1), torch.zeros(1)])
    s.pushpull(["a", "b"], [torch.ones(1), torch.full((1,), 2.0)])
    out = torch.zeros(1)
    s.pull("b", out=out)
    assert out.item() == 2.0


@pytest.mark.parametrize("kv_type", TYPES)
@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_key_keeps_its_dtype(kv_type, dtype):
    kv = kvs.create(kv_type)
    kv.init("k", np.zeros(3, dtype))
    kv.push("k", [np.ones(3, np.float32), torch.ones(3, dtype=torch.float64)])
    assert kv._store["k"].dtype == dtype
    out64 = np.zeros(3, np.float64)
    kv.pull("k", out=out64)
    np.testing.assert_array_equal(out64, [2.0] * 3)
    t = kvs.create(kv_type)
    t.init("k", torch.zeros(3, dtype=torch.float64))
    t.push("k", torch.ones(3, dtype=torch.float32))
    assert t._store["k"].dtype == torch.float64


@pytest.mark.parametrize("kv_type", TYPES)
def test_local_store_copies_values(kv_type):
    """init/push copy their inputs: changing the caller's arrays later changes nothing stored."""
    kv = kvs.create(kv_type)
    v = torch.ones(2)
    kv.init("k", v)
    v.add_(5)
    g = torch.ones(2)
    kv.push("k", g)
    g.add_(5)
    out = torch.zeros(2)
    kv.pull("k", out=out)
    assert out.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("kv_type", TYPES)
def test_errors_are_clear(kv_type):
    kv = kvs.create(kv_type)
    with pytest.raises(ConfigError, match="has not been initialised"):
        kv.push("nope", np.zeros(2))
    with pytest.raises(ConfigError, match="has not been initialised"):
        kv.pull("nope", out=np.zeros(2))
    kv.init("k", np.zeros(2))
    with pytest.raises(ConfigError, match="already initialised"):
        kv.init("k", np.zeros(2))
    with pytest.raises(ConfigError, match=r"shape \(3,\).*shape \(2,\)"):
        kv.push("k", [np.zeros(2), np.zeros(3)])
    with pytest.raises(ConfigError, match=r"out array 0 has shape \(1, 2\)"):
        kv.pull("k", out=np.zeros((1, 2)))
    with pytest.raises(ConfigError, match="needs out="):
        kv.pull("k")
    with pytest.raises(ConfigError, match="no optimizer"):
        kv.save_optimizer_states("/nonexistent/x")
    with pytest.raises(ConfigError, match="unknown KVStore type"):
        kvs.create("dist_sync_mpi")


@pytest.mark.parametrize("kv_type", TYPES)
def test_optimizer_runs_once_on_the_sum(kv_type):
    kv = kvs.create(kv_type)
    w0 = np.linspace(-1, 1, 5).astype(np.float32)
    kv.init(0, torch.from_numpy(w0.copy()))
    kv.set_optimizer(kvs.SGD(learning_rate=0.1, momentum=0.9, wd=0.01))
    ref = kvs.create_updater({"type": "sgd", "learning_rate": 0.1, "momentum": 0.9, "wd": 0.01})
    w_ref = w0.copy()
    rng = np.random.default_rng(0)
    for _ in range(4):
        g1, g2 = (rng.standard_normal(5).astype(np.float32) for _ in range(2))
        kv.push(0, [torch.from_numpy(g1), torch.from_numpy(g2)])
        ref("0", g1 + g2, w_ref)
    out = torch.zeros(5)
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out.numpy(), w_ref)


def test_set_optimizer_accepts_spec_and_name():
    for opt in ({"type": "adam", "learning_rate": 0.1}, "sgd"):
        kv = kvs.create("local")
        kv.init("k", np.ones(2, np.float32))
        kv.set_optimizer(opt)
        kv.push("k", np.ones(2, np.float32))
        out = np.zeros(2, np.float32)
        kv.pull("k", out=out)
        assert (out < 1).all()
    with pytest.raises(ConfigError):
        kvs.create("local").set_optimizer(42)


def test_custom_updater_sees_the_users_key():
    seen = []

    def updater(key, merged, stored):
        seen.append(key)
        stored += 2 * merged

    kv = kvs.create("local")
    kv.init(9, np.zeros(2))
    kv._set_updater(updater)
    kv.push(9, [np.ones(2), np.ones(2)])
    out = np.zeros(2)
    kv.pull(9, out=out)
    assert seen == [9] and out.tolist() == [4.0, 4.0]


def test_save_and_load_optimizer_states(tmp_path):
    def run(kv, grads):
        for g in grads:
            kv.push("k", [torch.from_numpy(g), torch.from_numpy(g)])

    grads = [np.random.default_rng(i).standard_normal(6).astype(np.float32) for i in range(6)]
    full = kvs.create("local")
    full.init("k", torch.ones(6))
    full.set_optimizer(kvs.Adam(learning_rate=0.05))
    run(full, grads)

    first = kvs.create("local")
    first.init("k", torch.ones(6))
    first.set_optimizer(kvs.Adam(learning_rate=0.05))
    run(first, grads[:3])
    first.save_optimizer_states(str(tmp_path / "opt.states"))
    mid = torch.zeros(6)
    first.pull("k", out=mid)

    second = kvs.create("local")
    second.init("k", mid)
    second.set_optimizer(kvs.Adam(learning_rate=0.05))
    second.load_optimizer_states(str(tmp_path / "opt.states"))
    run(second, grads[3:])
    a, b = torch.zeros(6), torch.zeros(6)
    full.pull("k", out=a)
    second.pull("k", out=b)
    assert torch.equal(a, b)


def test_gradient_compression_local_refused_device_quantises_each_device():
    with pytest.raises(ConfigError, match="not supported by the 'local'"):
        kvs.create("local").set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv = kvs.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("k", np.zeros(3, np.float32))
    ref = [TwoBitCompressor(0.5), TwoBitCompressor(0.5)]
    out = np.zeros(3, np.float32)
    g = [np.array([0.3, -0.6, 0.1], np.float32), np.array([0.4, 0.2, -0.5], np.float32)]
    for step in range(3):
        kv.push("k", g)
        expected = sum(c.decompress(c.compress("k", x), 3) for c, x in zip(ref, g, strict=True))
        kv.pull("k", out=out)
        np.testing.assert_array_equal(out, expected, err_msg=f"step {step}")
    # step 0: [0, -.5, 0] + [0, 0, -.5]; the residuals then carry 0.3 and 0.4 into step 1
    assert ref[0].residual("k") is not None


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_device_sums_on_the_first_values_device():
    kv = kvs.create("device")
    kv.init("k", torch.zeros(4))
    kv.set_optimizer(kvs.SGD(learning_rate=1.0))
    kv.push("k", [torch.ones(4, device="cuda:0"), torch.ones(4)])
    assert kv._store["k"].device.type == "cuda"
    outs = [torch.zeros(4), torch.zeros(4, device="cuda:0")]
    kv.pull("k", out=outs)
    assert outs[0].tolist() == [-2.0] * 4 and outs[1].cpu().tolist() == [-2.0] * 4
    local = kvs.create("local")
    local.init("k", torch.zeros(4))
    local.push("k", [torch.ones(4, device="cuda:0"), torch.ones(4)])
    assert local._store["k"].device.type == "cpu"


# ------------------------------------------------------------------------- work_load_list
@pytest.mark.parametrize(("batch", "loads", "expected"), [
    (8, [3, 1], [(0, 6), (6, 8)]),
    (10, [3, 1], [(0, 8), (8, 10)]),  # round(7.5) = 8, round(2.5) = 2 (Python's rounding, as MXNet)
    (10, [1, 1, 1], [(0, 3), (3, 6), (6, 10)]),  # the last slice takes the remainder
    (7, [1, 2], [(0, 2), (2, 7)]),
    (5, [1], [(0, 5)]),
])
def test_split_input_slice(batch, loads, expected):
    assert [(s.start, s.stop) for s in split_input_slice(batch, loads)] == expected


@pytest.mark.parametrize(("batch", "loads", "match"), [
    (2, [1, 1, 1], "no samples"), (8, [], "positive"), (8, [1, 0], "positive"), (8, [1, -2], "positive"),
    (0, [1, 1], "batch size"), (8, "31", "positive"),
])
def test_split_input_slice_errors(batch, loads, match):
    with pytest.raises(ConfigError, match=match):
        split_input_slice(batch, loads)


def test_store_split_batch_uses_its_work_load_list():
    kv = kvs.create("device", work_load_list=[3, 1])
    assert [(s.start, s.stop) for s in kv.split_batch(8)] == [(0, 6), (6, 8)]
    with pytest.raises(ConfigError, match="2 entries but there are 3 devices"):
        kv.split_batch(8, num_devices=3)
    with pytest.raises(ConfigError, match="positive"):
        kvs.create("local", work_load_list=[1, 0])


# --------------------------------------------------------------------- DataParallelTrainer
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches(n: int, batch: int = 12):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def _reference(optimizer, batches, reduction="mean"):
    """One model on the whole batch, updated by the same optimizer rule."""
    model = _model()
    updater = kvs.Updater(optimizer)
    for x, y in batches:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y, reduction=reduction).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                updater(name, p.grad, p)
    return model


@pytest.mark.parametrize(("kv_type", "devices", "loads", "threads"), [
    ("device", ["cpu", "cpu"], [3, 1], True),
    ("local", ["cpu", "cpu"], [3, 1], False),
    ("device", ["cpu", "cpu", "cpu"], [1, 2, 1], True),
    ("local", ["cpu"], None, True),
])
@pytest.mark.parametrize("make_opt", [
    lambda: kvs.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3), lambda: kvs.Adam(learning_rate=0.01),
], ids=["sgd", "adam"])
def test_trainer_equals_one_model_on_the_whole_batch(kv_type, devices, loads, threads, make_opt):
    batches = _batches(5)
    ref = _reference(make_opt(), batches)
    model = _model()
    with kvs.DataParallelTrainer(model, make_opt(), devices=devices, work_load_list=loads, kvstore=kv_type,
                                 threads=threads) as trainer:
        for x, y in batches:
            loss = trainer.step(x, y, torch.nn.functional.cross_entropy)
        for replica in trainer.replicas[1:]:
            for a, b in zip(replica.parameters(), model.parameters(), strict=True):
                assert torch.equal(a, b)  # every replica holds the same weights
    assert loss > 0
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} differs from the whole-batch model")


def test_trainer_matches_torch_sgd_and_sum_reduction():
    batches = _batches(4, batch=9)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-3)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
        opt.step()
    model = _model()
    trainer = kvs.DataParallelTrainer(model, {"type": "sgd", "learning_rate": 0.01, "momentum": 0.9, "wd": 1e-3},
                                      devices=["cpu", "cpu"], work_load_list=[2, 1], loss_reduction="sum")
    for x, y in batches:
        trainer.step(x, y, lambda out, t: torch.nn.functional.cross_entropy(out, t, reduction="sum"))
    trainer.close()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_trainer_averages_float_buffers_and_validates_arguments():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    trainer = kvs.DataParallelTrainer(copy.deepcopy(model), "sgd", devices=["cpu", "cpu"])
    trainer.step(torch.randn(8, 4), None, lambda out: out.pow(2).mean())
    bn = [r[1] for r in trainer.replicas]
    assert torch.equal(bn[0].running_mean, bn[1].running_mean)
    assert not torch.equal(bn[0].running_mean, torch.zeros(4))
    trainer.close()
    with pytest.raises(ConfigError, match="one relative speed per device"):
        kvs.DataParallelTrainer(_model(), "sgd", devices=["cpu", "cpu"], work_load_list=[1])
    with pytest.raises(ConfigError, match="at least one device"):
        kvs.DataParallelTrainer(_model(), "sgd", devices=[])
    with pytest.raises(ConfigError, match="loss_reduction"):
        kvs.DataParallelTrainer(_model(), "sgd", loss_reduction="none")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_trainer_on_cuda_and_cpu_matches_whole_batch():
    batches = _batches(3)
    ref = _reference(kvs.SGD(learning_rate=0.1, momentum=0.9), batches)
    model = _model()
    trainer = kvs.DataParallelTrainer(model, kvs.SGD(learning_rate=0.1, momentum=0.9),
                                      devices=["cuda:0", "cpu"], work_load_list=[3, 1], kvstore="device")
    for x, y in batches:
        trainer.step(x, y, torch.nn.functional.cross_entropy)
    trainer.close()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)
