"""hora.kvstore.optimizer: MXNet 1.9's update rules, schedules, specs and saved state."""

from __future__ import annotations

import ctypes
import math
import sys

import msgpack
import numpy as np
import pytest
import torch

from hora.errors import ConfigError
from hora.kvstore import optimizer as kvopt
from hora.kvstore.lr_scheduler import FactorScheduler, MultiFactorScheduler, PolyScheduler, scheduler_from_spec

f32 = np.float32


def _grads(n: int, steps: int, seed: int = 0, scale: float = 1.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * scale).astype(f32) for _ in range(steps)]


def _w0(n: int = 7) -> np.ndarray:
    return np.linspace(-1.5, 2.0, n, dtype=f32)


# --------------------------------------------------------------------------------- SGD
def _sgd_reference(w, grads, lr, momentum, wd, rescale, clip):
    """MXNet's sgd_mom_update kernel, written out per step in float32 in the kernel's order."""
    w = w.copy()
    mom = np.zeros_like(w)
    for g in grads:
        if clip is not None:
            term = f32(lr) * np.clip(f32(rescale) * g, -f32(clip), f32(clip))
        else:
            term = (f32(lr) * f32(rescale)) * g
        mom = f32(momentum) * mom - (f32(lr) * f32(wd)) * w - term
        w = w + mom
    return w, mom


@pytest.mark.parametrize("clip", [None, 0.3])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_matches_mxnet_kernel_bit_for_bit(momentum, clip):
    grads = _grads(7, 6)
    ref_w, ref_mom = _sgd_reference(_w0(), grads, 0.1, momentum, 0.01, 0.5, clip)
    upd = kvopt.create_updater(kvopt.SGD(learning_rate=0.1, momentum=momentum, wd=0.01, rescale_grad=0.5,
                                         clip_gradient=clip).spec())
    w = _w0()
    for g in grads:
        upd("k", g, w)
    np.testing.assert_array_equal(w, ref_w)
    states = upd.key_states("k")
    assert int(states["num_update"]) == len(grads)
    if momentum:
        np.testing.assert_array_equal(states["mom"], ref_mom)
    else:
        assert set(states) == {"num_update"}  # plain SGD keeps no state


@pytest.mark.parametrize("clip", [None, 0.0, -1.0])
def test_clip_gradient_off_for_none_zero_and_negative(clip):
    """MXNet clips only when clip_gradient is a positive number."""
    g = np.array([10.0, -10.0], f32)
    w = np.zeros(2, f32)
    kvopt.Updater(kvopt.SGD(learning_rate=1.0, clip_gradient=clip))("k", g, w)
    np.testing.assert_array_equal(w, -g)


def test_sgd_equals_torch_sgd_with_momentum_and_weight_decay():
    """With a constant rate MXNet's momentum form is torch's scaled by -lr: same trajectory."""
    grads = _grads(7, 10, seed=3)
    upd = kvopt.Updater(kvopt.SGD(learning_rate=0.05, momentum=0.9, wd=1e-3))
    w = _w0()
    p = torch.nn.Parameter(torch.from_numpy(_w0()))
    opt = torch.optim.SGD([p], lr=0.05, momentum=0.9, weight_decay=1e-3)
    for g in grads:
        upd("k", g, w)
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------- Adam
def _adam_reference(w, grads, lr, b1, b2, eps, wd, rescale, clip):
    """Adam as MXNet's python class + adam_update kernel define it, in float64 except that the
    kernel's ``1 - beta`` is computed from float32 betas (the kernel's DType)."""
    w = w.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    c1, c2 = float(f32(1) - f32(b1)), float(f32(1) - f32(b2))
    for t, g in enumerate(grads, start=1):
        lr_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        g = g * rescale + wd * w
        if clip is not None:
            g = np.clip(g, -clip, clip)
        m = float(f32(b1)) * m + c1 * g
        v = float(f32(b2)) * v + c2 * g * g
        w = w - lr_t * m / (np.sqrt(v) + eps)
    return w, m, v


@pytest.mark.parametrize("clip", [None, 0.5])
def test_adam_matches_mxnet_rule(clip):
    grads = _grads(7, 8, seed=5)
    ref_w, ref_m, ref_v = _adam_reference(_w0(), grads, 0.01, 0.9, 0.999, 1e-8, 0.01, 0.5, clip)
    upd = kvopt.create_updater({"type": "adam", "learning_rate": 0.01, "wd": 0.01, "rescale_grad": 0.5,
                                "clip_gradient": clip})
    w = _w0()
    for g in grads:
        upd("k", g, w)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    states = upd.key_states("k")
    np.testing.assert_allclose(states["mean"], ref_m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(states["var"], ref_v, rtol=1e-5, atol=1e-9)


def test_adam_without_rescale_gives_the_kernels_bits_for_special_values():
    """With rescale_grad 1 the update skips the gradient's ``* 1`` pass: the bits stay the float32 kernel's
    (``g = grad * 1 + w * wd`` ...), NaN, infinities, signed zeros and subnormals in the gradient included."""
    specials = np.array([-0.0, 0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 3.0, -2.5], f32)
    w0 = np.tile(np.array([0.0, -0.0, 1.5, -1.0], f32), 9)
    grads = [np.repeat(specials, 4), np.resize(specials[::-1], 36)]
    upd = kvopt.Updater(kvopt.Adam(learning_rate=0.01, wd=0.01))
    w = w0.copy()
    ref_w, m, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    b1, b2, eps, decay = f32(0.9), f32(0.999), f32(1e-8), f32(0.01)
    with np.errstate(all="ignore"):
        for t, g in enumerate(grads, start=1):
            upd("k", g, w)
            lr = f32(0.01 * math.sqrt(1.0 - 0.999 ** t) / (1.0 - 0.9 ** t))
            gr = g * f32(1) + ref_w * decay
            m = m * b1 + gr * (f32(1) - b1)
            v = v * b2 + (gr * (f32(1) - b2)) * gr
            ref_w = ref_w - (m * lr) / (np.sqrt(v) + eps)
    np.testing.assert_array_equal(w.view(np.uint32), ref_w.view(np.uint32))
    np.testing.assert_array_equal(upd.key_states("k")["mean"].view(np.uint32), m.view(np.uint32))


def test_adam_close_to_torch_adam():
    """Only epsilon's placement differs from torch (inside vs outside the bias correction)."""
    grads = _grads(7, 10, seed=6)
    upd = kvopt.Updater(kvopt.Adam(learning_rate=0.01, wd=1e-3))
    w = _w0()
    p = torch.nn.Parameter(torch.from_numpy(_w0()))
    opt = torch.optim.Adam([p], lr=0.01, weight_decay=1e-3)
    for g in grads:
        upd("k", g, w)
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", [
    lambda: kvopt.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, clip_gradient=0.4, rescale_grad=0.25),
    lambda: kvopt.Adam(learning_rate=0.01, wd=0.01, clip_gradient=0.8),
], ids=["sgd", "adam"])
def test_numpy_and_torch_paths_agree_bitwise(make):
    grads = _grads(33, 5, seed=9)
    up_np, up_t = kvopt.Updater(make()), kvopt.Updater(make())
    w_np = _w0(33)
    w_t = torch.from_numpy(_w0(33))
    for g in grads:
        up_np("k", g, w_np)
        up_t("k", torch.from_numpy(g.copy()), w_t)
    np.testing.assert_array_equal(w_np, w_t.numpy())


def test_multi_precision_keeps_float32_master_copy():
    opt = kvopt.SGD(learning_rate=0.001, multi_precision=True)
    upd = kvopt.Updater(opt)
    w = np.ones(4, np.float16)
    for _ in range(3):
        upd("k", np.full(4, 0.1, np.float16), w)
    master = upd.key_states("k")["weight32"]
    assert master.dtype == np.float32
    np.testing.assert_allclose(master, 1 - 3 * 0.001 * np.float32(np.float16(0.1)), rtol=1e-6)
    np.testing.assert_array_equal(w, master.astype(np.float16))


# --------------------------------------------------------------------------- schedules
def test_factor_scheduler_values_and_floor():
    s = FactorScheduler(step=2, factor=0.5, stop_factor_lr=0.2, base_lr=1.0)
    assert [s(n) for n in range(1, 9)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2, 0.2]
    # a fresh scheduler catches up in one call (restoring from a checkpoint)
    assert FactorScheduler(step=2, factor=0.5, base_lr=1.0)(5) == 0.25


def test_multifactor_scheduler_values():
    s = MultiFactorScheduler(step=[2, 4], factor=0.1, base_lr=1.0)
    got = [s(n) for n in range(1, 7)]
    np.testing.assert_allclose(got, [1.0, 1.0, 0.1, 0.1, 0.01, 0.01])
    with pytest.raises(ConfigError, match="increasing"):
        MultiFactorScheduler(step=[3, 3], factor=0.1)


def test_poly_scheduler_values_and_warmup():
    s = PolyScheduler(max_update=4, base_lr=1.0, pwr=2)
    np.testing.assert_allclose([s(n) for n in range(0, 6)], [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0])
    s = PolyScheduler(max_update=4, base_lr=1.0, pwr=2, final_lr=0.1)
    assert s(2) == pytest.approx(0.1 + 0.9 * 0.25)
    w = PolyScheduler(max_update=6, base_lr=1.0, pwr=1, warmup_steps=2, warmup_begin_lr=0.0)
    np.testing.assert_allclose([w(0), w(1), w(2), w(4), w(6)], [0.0, 0.5, 1.0, 0.5, 0.0])


def test_scheduler_sees_max_update_count_over_keys():
    """num_update is the max of the per-key counts (MXNet), bumped before the rate is read."""
    sched = FactorScheduler(step=1, factor=0.5, base_lr=1.0)
    upd = kvopt.Updater(kvopt.SGD(lr_scheduler=sched))
    one = np.ones(1, f32)
    a, b = np.zeros(1, f32), np.zeros(1, f32)
    deltas = []
    for _ in range(3):
        before = a.copy()
        upd("a", one, a)
        deltas.append(float((before - a)[0]))
    assert deltas == [1.0, 0.5, 0.25]
    upd("b", one, b)  # b's first update, but num_update is already 3
    assert float(-b[0]) == 0.25
    assert upd.optimizer.num_update == 3


def test_learning_rate_overrides_scheduler_base_lr():
    sched = FactorScheduler(step=10, base_lr=0.5)
    assert kvopt.SGD(lr_scheduler=sched).learning_rate == 0.5  # learning_rate=None: the scheduler's
    sched2 = FactorScheduler(step=10, base_lr=0.5)
    kvopt.SGD(learning_rate=0.2, lr_scheduler=sched2)
    assert sched2.base_lr == 0.2
    with pytest.raises(ConfigError, match="lr_scheduler"):
        kvopt.SGD(lr_scheduler=sched).set_learning_rate(0.1)


def test_lr_and_wd_multipliers_per_key():
    upd = kvopt.Updater(kvopt.SGD(learning_rate=1.0, wd=0.5, lr_mult={3: 0.1}, wd_mult={"b": 0.0}))
    w3, wb = np.ones(1, f32), np.ones(1, f32)
    upd("3", np.zeros(1, f32), w3)
    upd("b", np.zeros(1, f32), wb)
    np.testing.assert_allclose(w3, [1 - 0.1 * 0.5])
    np.testing.assert_array_equal(wb, [1.0])


# ------------------------------------------------------------------------------- specs
@pytest.mark.parametrize("sched", [
    lambda: None, lambda: FactorScheduler(step=3, factor=0.5, base_lr=0.3),
    lambda: MultiFactorScheduler(step=[2, 5], factor=0.1),
    lambda: PolyScheduler(max_update=10, base_lr=0.2, pwr=1.5, final_lr=0.01, warmup_steps=2),
], ids=["none", "factor", "multifactor", "poly"])
@pytest.mark.parametrize("cls", [kvopt.SGD, kvopt.Adam])
@pytest.mark.parametrize("lr", [0.05, None])
def test_spec_is_plain_data_and_rebuilds_the_same_optimizer(cls, sched, lr):
    kwargs = {"momentum": 0.9} if cls is kvopt.SGD else {"beta1": 0.8}
    opt = cls(learning_rate=lr, wd=1e-3, lr_scheduler=sched(), **kwargs)
    spec = opt.spec()
    assert msgpack.unpackb(msgpack.packb(spec)) == spec  # msgpack-able, no objects inside
    a, b = kvopt.Updater(opt), kvopt.create_updater(msgpack.unpackb(msgpack.packb(spec)))
    wa, wb = _w0(), _w0()
    for g in _grads(7, 8, seed=2):
        a("k", g, wa)
        b("k", g, wb)
    np.testing.assert_array_equal(wa, wb)


@pytest.mark.parametrize(("spec", "match"), [
    ({"type": "adabelief"}, "adabelief.*HORA_PS_OPTIMIZER_MODULES"),
    ({"type": "sgd", "momentun": 0.9}, "momentun"),
    ({"type": "adam", "momentum": 0.9}, "momentum"),
    ({"type": "sgd", "learning_rate": "0.1"}, "learning_rate"),
    ({"type": "sgd", "learning_rate": float("nan")}, "learning_rate"),
    ({"type": "adam", "beta1": 1.0}, "beta1"),
    ({"type": "sgd", "lr_scheduler": {"type": "cosine"}}, "max_update"),
    ({"type": "sgd", "lr_scheduler": {"type": "onecycle"}}, "onecycle"),
    ({"type": "sgd", "lr_scheduler": {"type": "factor", "step": 2, "gamma": 0.1}}, "gamma"),
    ({"type": "sgd", "lr_scheduler": {"type": "factor"}}, "step"),
    ({"type": "sgd", "lr_mult": [1, 2]}, "lr_mult"),
    ("sgd", "dict"),
    ({"learning_rate": 0.1}, "None"),
])
def test_create_updater_rejects_bad_specs(spec, match):
    with pytest.raises(ConfigError, match=match):
        kvopt.create_updater(spec)


def test_create_by_name():
    assert isinstance(kvopt.create("SGD", learning_rate=0.2), kvopt.SGD)
    assert isinstance(kvopt.create("adam"), kvopt.Adam)
    assert kvopt.Adam().lr == 0.001 and kvopt.SGD().lr == 0.01
    assert isinstance(kvopt.create("AdaGrad"), kvopt.AdaGrad)
    with pytest.raises(ConfigError, match="valid optimizers are: sgd, signum, .*test"):
        kvopt.create("adabelief")
    with pytest.raises(ConfigError, match="bogus"):
        kvopt.create("sgd", bogus=1)
    assert scheduler_from_spec(FactorScheduler(step=4).spec()).step == 4


def test_updater_rejects_integer_weights_and_shape_mismatch():
    upd = kvopt.Updater(kvopt.SGD())
    with pytest.raises(ConfigError, match="floating-point"):
        upd("k", np.ones(3, np.int32), np.ones(3, np.int32))
    with pytest.raises(ConfigError, match=r"\(4,\)"):
        upd("k", np.ones(4, f32), np.ones(3, f32))


# ------------------------------------------------------------------------------- states
@pytest.mark.parametrize("weights", ["numpy", "torch"])
def test_saved_states_resume_exactly(weights):
    grads = _grads(7, 6, seed=4)
    wrap = (lambda a: a) if weights == "numpy" else torch.from_numpy
    full = kvopt.Updater(kvopt.Adam(learning_rate=0.01))
    w_full = wrap(_w0())
    for g in grads:
        full("k", wrap(g.copy()), w_full)

    first = kvopt.Updater(kvopt.Adam(learning_rate=0.01))
    w = wrap(_w0())
    for g in grads[:3]:
        first("k", wrap(g.copy()), w)
    blob = first.get_states()
    assert msgpack.unpackb(blob)["format"] == "hora-kvstore-updater"  # msgpack, not a pickle
    resumed = kvopt.Updater(kvopt.Adam(learning_rate=0.01))
    resumed.set_states(blob)
    for g in grads[3:]:
        resumed("k", wrap(g.copy()), w)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w_full))


def test_dump_optimizer_replaces_the_optimizer_on_load():
    src = kvopt.Updater(kvopt.SGD(learning_rate=0.3, momentum=0.5))
    src("k", np.ones(2, f32), np.zeros(2, f32))
    dst = kvopt.Updater(kvopt.Adam())
    dst.set_states(src.get_states(dump_optimizer=True))
    assert isinstance(dst.optimizer, kvopt.SGD) and dst.optimizer.lr == 0.3
    assert dst.optimizer._index_update_count == {"k": 1}


def test_key_states_round_trip():
    a = kvopt.Updater(kvopt.SGD(learning_rate=0.1, momentum=0.9))
    w = _w0()
    for g in _grads(7, 2):
        a("k", g, w)
    b = kvopt.Updater(kvopt.SGD(learning_rate=0.1, momentum=0.9))
    b.set_key_states("k", a.key_states("k"))
    w2 = w.copy()
    g = _grads(7, 1, seed=8)[0]
    a("k", g, w)
    b("k", g, w2)
    np.testing.assert_array_equal(w, w2)
    assert int(b.key_states("k")["num_update"]) == 3


@pytest.mark.parametrize("blob", [b"", b"\x80\x04junk", msgpack.packb({"format": "other"}),
                                  msgpack.packb({"format": "hora-kvstore-updater", "version": 99})])
def test_bad_state_bytes_are_rejected(blob):
    with pytest.raises(ConfigError):
        kvopt.Updater(kvopt.SGD()).set_states(blob)


def test_truncated_and_forged_array_records_are_rejected():
    upd = kvopt.Updater(kvopt.SGD(momentum=0.9))
    upd("k", np.ones(4, f32), np.ones(4, f32))
    blob = upd.get_states()
    with pytest.raises(ConfigError):
        kvopt.Updater(kvopt.SGD()).set_states(blob[: len(blob) - 3])
    doc = msgpack.unpackb(blob)
    doc["states"]["k"]["mom"]["shape"] = [5]
    with pytest.raises(ConfigError, match="bytes"):
        kvopt.Updater(kvopt.SGD()).set_states(msgpack.packb(doc))
    doc["states"]["k"]["mom"]["dtype"] = "|O"
    with pytest.raises(ConfigError):
        kvopt.Updater(kvopt.SGD()).set_states(msgpack.packb(doc))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("make", [
    lambda: kvopt.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, clip_gradient=0.4),
    lambda: kvopt.Adam(learning_rate=0.01, wd=0.01),
], ids=["sgd", "adam"])
def test_cuda_tensors_follow_the_numpy_rule(make):
    grads = _grads(1000, 5, seed=11)
    up_np, up_cuda = kvopt.Updater(make()), kvopt.Updater(make())
    w_np = _w0(1000)
    w_cuda = torch.from_numpy(_w0(1000)).cuda()
    for g in grads:
        up_np("k", g, w_np)
        up_cuda("k", torch.from_numpy(g.copy()).cuda(), w_cuda)
    assert all(v.is_cuda for v in up_cuda.states["k"].values())
    torch.testing.assert_close(w_cuda.cpu(), torch.from_numpy(w_np), rtol=1e-6, atol=1e-7)


def test_a_users_optimizer_runs_only_once_its_module_is_named(monkeypatch):
    """A rule of one's own travels by name and is found through HORA_PS_OPTIMIZER_MODULES, never unpickled."""
    from hora.kvstore.optimizer import registry

    monkeypatch.setattr(registry, "OPTIMIZERS", dict(registry.OPTIMIZERS))
    monkeypatch.setattr(registry, "_loaded", set())
    monkeypatch.delitem(sys.modules, "tests.kvstore.custom_optimizer", raising=False)
    spec = {"type": "halfstep", "learning_rate": 0.5, "scale": 0.5}
    monkeypatch.delenv("HORA_PS_OPTIMIZER_MODULES", raising=False)
    with pytest.raises(ConfigError, match="HORA_PS_OPTIMIZER_MODULES"):
        kvopt.create_updater(spec)
    monkeypatch.setenv("HORA_PS_OPTIMIZER_MODULES", "tests.kvstore.no_such_module")
    with pytest.raises(ConfigError, match="no_such_module.*does not import"):
        kvopt.create_updater(spec)
    monkeypatch.setenv("HORA_PS_OPTIMIZER_MODULES", "tests.kvstore.custom_optimizer, ")
    upd = kvopt.create_updater(spec)
    w = np.ones(3, np.float32)
    upd("k", np.full(3, 2.0, np.float32), w)
    np.testing.assert_array_equal(w, np.full(3, 0.5, np.float32))
    monkeypatch.setenv("HORA_PS_OPTIMIZER_MODULES", "not a module")
    with pytest.raises(ConfigError, match="not a module name"):
        registry.load_modules()


def test_mxnets_names_cannot_be_taken_over():
    class Fake(kvopt.Optimizer):
        type_name = "adam"

    with pytest.raises(ConfigError, match="MXNet's Adam"):
        kvopt.register(Fake)


def test_shared_optimizer_state_travels_with_the_key_states():
    """Nadam's momentum schedule lives once per optimizer: the per-key states a server sends (and the dist
    state file joins and splits) carry it, so a restored server goes on exactly."""
    from hora.kvstore.ps import states
    from hora.kvstore.ps.placement import Shard

    rng = np.random.default_rng(5)
    grads = [{k: rng.standard_normal(6).astype(f32) for k in ("a", "b")} for _ in range(4)]
    a = kvopt.Updater(kvopt.Nadam(learning_rate=0.01))
    wa = {k: np.linspace(-1, 1, 6, dtype=f32) for k in ("a", "b")}
    for g in grads[:2]:
        for k in ("a", "b"):
            a(k, g[k], wa[k])
    b = kvopt.Updater(kvopt.Nadam(learning_rate=0.01))
    shards = [Shard(server=0, lo=0, hi=3), Shard(server=1, lo=3, hi=6)]
    for k in ("a", "b"):
        parts = states.split((6,), shards, a.key_states(k))
        assert parts[0]["shared.m_schedule"] == parts[1]["shared.m_schedule"]
        b.set_key_states(k, states.join((6,), shards, parts))
    assert b.optimizer.m_schedule == a.optimizer.m_schedule != 1.0
    wb = {k: v.copy() for k, v in wa.items()}
    for g in grads[2:]:
        for k in ("a", "b"):
            a(k, g[k], wa[k])
            b(k, g[k], wb[k])
    for k in ("a", "b"):
        np.testing.assert_array_equal(wa[k], wb[k])


@pytest.mark.parametrize("name", ["adagrad", "lamb", "nag"])
def test_numpy_rules_update_torch_tensors_in_place(name):
    """Rules written for NumPy update a torch tensor through a host view (CPU) and leave the same bits."""
    rng = np.random.default_rng(9)
    w0 = rng.standard_normal(10).astype(f32)
    grads = [rng.standard_normal(10).astype(f32) for _ in range(3)]
    u_np, u_t = kvopt.Updater(kvopt.create(name, wd=0.01)), kvopt.Updater(kvopt.create(name, wd=0.01))
    w, t = w0.copy(), torch.from_numpy(w0.copy())
    for g in grads:
        u_np("k", g, w)
        u_t("k", torch.from_numpy(g), t)
    np.testing.assert_array_equal(t.numpy(), w)


# ------------------------------------------------------------------------- ordered float32 sums
def _ordered_sum_inputs() -> list[tuple[str, np.ndarray]]:
    """Data that walks every path of ordered_add: binade changes, ties, zeros, NaN/inf, tiny and huge values."""
    rng = np.random.default_rng(7)
    out = []
    for n in (1, 9, 5000, 70000, 300001):
        x = rng.standard_normal(n).astype(f32)
        out.append((f"squares{n}", x * x))
        out.append((f"quarters{n}", np.full(n, 0.25, f32)))  # a tie at every step once the sum is large
        out.append((f"small-ints{n}", rng.integers(0, 5, n).astype(f32)))
        out.append((f"eighths{n}", (rng.integers(0, 8, n) / 8).astype(f32)))
        out.append((f"zeros{n}", np.zeros(n, f32)))
        with np.errstate(over="ignore"):
            wide = (rng.standard_normal(n) * 10.0 ** rng.uniform(-25, 25, n)).astype(f32)
            out.append((f"wide{n}", wide * wide))
        h = rng.standard_normal(n).astype(np.float16)
        out.append((f"half-squares{n}", (h * h).astype(f32)))
        y = rng.random(n).astype(f32)
        y[rng.integers(0, n)] = np.inf
        out.append((f"inf{n}", y))
        y = rng.random(n).astype(f32)
        y[rng.integers(0, n)] = np.nan
        out.append((f"nan{n}", y))
        out.append((f"subnormal{n}", (rng.random(n) * 1e-40).astype(f32)))
        y = rng.random(n).astype(f32)
        y[::97] = 3e38
        out.append((f"huge{n}", y))
        y = np.zeros(n, f32)
        y[n // 2:] = rng.random(n - n // 2)
        out.append((f"zero-head{n}", y))
        out.append((f"powers-of-two{n}", (2.0 ** rng.integers(-20, 20, n)).astype(f32)))
    return out


def test_ordered_sum_has_the_bits_of_the_sequential_loop():
    from hora.kvstore.optimizer.ordered_sum import ordered_add

    scratch, scratch2 = np.empty(4096, f32), np.empty(4096, f32)
    bad = []
    for name, y in _ordered_sum_inputs():
        for start in (0.0, 1.0, 3.0e7, 1e-30, 123.456):
            with np.errstate(over="ignore", invalid="ignore"):
                want = np.cumsum(np.concatenate([[f32(start)], y]).astype(f32))[-1]  # NumPy's in-order loop
            got = ordered_add(f32(start), y, scratch, scratch2)
            if got.tobytes() != want.tobytes():
                bad.append(f"{name} from {start}: {got!r} != {want!r}")
    assert not bad, bad


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_sum_sq_is_the_sequential_float32_sum_of_squares(dtype):
    from hora.kvstore.optimizer.base import sum_sq

    x = np.random.default_rng(3).standard_normal(200003).astype(dtype)
    squares = (x * x).astype(f32)  # a float16 square rounds to float16 first, as the kernel's
    assert sum_sq(x).tobytes() == np.cumsum(squares)[-1].tobytes()



# ------------------------------------------------------------------------------ fused C loops
def _fused_adam_or_skip():
    from hora.kvstore.optimizer import adaptive

    loop = adaptive._adam_loop()
    if loop is None:
        pytest.skip("no C compiler here: the NumPy rules run (the fused loops are optional)")
    return adaptive, loop


@pytest.mark.parametrize("name, kwargs", [
    ("adam", {}), ("adam", {"wd": 0.01, "rescale_grad": 0.5}), ("adam", {"clip_gradient": 0.3, "wd": 0.001}),
    ("lamb", {"wd": 0.01}), ("lamb", {"bias_correction": False, "clip_gradient": 0.5, "rescale_grad": 0.5}),
    ("adagrad", {"wd": 0.01, "rescale_grad": 0.5}), ("adagrad", {"clip_gradient": 0.5}),
], ids=["adam", "adam-wd-rescale", "adam-clip", "lamb", "lamb-noBC-clip", "adagrad", "adagrad-clip"])
@pytest.mark.parametrize("values", ["finite", "special"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN and overflow on purpose, on the math threads too
def test_fused_loops_give_the_numpy_rules_bits(name, kwargs, values, monkeypatch):
    """The compiled loops, on blocks split over threads, give the NumPy rule's bits (a NaN matching any NaN):
    weights and both moments over several steps, on gradients from 1e-8 to 100 ("finite", where LAMB's norms
    and ratio stay finite) or with NaN, infinities, signed zeros and subnormals in gradients and weights."""
    from hora.kvstore.optimizer import base, fused

    _fused_adam_or_skip()
    monkeypatch.setattr(base, "PARALLEL_BLOCKS", 1)
    monkeypatch.setattr(base, "_THREADS", 3)
    rng = np.random.default_rng(11)
    n = 3 * base.BLOCK + 17
    w0 = (rng.standard_normal(n) * 2).astype(f32)
    grads = [(rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 2, n)).astype(f32) for _ in range(3)]
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 3e38], f32)
    if values == "special":
        w0[:8], grads[1][-8:] = special, special

    def run(on: str):
        monkeypatch.setenv("HORA_PS_FUSED", on)
        upd = kvopt.Updater(kvopt.create(name, learning_rate=0.01, **kwargs))
        w = w0.copy()
        with np.errstate(all="ignore"):
            for g in grads:
                upd("k", g, w)
        states = upd.key_states("k")
        return w, *(states[k] for k in ("mean", "var", "history") if k in states)

    for with_loops, plain in zip(run("1"), run("0"), strict=True):
        assert fused.same_bits(with_loops, plain)
    if values == "finite":
        assert np.isfinite(run("1")[0]).all()


def test_same_bits_matches_nans_of_either_sign_and_nothing_else():
    from hora.kvstore.optimizer.fused import same_bits

    a = np.array([1.0, -0.0, np.nan], f32)
    assert same_bits(a, np.array([1.0, -0.0, -np.nan], f32))
    assert not same_bits(a, np.array([1.0, 0.0, np.nan], f32))
    assert not same_bits(a, np.array([np.nextafter(f32(1), f32(2)), -0.0, np.nan], f32))
    assert not same_bits(a, np.array([1.0, -0.0, 0.0], f32))


def test_fused_adam_is_what_a_float32_key_runs_and_hora_ps_fused_0_turns_it_off(monkeypatch):
    """A contiguous float32 key goes through the C loop; ``HORA_PS_FUSED=0``, float16 and a strided key
    through the NumPy rule."""
    adaptive, _ = _fused_adam_or_skip()
    calls = []
    real = adaptive._adam_fused
    monkeypatch.setattr(adaptive, "_adam_fused", lambda *a: (calls.append(a[1].dtype), real(*a)))
    upd = kvopt.Updater(kvopt.Adam())
    upd("k", np.ones(10, f32), np.ones(10, f32))
    assert calls == [np.float32]
    upd("h", np.ones(10, np.float16), np.ones(10, np.float16))
    strided = np.ones(20, f32)[::2]
    upd("s", np.ones(10, f32), strided)
    monkeypatch.setenv("HORA_PS_FUSED", "0")
    upd("k", np.ones(10, f32), np.ones(10, f32))
    assert calls == [np.float32]


def test_fused_lamb_runs_for_float32_keys_only(monkeypatch):
    """LAMB's C loops take a contiguous float32 key; a float16 key with a float32 master copy, and
    ``HORA_PS_FUSED=0``, go through the NumPy phases."""
    from hora.kvstore.optimizer import lamb

    _fused_adam_or_skip()
    calls = []
    real = lamb.LAMB._direction_fused
    monkeypatch.setattr(lamb.LAMB, "_direction_fused", staticmethod(lambda *a: (calls.append(a[1].dtype),
                                                                                real(*a))[1]))
    upd = kvopt.Updater(kvopt.LAMB(multi_precision=True))
    upd("k", np.ones(10, f32), np.ones(10, f32))
    upd("h", np.ones(10, np.float16), np.ones(10, np.float16))
    monkeypatch.setenv("HORA_PS_FUSED", "0")
    upd("k", np.ones(10, f32), np.ones(10, f32))
    assert calls == [np.float32]


def test_fused_adagrad_runs_without_clipping_only(monkeypatch):
    """AdaGrad's C loop takes a float32 key without clipping; with ``clip_gradient`` (MXNet's Python clip,
    negative bounds included) or ``HORA_PS_FUSED=0`` the NumPy rule runs."""
    adaptive, _ = _fused_adam_or_skip()
    calls = []
    real = adaptive._adagrad_fused
    monkeypatch.setattr(adaptive, "_adagrad_fused", lambda *a: (calls.append(a[1].size), real(*a)))
    kvopt.Updater(kvopt.AdaGrad())("k", np.ones(10, f32), np.ones(10, f32))
    kvopt.Updater(kvopt.AdaGrad(clip_gradient=-0.5))("k", np.ones(11, f32), np.ones(11, f32))
    monkeypatch.setenv("HORA_PS_FUSED", "0")
    kvopt.Updater(kvopt.AdaGrad())("k", np.ones(12, f32), np.ones(12, f32))
    assert calls == [10]


def test_fused_loops_fall_back_to_numpy_without_a_compiler(monkeypatch, tmp_path):
    """No compiler (or a failed build): no fused loop, no error; the NumPy rule updates the key."""
    from hora.kvstore.optimizer import adaptive, fused, lamb

    monkeypatch.setattr(fused, "_loaded", {})
    monkeypatch.setattr(fused, "_checked", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert fused.function("hora_adam_f32") is None
    assert adaptive._adam_loop() is None and lamb._lamb_loops() is None and adaptive._adagrad_loop() is None
    for opt in (kvopt.Adam(learning_rate=0.1), kvopt.LAMB(learning_rate=0.1), kvopt.AdaGrad(learning_rate=0.1)):
        w = np.ones(10, f32)
        kvopt.Updater(opt)("k", np.ones(10, f32), w)
        assert np.all(w < 1)


def test_fused_loop_that_breaks_the_bits_is_refused(monkeypatch):
    """A loop that does not give the NumPy rule's bits on the probe (a compiler that contracts to fused
    multiply-adds, say) is not used."""
    from hora.kvstore.optimizer import adaptive, fused

    _, loop = _fused_adam_or_skip()
    monkeypatch.setattr(fused, "_checked", {})

    def off_by_a_bit(w, *args):
        loop(w, *args)
        n = args[3]
        arr = np.ctypeslib.as_array((ctypes.c_float * n).from_address(w))
        arr[n // 2] = np.nextafter(arr[n // 2], np.inf)

    monkeypatch.setattr(fused, "function", lambda name: off_by_a_bit)
    assert adaptive._adam_loop() is None
