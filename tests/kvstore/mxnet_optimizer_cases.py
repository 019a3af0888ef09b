"""Cases that compare hora's server optimizers with MXNet 1.9.1's, bit for bit, and the code that runs both sides.

Each case names an MXNet optimizer with its arguments (a scheduler, lr/wd
multipliers, clipping), a dtype and a number of steps.  Both sides see the
same random weights and gradients, for three keys updated in turn each step
(as a server updates its keys), through an updater the way MXNet's server
calls it: one key at a time, the gradient in a buffer that the next step of
that key overwrites.

``run_mxnet`` needs MXNet (``.venv-mxnet``); ``run_hora`` needs only hora.
``tests/kvstore/record_mxnet_optimizers.py`` stores MXNet's results in
``tests/kvstore/data/mxnet_optimizers.npz`` so the main venv checks against them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

KEYS = (3, 5, "fc_bias")  # ints as gluon's Trainer uses; a name LARS leaves alone
SHAPES = {3: (4, 5), 5: (24,), "fc_bias": (7,)}
STEPS = 6

# schedulers as (mx.lr_scheduler class name, kwargs)
_FACTOR = ("FactorScheduler", {"step": 4, "factor": 0.5, "base_lr": 0.2, "warmup_steps": 2, "warmup_begin_lr": 0.01})
_MULTI = ("MultiFactorScheduler", {"step": [3, 7], "factor": 0.3, "base_lr": 0.1})
_POLY = ("PolyScheduler", {"max_update": 12, "base_lr": 0.05, "pwr": 2, "final_lr": 0.001})
_COSINE = ("CosineScheduler", {"max_update": 14, "base_lr": 0.08, "final_lr": 0.0, "warmup_steps": 3})

_MULTS = {"lr_mult": {5: 0.5}, "wd_mult": {3: 2.0, "fc_bias": 0.0}}


def _case(name: str, opt: str, kwargs: dict[str, Any], sched: tuple | None = None, dtype: str = "float32",
          mults: bool = True, steps: int = STEPS) -> dict[str, Any]:
    return {"name": name, "opt": opt, "kwargs": kwargs, "sched": sched, "dtype": dtype, "mults": mults,
            "steps": steps}


CASES: list[dict[str, Any]] = [
    _case("sgd", "sgd", {"learning_rate": 0.1, "wd": 0.01, "rescale_grad": 0.5}),
    _case("sgd_mom_clip_factor", "sgd", {"momentum": 0.9, "wd": 0.001, "clip_gradient": 0.3}, _FACTOR),
    _case("ccsgd", "ccsgd", {"learning_rate": 0.05, "momentum": 0.5}),
    _case("signum", "signum", {"learning_rate": 0.01, "momentum": 0.9, "wd": 0.01, "wd_lh": 0.001,
                               "clip_gradient": 0.5}),
    _case("signsgd", "signum", {"learning_rate": 0.02, "momentum": 0.0, "wd": 0.01}, _MULTI),
    _case("ftml", "ftml", {"learning_rate": 0.01, "wd": 0.01, "rescale_grad": 0.8, "clip_gradient": 1.0}),
    _case("lars_mom", "lars", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.001, "eta": 0.01}, _FACTOR),
    _case("lars_plain", "lars", {"learning_rate": 0.1, "eta": 0.02, "eps": 1e-6, "rescale_grad": 0.5}),
    _case("lbsgd", "lbsgd", {"learning_rate": 0.1, "momentum": 0.9, "batch_scale": 1, "wd": 0.001}),
    _case("lbsgd_scale3", "lbsgd", {"learning_rate": 0.1, "momentum": 0.9, "batch_scale": 3, "warmup_epochs": 1,
                                    "updates_per_epoch": 4, "wd": 0.001}, steps=8),
    _case("lbsgd_lars", "lbsgd", {"learning_rate": 0.1, "warmup_strategy": "lars", "batch_scale": 2}),
    _case("lamb", "lamb", {"learning_rate": 0.01, "wd": 0.01}, _POLY),
    _case("lamb_bounds_noBC", "lamb", {"learning_rate": 0.02, "wd": 0.01, "lower_bound": 0.5, "upper_bound": 3.0,
                                       "bias_correction": False, "clip_gradient": 0.8}),
    _case("dcasgd", "dcasgd", {"learning_rate": 0.1, "wd": 0.01, "lamda": 0.1, "clip_gradient": 1.0}),
    _case("nag", "nag", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01, "clip_gradient": 0.7}, _COSINE),
    _case("nag_plain", "nag", {"learning_rate": 0.1, "wd": 0.01}),
    _case("adam", "adam", {"learning_rate": 0.01, "wd": 0.01, "rescale_grad": 0.5}, _FACTOR),
    _case("adam_clip", "adam", {"learning_rate": 0.01, "clip_gradient": 0.2, "beta1": 0.8}),
    _case("adagrad", "adagrad", {"learning_rate": 0.1, "wd": 0.01, "clip_gradient": 0.9}, _MULTI),
    _case("rmsprop", "rmsprop", {"learning_rate": 0.01, "wd": 0.01, "clip_weights": 1.5}),
    _case("rmsprop_centered", "rmsprop", {"learning_rate": 0.01, "centered": True, "clip_gradient": 0.5}, _POLY),
    _case("adadelta", "adadelta", {"rho": 0.8, "wd": 0.01, "clip_gradient": 0.6}),
    _case("ftrl", "ftrl", {"learning_rate": 0.1, "lamda1": 0.02, "wd": 0.01, "clip_gradient": 1.0}),
    _case("ftrl_sched", "ftrl", {"lamda1": 0.001}, _COSINE),
    _case("adamax", "adamax", {"learning_rate": 0.01, "wd": 0.01, "clip_gradient": 0.9}, _FACTOR),
    _case("nadam", "nadam", {"learning_rate": 0.01, "wd": 0.01, "clip_gradient": 0.9}),
    _case("test", "test", {"rescale_grad": 0.25}),
    _case("sgld_deterministic", "sgld", {"learning_rate": 0.01, "wd": 0.01, "clip_gradient": 0.5}),
    # MXNet's Python-level rules clip whenever clip_gradient is not None: 0 and negative values too
    _case("adagrad_negative_clip", "adagrad", {"learning_rate": 0.1, "clip_gradient": -0.5}),
    _case("nadam_zero_clip", "nadam", {"learning_rate": 0.01, "clip_gradient": 0.0}),
    # float16 weights with a float32 master copy
    _case("sgd_fp16_mp", "sgd", {"learning_rate": 0.1, "momentum": 0.9, "multi_precision": True}, dtype="float16"),
    _case("nag_fp16_mp", "nag", {"learning_rate": 0.1, "momentum": 0.9, "multi_precision": True}, dtype="float16"),
    _case("adam_fp16_mp", "adam", {"learning_rate": 0.01, "multi_precision": True}, _FACTOR, dtype="float16"),
    _case("lamb_fp16_mp", "lamb", {"learning_rate": 0.01, "wd": 0.01, "multi_precision": True}, dtype="float16"),
    _case("lars_fp16_mp", "lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.01, "multi_precision": True},
          dtype="float16"),
    _case("rmsprop_fp16_mp", "rmsprop", {"learning_rate": 0.01, "multi_precision": True}, dtype="float16"),
    _case("adagrad_fp16_mp", "adagrad", {"learning_rate": 0.1, "multi_precision": True}, dtype="float16"),
    _case("nadam_fp16_mp", "nadam", {"learning_rate": 0.01, "multi_precision": True}, dtype="float16"),
    _case("lbsgd_fp16_mp", "lbsgd", {"learning_rate": 0.1, "momentum": 0.9, "batch_scale": 2,
                                     "multi_precision": True}, dtype="float16"),
]
# Every one of MXNet's eighteen at least once.
assert {c["opt"] for c in CASES} == {
    "sgd", "signum", "ftml", "lars", "lbsgd", "lamb", "dcasgd", "nag", "sgld", "ccsgd", "adam", "adagrad", "rmsprop",
    "adadelta", "ftrl", "adamax", "nadam", "test"}


def inputs(case: dict[str, Any], seed: int = 0) -> tuple[dict[Any, np.ndarray], list[dict[Any, np.ndarray]]]:
    """The initial weights and each step's gradients of ``case`` (float32 draws cast to the case's dtype)."""
    rng = np.random.default_rng(seed + sum(map(ord, case["name"])))
    dtype = np.dtype(case["dtype"])
    weights = {k: rng.standard_normal(SHAPES[k]).astype(np.float32).astype(dtype) for k in KEYS}
    grads = [{k: (rng.standard_normal(SHAPES[k]) * 0.7).astype(np.float32).astype(dtype) for k in KEYS}
             for _ in range(case["steps"])]
    return weights, grads


def _mx_kwargs(case: dict[str, Any]) -> dict[str, Any]:
    import mxnet as mx

    kwargs = dict(case["kwargs"])
    if case["sched"] is not None:
        cls, args = case["sched"]
        kwargs["lr_scheduler"] = getattr(mx.lr_scheduler, cls)(**args)
    return kwargs


def mx_optimizer(case: dict[str, Any]) -> Any:
    """The case's MXNet optimizer, with its multipliers set."""
    import mxnet as mx

    opt = mx.optimizer.create(case["opt"], **_mx_kwargs(case))
    if case["mults"]:
        opt.set_lr_mult(dict(_MULTS["lr_mult"]))
        opt.set_wd_mult(dict(_MULTS["wd_mult"]))
    return opt


def run_mxnet(case: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """MXNet's weights after each step: ``{"<key>/<step>": array}``."""
    import mxnet as mx

    weights, grads = inputs(case, seed)
    opt = mx_optimizer(case)
    if case["opt"] == "sgld":
        _silence_sgld_noise(mx)
    updater = mx.optimizer.get_updater(opt)
    w = {k: mx.nd.array(v, dtype=v.dtype) for k, v in weights.items()}
    buf = {k: mx.nd.zeros(SHAPES[k], dtype=case["dtype"]) for k in KEYS}  # the server's merge buffer per key
    out = {}
    for step, g in enumerate(grads):
        for k in KEYS:
            buf[k][:] = mx.nd.array(g[k], dtype=g[k].dtype)
            updater(k, buf[k], w[k])
            out[f"{k}/{step}"] = w[k].asnumpy()
    return out


def _silence_sgld_noise(mx: Any) -> None:
    """Make MXNet's SGLD noise zero, so its deterministic part can be compared to the bit."""
    import mxnet.optimizer.optimizer as mxopt

    mxopt.normal = lambda loc, scale, shape, dtype, ctx: mx.nd.zeros(shape, ctx=ctx, dtype=dtype)


def hora_spec(case: dict[str, Any]) -> dict[str, Any]:
    """The spec hora's converter makes of the case's MXNet optimizer (needs MXNet)."""
    from hora.mxnet.server_optimizer import hora_optimizer_of

    return hora_optimizer_of(mx_optimizer(case)).spec()


def run_hora(case: dict[str, Any], spec: dict[str, Any], seed: int = 0, restore_after: int | None = None
             ) -> dict[str, np.ndarray]:
    """hora's weights after each step, from ``spec``, on the same inputs as :func:`run_mxnet`.

    With ``restore_after=n`` the updater's state is saved after step ``n``
    (with the optimizer), and a fresh updater loaded from those bytes goes on.
    """
    from hora.kvstore import optimizer as hopt

    weights, grads = inputs(case, seed)

    def fresh() -> hopt.Updater:
        updater = hopt.create_updater(json.loads(json.dumps(spec)))  # as it travels: plain data only
        if spec["type"] == "sgld":
            updater.optimizer.noise = lambda shape, dtype, std: np.zeros(shape, dtype)
        return updater

    updater = fresh()
    w = {k: np.array(v, copy=True) for k, v in weights.items()}
    out = {}
    for step, g in enumerate(grads):
        for k in KEYS:
            updater(str(k), np.array(g[k], copy=True), w[k])
            out[f"{k}/{step}"] = w[k].copy()
        if step == restore_after:
            saved = updater.get_states(dump_optimizer=True)
            updater = hopt.Updater(hopt.SGD())
            updater.set_states(saved)
            if spec["type"] == "sgld":
                updater.optimizer.noise = lambda shape, dtype, std: np.zeros(shape, dtype)
    return out


def mismatches(expected: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> list[str]:
    """The entries whose bits differ (NaNs compare equal), with the largest difference, for a message."""
    bad = []
    for name, want in expected.items():
        have = got[name]
        if want.dtype != have.dtype or want.shape != have.shape:
            bad.append(f"{name}: {have.dtype}{have.shape} != {want.dtype}{want.shape}")
        elif not np.array_equal(want.view(np.uint8), have.view(np.uint8)):
            diff = np.abs(want.astype(np.float64) - have.astype(np.float64))
            bad.append(f"{name}: {int((want != have).sum())} elements differ, max {diff.max():.3g}")
    return bad


def input_digest(case: dict[str, Any], seed: int = 0) -> str:
    """A digest of the case's inputs, recorded beside MXNet's results."""
    import hashlib

    weights, grads = inputs(case, seed)
    h = hashlib.sha256()
    for k in KEYS:
        h.update(weights[k].tobytes())
        for g in grads:
            h.update(g[k].tobytes())
    return h.hexdigest()


def flatten(results: dict[str, np.ndarray]) -> np.ndarray:
    """Every step's weights of every key, end to end (the recorded file keeps one array per case)."""
    return np.concatenate([v.reshape(-1) for v in results.values()])
