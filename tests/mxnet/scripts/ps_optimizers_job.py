"""MXNet optimizers set with kv.set_optimizer, run on hora's parameter servers, against MXNet's own updater.

Run as ``hora run -np 2 -s 2 python ps_optimizers_job.py --kv-store hora_dist_sync`` (or
``hora_dist_async``).  For each optimizer the workers push known gradients to
fresh keys (one split across both servers); the pulled weights must equal, to
the bit, MXNet's own updater applied here to what the servers saw:

* ``hora_dist_sync``: the sum of both workers' pushes, once per step;
* ``hora_dist_async``: every push on arrival; worker 0 pushes, then worker 1
  (a barrier between), so the order is known.

A scheduler and per-key lr/wd multipliers ride along.  LAMB and LARS take
norms per array, and a key split across servers is one array per server (as on
MXNet's servers); Nadam's momentum schedule is kept once per optimizer, that
is once per server; so those three only get the small key, which one server
holds whole.  Each worker prints
``ps optimizers ok``.
"""

from __future__ import annotations

import argparse
import logging
import warnings

import mxnet as mx
import numpy as np

import hora.mxnet  # noqa: F401  (registers hora's stores with MXNet)

STEPS = 3
SMALL, BIG = (5, 7), (1100, 1000)  # BIG is over the 1e6-element bound: split across the servers


def factor() -> mx.lr_scheduler.FactorScheduler:
    return mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.05)


OPTIMIZERS = [
    ("adam", {"learning_rate": 0.01, "wd": 0.01}, True),
    ("adagrad", {"learning_rate": 0.1, "clip_gradient": 0.5}, True),
    ("lamb", {"learning_rate": 0.01, "wd": 0.01}, False),
    ("nadam", {"learning_rate": 0.01}, False),  # its momentum schedule is per server: one key, one server
    ("rmsprop", {"learning_rate": 0.01, "centered": True}, True),
    ("ftrl", {"learning_rate": 0.1}, True),
    ("signum", {"learning_rate": 0.01, "wd_lh": 0.001}, True),
    ("lars", {"learning_rate": 0.1, "momentum": 0.9, "eta": 0.01}, False),
    ("nag", {"momentum": 0.9, "wd": 0.001, "lr_scheduler": "factor"}, True),
    ("test", {"rescale_grad": 0.5}, True),
]


def grad(rank: int, step: int, shape: tuple[int, ...], salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * salt + 10 * step + rank)
    return rng.standard_normal(shape).astype(np.float32)


def make(name: str, kwargs: dict) -> mx.optimizer.Optimizer:
    kwargs = dict(kwargs)
    if kwargs.get("lr_scheduler") == "factor":
        kwargs["lr_scheduler"] = factor()
    opt = mx.optimizer.create(name, **kwargs)
    opt.set_lr_mult({f"{name}_small": 0.5})
    opt.set_wd_mult({f"{name}_big": 2.0})
    return opt


def check(kv, name: str, kwargs: dict, big: bool, salt: int, sync: bool) -> None:
    keys = [f"{name}_small"] + ([f"{name}_big"] if big else [])
    shapes = [SMALL] + ([BIG] if big else [])
    init = [np.random.default_rng(salt + i).standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)]
    kv.init(keys, [mx.nd.array(a) for a in init])
    kv.set_optimizer(make(name, kwargs))
    ref = mx.optimizer.get_updater(make(name, kwargs))
    ref_w = [mx.nd.array(a) for a in init]
    bufs = [mx.nd.zeros(s) for s in shapes]
    workers = kv.num_workers
    for step in range(STEPS):
        pushes = [[grad(r, step, s, salt + i) for i, s in enumerate(shapes)] for r in range(workers)]
        if sync:
            kv.push(keys, [mx.nd.array(g) for g in pushes[kv.rank]])
            merged = [pushes[0][i] + pushes[1][i] for i in range(len(keys))]  # a + b == b + a: any arrival order
            for k, b, g, w in zip(keys, bufs, merged, ref_w, strict=True):
                b[:] = mx.nd.array(g)
                ref(k, b, w)
        else:
            for r in range(workers):
                if r == kv.rank:
                    kv.push(keys, [mx.nd.array(g) for g in pushes[r]])
                kv.barrier()  # the servers have applied worker r's push before the next one leaves
                for k, b, g, w in zip(keys, bufs, pushes[r], ref_w, strict=True):
                    b[:] = mx.nd.array(g)
                    ref(k, b, w)
    outs = [mx.nd.zeros(s) for s in shapes]
    kv.pull(keys, out=outs)
    for k, got, want in zip(keys, outs, ref_w, strict=True):
        g, w = got.asnumpy(), want.asnumpy()
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (
            f"{name} key {k}: {int((g != w).sum())} of {g.size} weights differ from MXNet's updater, "
            f"max {np.abs(g - w).max()}")
    kv.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-store", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    kv = mx.kv.create(args.kv_store)
    assert kv.num_workers == 2, "run with hora run -np 2 -s 2"
    sync = args.kv_store == "hora_dist_sync"
    for salt, (name, kwargs, big) in enumerate(OPTIMIZERS):
        check(kv, name, kwargs, big, salt, sync)
    kv.barrier()
    print(f"ps optimizers ok ({args.kv_store})")


if __name__ == "__main__":
    main()
