"""row_sparse embedding on parameter servers: hora against MXNet 1.9.1's own ``dist_sync``, in one run.

The load of issue 30: a 1,000,000 x 64 float32 embedding (256 MB), each step
every worker pushes a row_sparse gradient of 10,000 random rows and then
``row_sparse_pull``s the same rows; SGD (lazy) runs on the servers.  Jobs
alternate MXNet, hora, MXNet, hora... (``--repeat`` of each); a job's figure is
the median step of its slowest worker, and each system's best job is
compared.  hora's bytes on the wire are counted by its client (every frame
sent to and received from the servers); the dense figure is one push plus
one pull of the whole key.  MXNet's bytes are computed from ps-lite's
message layout (8-byte key per row, 4-byte length, the rows)::

    python benchmarks/kvstore.py --sparse --mxnet-venv /work/main/.venv-mxnet
    python benchmarks/kvstore_sparse.py --mxnet-python /work/main/.venv-mxnet/bin/python --repeat 3 --iters 20
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ROWS, DIM = 1_000_000, 64


def _ids(rank: int, step: int, touched: int):
    import numpy as np

    return np.sort(np.random.default_rng(1000 * step + rank).choice(ROWS, touched, replace=False)).astype(np.int64)


def _write(times: list[float], rank: int, extra: dict) -> None:
    out = Path(os.environ["HORA_SPBENCH_OUT"])
    (out / f"worker-{rank}.json").write_text(json.dumps({"rank": rank, "times": times, **extra}))


def hora_worker(iters: int, warmup: int, touched: int) -> None:
    """One hora worker (under ``hora run -np W -s S``)."""
    import numpy as np

    import hora.kvstore as kvs
    from hora.kvstore.optimizer import SGD

    kv = kvs.create("dist_sync")
    kv.init("emb", np.ones((ROWS, DIM), np.float32))
    kv.set_optimizer(SGD(learning_rate=0.01))
    rows = np.ones((touched, DIM), np.float32)
    times, traffic = [], []
    for step in range(warmup + iters):
        ids = _ids(kv.rank, step, touched)
        kv.barrier()
        before = kv.traffic
        t0 = time.perf_counter()
        kv.push_rows("emb", ids, rows)
        got_ids, got = kv.pull_rows("emb", ids)
        dt = time.perf_counter() - t0
        after = kv.traffic
        if step >= warmup:
            times.append(dt)
            traffic.append(after["sent"] - before["sent"] + after["received"] - before["received"])
        if got.shape != (touched, DIM) or not np.array_equal(got_ids, ids):
            raise SystemExit(f"worker {kv.rank}: pulled {got.shape} rows")
    kv.barrier()
    _write(times, kv.rank, {"bytes": statistics.median(traffic)})
    kv.close()


def mxnet_worker(iters: int, warmup: int, touched: int) -> None:
    """One MXNet worker (a ``DMLC_ROLE=worker`` process)."""
    import mxnet as mx
    import numpy as np

    kv = mx.kv.create("dist_sync")
    kv.init("emb", mx.nd.ones((ROWS, DIM)).tostype("row_sparse"))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.01))
    out = mx.nd.sparse.zeros("row_sparse", (ROWS, DIM))
    rows = np.ones((touched, DIM), np.float32)
    times = []
    for step in range(warmup + iters):
        ids = _ids(kv.rank, step, touched)
        grad = mx.nd.sparse.row_sparse_array((rows, ids), shape=(ROWS, DIM))
        row_ids = mx.nd.array(ids, dtype="int64")
        mx.nd.waitall()
        kv._barrier()
        t0 = time.perf_counter()
        kv.push("emb", grad)
        kv.row_sparse_pull("emb", out=out, row_ids=row_ids)
        out.wait_to_read()
        dt = time.perf_counter() - t0
        if step >= warmup:
            times.append(dt)
        if out.indices.shape[0] != touched:
            raise SystemExit(f"worker {kv.rank}: pulled {out.indices.shape[0]} rows")
    kv._barrier()
    _write(times, kv.rank, {"bytes": touched * (8 + 4 + DIM * 4) * 2 + touched * (8 + 4)})


def _collect(out_dir: Path, workers: int) -> dict:
    results = [json.loads(f.read_text()) for f in sorted(out_dir.glob("worker-*.json"))]
    if len(results) != workers:
        raise SystemExit(f"only {len(results)} of {workers} workers wrote results")
    slowest = [max(r["times"][i] for r in results) for i in range(len(results[0]["times"]))]
    return {"median_s": statistics.median(slowest), "min_s": min(slowest),
            "bytes_per_worker": statistics.median(r["bytes"] for r in results)}


def run_hora(args: argparse.Namespace) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="hora-spbench-"))
    env = {**os.environ, "HORA_SPBENCH_OUT": str(out_dir), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.workers), "-s", str(args.servers),
           sys.executable, __file__, "--role", "hora", *_role_args(args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"hora job failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return _collect(out_dir, args.workers)


def run_mxnet(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks" / "mxnet_peer"))
    from kvstore_bench import free_port

    out_dir = Path(tempfile.mkdtemp(prefix="hora-spbench-mx-"))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "HORA_"))}
    base.pop("PYTHONPATH", None)
    base.update({"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
                 "DMLC_NUM_SERVER": str(args.servers), "DMLC_NUM_WORKER": str(args.workers),
                 "DMLC_NODE_HOST": "127.0.0.1", "HORA_SPBENCH_OUT": str(out_dir)})
    procs = []
    for role, n in (("scheduler", 1), ("server", args.servers), ("worker", args.workers)):
        cmd = [args.mxnet_python, "-c", "import mxnet"] if role != "worker" else \
            [args.mxnet_python, __file__, "--role", "mxnet", *_role_args(args)]
        for _ in range(n):
            procs.append(subprocess.Popen(cmd, env={**base, "DMLC_ROLE": role}, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE if role == "worker" else subprocess.DEVNULL,
                                          start_new_session=True))
    workers = procs[-args.workers:]
    try:
        for w in workers:
            _, err = w.communicate(timeout=args.timeout)
            if w.returncode != 0:
                raise SystemExit(f"an MXNet worker failed ({w.returncode}):\n{err.decode(errors='replace')[-3000:]}")
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return _collect(out_dir, args.workers)


def _role_args(args: argparse.Namespace) -> list[str]:
    return ["--iters", str(args.iters), "--warmup", str(args.warmup), "--touched", str(args.touched)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--touched", type=int, default=10_000, help="rows pushed and pulled per step and worker")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3, help="jobs of each system, alternating")
    p.add_argument("--mxnet-python", default=None, help="python of an MXNet 1.9.1 venv (none: hora only)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--role", choices=("hora", "mxnet"), default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Alternate MXNet and hora jobs; print the comparison."""
    args = parse_args(argv)
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # benchmarks/mxnet.py is not mxnet
    if args.role == "hora":
        hora_worker(args.iters, args.warmup, args.touched)
        return 0
    if args.role == "mxnet":
        mxnet_worker(args.iters, args.warmup, args.touched)
        return 0
    runs: dict[str, list[dict]] = {"mxnet": [], "hora": []}
    for i in range(args.repeat):
        for system, fn in (("mxnet", run_mxnet), ("hora", run_hora)):
            if system == "mxnet" and args.mxnet_python is None:
                continue
            print(f"{system} job {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            runs[system].append(fn(args))
            print(f"  {runs[system][-1]}", file=sys.stderr, flush=True)
    dense = 2 * ROWS * DIM * 4
    print(f"\n{ROWS:,} x {DIM} float32 embedding, {args.touched:,} rows per step and worker, {args.workers} workers, "
          f"{args.servers} server(s); best of {args.repeat} alternating jobs (median step of the slowest worker)\n")
    print("| system | step (best job) | each job | bytes on the wire per worker and step | over dense push+pull |")
    print("|---|---|---|---|---|")
    best = {}
    for system, results in runs.items():
        if not results:
            continue
        best[system] = min(r["median_s"] for r in results)
        each = ", ".join(f"{r['median_s'] * 1e3:.1f} ms" for r in results)
        nbytes = results[0]["bytes_per_worker"]
        print(f"| {system} | {best[system] * 1e3:.1f} ms | {each} | {nbytes / 1e6:.2f} MB | 1/{dense / nbytes:.0f} |")
    if len(best) == 2:
        print(f"\nhora / MXNet step time: {best['hora'] / best['mxnet']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "dense_bytes": dense, "args": vars(args) | {"json": None}},
                                        default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
