"""Accuracy under gradient compression: an MLP 64-1024-1024-10 on scikit-learn's digits, on 2 ranks.

Every case trains the same model from the same initial weights on the same
shards for the same number of steps; only ``compression=`` differs.  Run the
whole table (each case is a ``hora run -np 2`` job; MXNet's in its own venv)::

    python benchmarks/compression_accuracy.py --frameworks torch,keras,mxnet

or one case by hand::

    hora run -np 2 python benchmarks/compression_accuracy.py --worker torch --compression powersgd:2

A worker prints one JSON line (rank 0): framework, compression, steps, test accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/keras.py and benchmarks/mxnet.py would shadow the frameworks of the same names.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
MXNET_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"
if not MXNET_PYTHON.exists():
    MXNET_PYTHON = Path("/work/main/.venv-mxnet/bin/python")
HIDDEN = 1024


def digits(rank: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """This rank's training shard and the whole test set, as float32 features in [0, 1] and int labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=42, stratify=y)
    return xtr[rank::size], ytr[rank::size].astype(np.int64), xte, yte.astype(np.int64)


def batches(n: int, batch: int, epochs: int, seed: int):
    """Index batches of a shard of ``n`` rows, reshuffled every epoch, the same on every rank."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(n)
        for i in range(0, n - batch + 1, batch):
            yield order[i : i + batch]


def initial_weights() -> list[np.ndarray]:
    """The same starting point for every framework: (in x out) kernels and biases, He-uniform."""
    rng = np.random.default_rng(0)
    out = []
    for fan_in, fan_out in ((64, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 10)):
        bound = np.sqrt(6.0 / fan_in)
        out += [rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32), np.zeros(fan_out, np.float32)]
    return out


def run_torch(args, spec: str) -> float:
    import torch

    import hora.torch as hvd
    from hora.core.compression import parse_spec

    hvd.init()
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = digits(hvd.rank(), hvd.size())
    model = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10))
    with torch.no_grad():
        for p, w in zip(model.parameters(), initial_weights(), strict=True):
            p.copy_(torch.from_numpy(w.T.copy() if w.ndim == 2 else w))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=parse_spec(spec))
    xt, yt = torch.from_numpy(xtr), torch.from_numpy(ytr)
    for idx in batches(len(xtr), args.batch, args.epochs, args.seed):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
        opt.step()
    with torch.no_grad():
        acc = float((model(torch.from_numpy(xte)).argmax(1).numpy() == yte).mean())
    hvd.shutdown()
    return acc


def run_keras(args, spec: str) -> float:
    import keras

    import hora.keras as hvd
    from hora.core.compression import parse_spec

    hvd.init()
    xtr, ytr, xte, yte = digits(hvd.rank(), hvd.size())
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(HIDDEN, activation="relu"),
                              keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(10)])
    model.set_weights(initial_weights())
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9), compression=parse_spec(spec))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for idx in batches(len(xtr), args.batch, args.epochs, args.seed):
        model.train_on_batch(xtr[idx], ytr[idx])
    acc = float((np.argmax(model.predict(xte, verbose=0), 1) == yte).mean())
    hvd.shutdown()
    return acc


def run_mxnet(args, spec: str) -> float:
    import mxnet as mx
    from mxnet import autograd, gluon

    import hora.mxnet as hvd
    from hora.core.compression import parse_spec

    hvd.init()
    xtr, ytr, xte, yte = digits(hvd.rank(), hvd.size())
    net = gluon.nn.Sequential(prefix="mlp_")
    with net.name_scope():
        net.add(gluon.nn.Dense(HIDDEN, activation="relu", in_units=64, prefix="a_"),
                gluon.nn.Dense(HIDDEN, activation="relu", in_units=HIDDEN, prefix="b_"),
                gluon.nn.Dense(10, in_units=HIDDEN, prefix="c_"))
    net.initialize()
    for p, w in zip(net.collect_params().values(), initial_weights(), strict=True):
        p.set_data(mx.nd.array(w.T if w.ndim == 2 else w))  # gluon's Dense kernels are (out, in)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": args.lr, "momentum": 0.9},
                                     compression=parse_spec(spec))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    xt, yt = mx.nd.array(xtr), mx.nd.array(ytr)
    for idx in batches(len(xtr), args.batch, args.epochs, args.seed):
        i = mx.nd.array(idx, dtype="int64")
        with autograd.record():
            loss = loss_fn(net(xt.take(i)), yt.take(i))
        loss.backward()
        trainer.step(len(idx))
    acc = float((net(mx.nd.array(xte)).asnumpy().argmax(1) == yte).mean())
    hvd.shutdown()
    return acc


def worker(args) -> None:
    acc = {"torch": run_torch, "keras": run_keras, "mxnet": run_mxnet}[args.worker](args, args.compression)
    rank = int(os.environ.get("HORA_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if rank == 0:
        steps = sum(1 for _ in batches(len(digits(0, 2)[0]), args.batch, args.epochs, args.seed))
        print(json.dumps({"framework": args.worker, "compression": args.compression, "steps": steps,
                          "accuracy": acc}), flush=True)


def driver(args) -> None:
    rows = []
    for fw in args.frameworks.split(","):
        python = str(MXNET_PYTHON) if fw == "mxnet" else sys.executable
        for spec in args.cases.split(","):
            cmd = [python, "-m", "hora.runner.cli", "run", "-np", "2", "--mpi", python, __file__, "--worker", fw,
                   "--compression", spec, "--epochs", str(args.epochs), "--batch", str(args.batch), "--lr",
                   str(args.lr)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
            lines = [ln.split(":", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("[0]<stdout>:{")]
            if proc.returncode or not lines:
                raise SystemExit(f"{fw} {spec} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            rows.append(json.loads(lines[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| framework | compression | steps | test accuracy |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['framework']} | {r['compression']} | {r['steps']} | {100 * r['accuracy']:.2f}% |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--worker", choices=["torch", "keras", "mxnet"], help="run one case (inside hora run)")
    p.add_argument("--compression", default="none")
    p.add_argument("--frameworks", default="torch,keras,mxnet")
    p.add_argument("--cases", default="none,powersgd:2")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
