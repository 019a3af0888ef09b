"""Keras 3 data-parallel training on 2 ranks: hora.keras against TensorFlow's own strategy and a hand-written loop.

The model is the MLP 784-1024-1024-10 (softmax cross-entropy, SGD), batch 128
per rank, one thread per rank (intra-op, inter-op and OpenMP), synthetic data.
The cases, each a job of its own, all in one run:

* ``single``: one process alone, Keras 3 ``model.fit`` on TensorFlow;
* ``mwms``: tf_keras (``TF_USE_LEGACY_KERAS=1``) with ``MultiWorkerMirroredStrategy``,
  2 workers started here with ``TF_CONFIG`` on localhost (Keras 3 does not run
  under that strategy: keras-team/keras#20585);
* ``mpi4py``: a hand-written loop under ``mpirun``: a ``tf.function`` computes
  the gradients, they go to NumPy, one ``MPI.Allreduce`` per step on a flat
  buffer, back, and a second ``tf.function`` applies them;
* ``hora-tf``: ``hora.keras`` ``model.fit`` on TensorFlow under ``hora run -np 2``;
* ``hora-torch``: the same on Keras's torch backend.

Each job takes a TensorFlow start-up (seconds), so the cases run once per
round, in an order rotated by one every round so that load drift on a shared
host hits every case alike; each figure is the median over rounds.  Also measured: the cost of hora's grouped
allreduce inside a ``tf.function`` step on one rank (interleaved blocks of
steps with and without it), and each rank's peak RSS against the single
process's.

Run::

    python benchmarks/keras.py --rounds 2 --steps 60
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import clean_child_env, markdown_table, median  # noqa: E402

# This file is named keras.py: with its folder first on sys.path, `import keras` would import it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "benchmarks"]

BATCH = 128
LAYERS = (784, 1024, 1024, 10)
CASES = ("single", "mwms", "mpi4py", "hora-tf", "hora-torch")
RESULT = re.compile(r"BENCH (\{.*\})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--worker", choices=(*CASES, "overhead"), help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the balanced order of the cases")
    p.add_argument("--steps", type=int, default=60, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=15, help="untimed steps first (tracing, allocation)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one job may take")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ workers
def synthetic(steps: int, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((steps * batch, LAYERS[0]), dtype=np.float32),
            rng.integers(0, LAYERS[-1], steps * batch).astype(np.int32))


def mlp(keras):
    layers = [keras.Input((LAYERS[0],))]
    layers += [keras.layers.Dense(n, activation="relu") for n in LAYERS[1:-1]]
    layers.append(keras.layers.Dense(LAYERS[-1]))
    return keras.Sequential(layers)


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def timed_fit(keras, model, x, y, batch: int, warmup: int) -> float:
    """Seconds for the steps after ``warmup``, measured by a callback around the batches."""
    marks: dict[str, float] = {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch_index, logs=None):
            if batch_index == warmup:
                marks["start"] = time.perf_counter()

        def on_train_batch_end(self, batch_index, logs=None):
            marks["end"] = time.perf_counter()

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Clock()])
    return marks["end"] - marks["start"]


def report(case: str, ranks: int, steps: int, seconds: float, **extra) -> None:
    print("BENCH " + json.dumps({"case": case, "ranks": ranks, "samples_per_s": steps * BATCH * ranks / seconds,
                                 "step_ms": 1e3 * seconds / steps, "peak_rss_mib": peak_rss_mib(), **extra}),
          flush=True)


def worker_single(args) -> None:
    import keras

    x, y = synthetic(args.warmup + args.steps, BATCH, 0)
    model = mlp(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    report("single", 1, args.steps, timed_fit(keras, model, x, y, BATCH, args.warmup))


def worker_hora(args, case: str) -> None:
    import keras

    import hora.keras as hvd

    hvd.init()
    x, y = synthetic(args.warmup + args.steps, BATCH, hvd.rank())
    model = mlp(keras)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seconds = timed_fit(keras, model, x, y, BATCH, args.warmup)
    rss = hvd.allgather_object(peak_rss_mib())
    if hvd.rank() == 0:
        report(case, hvd.size(), args.steps, seconds, rank_peak_rss_mib=rss)
    hvd.shutdown()


def worker_mwms(args) -> None:
    import tensorflow as tf

    keras = tf.keras  # tf_keras: TF_USE_LEGACY_KERAS=1 is set by the driver
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    workers = strategy.num_replicas_in_sync
    x, y = synthetic(args.warmup + args.steps, BATCH * workers, 0)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH * workers).with_options(options)
    with strategy.scope():
        model = mlp(keras)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    marks: dict[str, float] = {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch_index, logs=None):
            if batch_index == args.warmup:
                marks["start"] = time.perf_counter()

        def on_train_batch_end(self, batch_index, logs=None):
            marks["end"] = time.perf_counter()

    model.fit(dataset, epochs=1, verbose=0, callbacks=[Clock()])
    if index == 0:
        report("mwms", workers, args.steps, marks["end"] - marks["start"])


def worker_mpi4py(args) -> None:
    import keras
    import tensorflow as tf
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    x, y = synthetic(args.warmup + args.steps, BATCH, comm.rank)
    model = mlp(keras)
    model.build((None, LAYERS[0]))
    opt = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    opt.build(variables)

    @tf.function
    def grads_of(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return tape.gradient(loss, variables)

    @tf.function
    def apply(grads):
        opt.apply(grads, variables)

    sizes = [int(np.prod(v.shape)) for v in variables]
    flat = np.empty(sum(sizes), np.float32)

    def step(i: int) -> None:
        grads = grads_of(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
        offset = 0
        for g, n in zip(grads, sizes, strict=True):
            flat[offset:offset + n] = g.numpy().reshape(-1)
            offset += n
        comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        np.multiply(flat, 1.0 / comm.size, out=flat)
        out, offset = [], 0
        for v, n in zip(variables, sizes, strict=True):
            out.append(tf.constant(flat[offset:offset + n].reshape(v.shape)))
            offset += n
        apply(out)

    for i in range(args.warmup):
        step(i)
    comm.Barrier()
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    seconds = time.perf_counter() - start
    rss = comm.gather(peak_rss_mib())
    if comm.rank == 0:
        report("mpi4py", comm.size, args.steps, seconds, rank_peak_rss_mib=rss)


def worker_overhead(args) -> None:
    """One rank: a tf.function train step with and without hora's grouped allreduce of its gradients."""
    import keras
    import tensorflow as tf

    import hora.tensorflow as hvd

    hvd.init()
    x, y = synthetic(1, BATCH, 0)
    model = mlp(keras)
    model.build((None, LAYERS[0]))
    opt = keras.optimizers.SGD(0.001)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    opt.build(variables)

    def make(with_hora: bool):
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, variables)
            if with_hora:  # what DistributedOptimizer adds: one py_function with every gradient
                grads = hvd.grouped_allreduce(grads)
            opt.apply(grads, variables)
            return loss

        return step

    steps = {"plain": make(False), "hora": make(True)}
    for fn in steps.values():
        for _ in range(args.warmup):
            fn(x, y)
    block = max(5, args.steps // 4)
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}  # the process's CPU time: what other load does not add
    for _ in range(6):
        for name in ("plain", "hora", "hora", "plain"):
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(block):
                steps[name](x, y).numpy()
            times[name].append((time.perf_counter() - start) / block)
            cpu[name].append((time.process_time() - start_cpu) / block)
    plain, hora = float(np.median(times["plain"])), float(np.median(times["hora"]))
    plain_cpu, hora_cpu = float(np.median(cpu["plain"])), float(np.median(cpu["hora"]))
    print("BENCH " + json.dumps({"case": "overhead", "plain_step_ms": plain * 1e3, "hora_step_ms": hora * 1e3,
                                 "overhead_ms": (hora - plain) * 1e3, "overhead_fraction": (hora - plain) / hora,
                                 "plain_cpu_ms": plain_cpu * 1e3, "hora_cpu_ms": hora_cpu * 1e3,
                                 "overhead_cpu_ms": (hora_cpu - plain_cpu) * 1e3,
                                 "overhead_cpu_fraction": (hora_cpu - plain_cpu) / hora_cpu}),
          flush=True)
    hvd.shutdown()


# ------------------------------------------------------------------------------------------- driver
def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = clean_child_env(1)
    env.update({"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1",
                "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO), "KERAS_BACKEND": "tensorflow"})
    env.update(extra or {})
    return env


def run_case(case: str, args: argparse.Namespace) -> dict:
    me = [sys.executable, str(Path(__file__).resolve()), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    hora_run = [sys.executable, "-m", "hora.runner.cli", "run", "-np", "2", "--mpi"]
    if case == "mwms":
        ports = free_ports(2)
        cluster = {"worker": [f"localhost:{p}" for p in ports]}
        procs = [subprocess.Popen([*me, "--worker", "mwms"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=job_env({"TF_USE_LEGACY_KERAS": "1", "TF_CONFIG": json.dumps(
                                      {"cluster": cluster, "task": {"type": "worker", "index": i}})}))
                 for i in range(2)]
        outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        out = "\n".join(outs)
    else:
        if case == "single":
            cmd = [*me, "--worker", "single"]
        elif case == "mpi4py":
            from hora.runner.launchers.mpi import mpirun_path

            cmd = [mpirun_path() or "mpirun", "-np", "2", "--oversubscribe", *me, "--worker", "mpi4py"]
            if os.geteuid() == 0:
                cmd[1:1] = ["--allow-run-as-root"]
        elif case == "overhead":
            cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", "1", "--mpi", *me, "--worker", "overhead"]
        else:
            cmd = [*hora_run, *me, "--worker", case]
        env = job_env({"KERAS_BACKEND": "torch"} if case == "hora-torch" else None)
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             timeout=args.timeout).stdout
    match = RESULT.search(out)
    if not match:
        raise RuntimeError(f"case {case} reported no result:\n{out[-3000:]}")
    return json.loads(match.group(1))


def load1() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    worker = {"single": worker_single, "mwms": worker_mwms, "mpi4py": worker_mpi4py, "overhead": worker_overhead,
              "hora-tf": lambda a: worker_hora(a, "hora-tf"), "hora-torch": lambda a: worker_hora(a, "hora-torch")}
    if args.worker:
        worker[args.worker](args)
        return 0
    cases = [c for c in args.cases.split(",") if c]
    results: dict[str, list[dict]] = {c: [] for c in cases}
    loads = []
    started = datetime.datetime.now(datetime.timezone.utc)
    for r in range(args.rounds):
        for case in cases[r % len(cases):] + cases[:r % len(cases)]:
            loads.append(load1())
            res = run_case(case, args)
            results[case].append(res)
            print(f"round {r} {case}: {res['samples_per_s']:.0f} samples/s (load {loads[-1]:.2f})", flush=True)
    overhead = run_case("overhead", args)
    rate = {c: median([r["samples_per_s"] for r in results[c]]) for c in cases}
    rows = []
    for c in cases:
        ratio = (f"{rate[c] / rate['mwms']:.2f}" if "mwms" in rate else "-")
        eff = f"{rate[c] / (2 * rate['single']):.2f}" if "single" in rate and c != "single" else "-"
        rss = [res.get("rank_peak_rss_mib", [res["peak_rss_mib"]]) for res in results[c]]
        rows.append([c, f"{rate[c]:,.0f}", ratio, eff, f"{max(max(x) for x in rss):,.0f}"])
    print(f"\nKeras MLP {'-'.join(map(str, LAYERS))}, batch {BATCH}/rank, 1 thread/rank, 2 ranks; "
          f"{args.rounds} round(s) x {args.steps} timed steps; {started:%Y-%m-%d %H:%M} UTC; "
          f"1-min load during the run {min(loads):.2f}-{max(loads):.2f}")
    print(markdown_table(["case", "samples/s", "x MWMS", "scaling eff. (vs 2 x single)", "peak RSS/rank MiB"],
                         rows))
    if "hora-tf" in rate and "mpi4py" in rate:
        print(f"\nhora-tf / mpi4py loop: {rate['hora-tf'] / rate['mpi4py']:.2f}")
    print(f"hora inside tf.function on 1 rank: step {overhead['plain_step_ms']:.2f} ms -> "
          f"{overhead['hora_step_ms']:.2f} ms, +{overhead['overhead_ms']:.3f} ms "
          f"({100 * overhead['overhead_fraction']:.1f}% of the step); process CPU time a step "
          f"{overhead['plain_cpu_ms']:.2f} ms -> {overhead['hora_cpu_ms']:.2f} ms, "
          f"+{overhead['overhead_cpu_ms']:.3f} ms "
          f"({100 * overhead['overhead_cpu_fraction']:.1f}%)")
    grads_mib = sum(a * b + b for a, b in zip(LAYERS[:-1], LAYERS[1:], strict=True)) * 4 / 2 ** 20
    if "single" in rate and "hora-tf" in rate:
        single = median([r["peak_rss_mib"] for r in results["single"]])
        hora = max(max(r["rank_peak_rss_mib"]) for r in results["hora-tf"])
        print(f"peak RSS: hora-tf rank {hora:.0f} MiB vs single process {single:.0f} MiB: +{hora - single:.0f} MiB "
              f"(gradients {grads_mib:.1f} MiB; budget fusion buffer + 10% of gradients)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
