"""Gluon MLP training throughput: hora.mxnet against MXNet 1.9.1's own dist_sync KVStore, in one run.

The model is the issue's: an MLP 784-1024-1024-10 (ReLU), SGD with momentum,
batch 128 per worker on synthetic data, 1 thread per process.  The cases, all
measured in the same run, in a balanced cyclic order repeated ``--rounds``
times (every case runs once after each of the others per round), each a fresh
job whose workers time ``--steps`` steps after ``--warmup``:

* ``1 process``: a plain ``gluon.Trainer``, no KVStore.
* ``mxnet dist_sync``: MXNet's own parameter server, its roles started the
  way ``tools/launch.py --launcher local`` does (scheduler, 1 server, 2
  workers, ``DMLC_*`` variables); ``gluon.Trainer(kvstore='dist_sync')`` runs
  the optimizer on the server.
* ``hora DistributedTrainer``: ``hora run -np 2`` (MPI), ``hvd.DistributedTrainer``.
* ``hora kvstore='hora'``: ``hora run -np 2``, ``gluon.Trainer(kvstore=mx.kv.create('hora'))``.
* ``hora_dist_sync (1 server)``: ``hora run -np 2 -s 1``, ``gluon.Trainer(kvstore='hora_dist_sync')``:
  hora's parameter server with the roles MXNet's case has.

A job's rate is all workers' samples over the slowest worker's time; the
table gives each case's median over the rounds, its ratio to MXNet dist_sync,
and its scaling efficiency (rate / (workers x the 1-process rate)).  Runs in
the MXNet venv::

    .venv-mxnet/bin/python benchmarks/mxnet.py --rounds 3 --json mxnet.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
# This file is called mxnet.py: its folder, which Python puts first on sys.path, would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE.parent]


def _load_common():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hora_bench_common", HERE.parent / "common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_common = _load_common()
balanced_order, clean_child_env, markdown_table, median = (_common.balanced_order, _common.clean_child_env,
                                                           _common.markdown_table, _common.median)

CASES = {
    "single": "1 process",
    "mxnet_dist_sync": "mxnet dist_sync (1 server)",
    "hora_trainer": "hora DistributedTrainer",
    "hora_kvstore": "hora kvstore='hora'",
    "hora_dist_sync": "hora_dist_sync (1 server)",
}
WORKERS = 2
#: one thread everywhere: OpenMP, MKL/OpenBLAS, and MXNet's own CPU engine workers
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MXNET_CPU_WORKER_NTHREADS")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before them")
    p.add_argument("--batch-size", type=int, default=128, help="batch per worker")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the balanced order of the cases")
    p.add_argument("--once", action="store_true", help="each case once per round, in the listed order (quick)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a job may take")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)  # a worker of one job
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- workers


def worker(args: argparse.Namespace) -> None:
    """One worker of one case: build the MLP, train ``warmup + steps`` steps, write its time."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    kv, rank, workers = None, 0, 1
    trainer_cls = gluon.Trainer
    if args.case.startswith("hora"):
        import hora.mxnet as hvd

        if args.case in ("hora_trainer", "hora_kvstore"):
            hvd.init()
            rank, workers = hvd.rank(), hvd.size()
        if args.case == "hora_trainer":
            trainer_cls = hvd.DistributedTrainer
    if args.case == "hora_kvstore":
        kv = mx.kv.create("hora")
    elif args.case in ("mxnet_dist_sync", "hora_dist_sync"):
        kv = mx.kv.create("dist_sync" if args.case == "mxnet_dist_sync" else "hora_dist_sync")
        rank, workers = kv.rank, kv.num_workers

    mx.random.seed(1)  # the same start on every worker
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(1024, activation="relu", in_units=784), gluon.nn.Dense(1024, activation="relu",
                                                                                  in_units=1024),
            gluon.nn.Dense(10, in_units=1024))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    opt = {"learning_rate": 0.01, "momentum": 0.9}
    if trainer_cls is gluon.Trainer:
        trainer = gluon.Trainer(net.collect_params(), "sgd", opt, kvstore=kv)
    else:
        trainer = trainer_cls(net.collect_params(), "sgd", opt)
    rng = np.random.RandomState(rank)
    data = [mx.nd.array(rng.rand(args.batch_size, 784).astype(np.float32)) for _ in range(4)]
    label = [mx.nd.array(rng.randint(0, 10, args.batch_size).astype(np.float32)) for _ in range(4)]
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    global_batch = args.batch_size * workers if args.case == "hora_kvstore" else args.batch_size

    def step(i: int) -> None:
        with autograd.record():
            loss = loss_fn(net(data[i % 4]), label[i % 4])
        loss.backward()
        trainer.step(global_batch)

    for i in range(args.warmup):
        step(i)
    mx.nd.waitall()
    if kv is not None and hasattr(kv, "barrier"):
        kv.barrier()
    elif kv is not None and hasattr(kv, "_barrier"):
        kv._barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        step(i)
    mx.nd.waitall()
    seconds = time.perf_counter() - start
    (args.out / f"{args.case}-{rank}.json").write_text(json.dumps({"rank": rank, "workers": workers,
                                                                   "seconds": seconds}))


# --------------------------------------------------------------------------- jobs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = clean_child_env(1)
    env = {k: v for k, v in env.items() if not k.startswith(("DMLC_", "PS_"))}
    env.update({v: "1" for v in THREAD_VARS})
    env["PYTHONPATH"] = f"{HERE.parent.parent}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def run_job(case: str, args: argparse.Namespace, out: Path) -> float:
    """Run one job of ``case``; returns its rate in samples/s (all workers over the slowest one)."""
    me = [sys.executable, str(HERE), "--case", case, "--out", str(out), "--steps", str(args.steps),
          "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    hora = [str(Path(sys.executable).parent / "hora"), "run"]
    env = child_env()
    procs: list[subprocess.Popen] = []
    try:
        if case == "single":
            procs.append(subprocess.Popen(me, env=env, start_new_session=True))
            waits, workers = procs, 1
        elif case == "mxnet_dist_sync":
            env.update({"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
                        "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": str(WORKERS), "DMLC_NODE_HOST": "127.0.0.1"})
            role = [sys.executable, "-c", "import mxnet"]  # importing mxnet runs a scheduler's/server's loop
            for r in ("scheduler", "server"):
                procs.append(subprocess.Popen(role, env={**env, "DMLC_ROLE": r}, start_new_session=True,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            waits = [subprocess.Popen(me, env={**env, "DMLC_ROLE": "worker"}, start_new_session=True)
                     for _ in range(WORKERS)]
            procs += waits
            workers = WORKERS
        else:
            servers = ["-s", "1"] if case == "hora_dist_sync" else []
            procs.append(subprocess.Popen([*hora, "-np", str(WORKERS), *servers, *me], env=env,
                                          start_new_session=True, stdout=subprocess.DEVNULL))
            waits, workers = procs, WORKERS
        deadline = time.monotonic() + args.timeout
        for p in waits:
            if p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                raise SystemExit(f"{case}: a process exited with status {p.returncode}")
        for p in procs:  # MXNet's scheduler and server leave once the workers have finalised
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    results = [json.loads(f.read_text()) for f in sorted(out.glob(f"{case}-*.json"))]
    for f in out.glob(f"{case}-*.json"):
        f.unlink()
    if len(results) != workers:
        raise SystemExit(f"{case}: {len(results)} of {workers} workers wrote a result")
    return workers * args.batch_size * args.steps / max(r["seconds"] for r in results)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        worker(args)
        return 0
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; valid: {', '.join(CASES)}")
    load = os.getloadavg()
    rates: dict[str, list[float]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory(prefix="hora-mxbench-") as tmp:
        for _ in range(args.rounds):
            for case in (cases if args.once else balanced_order(cases)):
                rates[case].append(run_job(case, args, Path(tmp)))
                print(f"{CASES[case]}: {rates[case][-1]:,.0f} samples/s", file=sys.stderr, flush=True)
    med = {c: median(v) for c, v in rates.items()}
    single, peer = med.get("single"), med.get("mxnet_dist_sync")
    rows = []
    for c in cases:
        workers = 1 if c == "single" else WORKERS
        rows.append([CASES[c], str(workers), f"{med[c]:,.0f}",
                     f"{med[c] / peer:.2f}" if peer else "—",
                     f"{med[c] / (workers * single):.2f}" if single else "—",
                     " ".join(f"{r:,.0f}" for r in rates[c])])
    print(f"MLP 784-1024-1024-10, batch {args.batch_size}/worker, 1 thread/process, {args.steps} steps after "
          f"{args.warmup}; median of {args.rounds} rounds; 1-min load before: {load[0]:.2f}, after: "
          f"{os.getloadavg()[0]:.2f}")
    print(markdown_table(["case", "workers", "samples/s", "x mxnet dist_sync", "efficiency", "per round"], rows))
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "mxnet-gluon-mlp", "rates": rates, "median": med,
                                         "load_before": load, "load_after": os.getloadavg(),
                                         "steps": args.steps, "batch": args.batch_size}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
