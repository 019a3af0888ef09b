"""MXNet 1.9.1's own ``dist_sync`` KVStore: push+pull time per iteration, the peer of hora's parameter server.

Runs with the python of the venv that ``benchmarks/mxnet_peer/setup.sh``
makes (MXNet 1.9.1, numpy<1.24); it imports nothing from hora, so it measures
MXNet alone.  It starts the roles by hand, as MXNet's ``tools/launch.py
--launcher local`` does: one scheduler, S servers and W workers on this host,
each a process with ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI=127.0.0.1``,
``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_SERVER`` and ``DMLC_NUM_WORKER`` in its
environment.  A scheduler or server process only imports mxnet: the import
runs its ps-lite loop and exits when the workers finalise.

Each worker creates ``mx.kv.create('dist_sync')``, inits one float32 key per
size (keys above ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements, 1,000,000 by
default, are split over all servers), then per iteration: a barrier, push a
gradient of ones, pull into ``out``, wait for the result.  The row reported
for a size is the median over iterations of the slowest worker's time.  One
JSON object goes to stdout (and to ``--json FILE``)::

    ~/.cache/hora/mxnet-venv/bin/python benchmarks/mxnet_peer/kvstore_bench.py --workers 2 --servers 1
    ... --workers 2 --servers 2 --sizes 4MiB,16MiB,64MiB --iters 10 --json mx.json
    ... --workers 2 --servers 1 --sizes 64MiB --optimizer lamb

``--optimizer NAME`` sets that optimizer on the servers (``kv.set_optimizer``,
MXNet's defaults), so each round's update is part of the push+pull time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MXNET_VERSION = "1.9.1"
UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
         "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``4MiB`` / ``64M`` / ``4096`` to bytes (binary units); a positive multiple of 4 (float32)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}: write e.g. 4MiB, 64M or 4096")
    n = int(m.group(1)) * UNITS[m.group(2).upper()]
    if n <= 0 or n % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} = {n} bytes is not a positive multiple of 4 (float32)")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the launcher (the roles get theirs from the environment)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", "-n", type=int, default=2, help="worker processes (DMLC_NUM_WORKER)")
    p.add_argument("--servers", "-s", type=int, default=1, help="server processes (DMLC_NUM_SERVER)")
    p.add_argument("--sizes", default="4MiB,16MiB,64MiB", help="comma-separated key sizes (float32)")
    p.add_argument("--iters", type=int, default=10, help="timed push+pull iterations per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per size first")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the whole job is killed")
    p.add_argument("--omp-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for every role (unset: MXNet's default)")
    p.add_argument("--optimizer", default="",
                   help="a server optimizer by name with MXNet's defaults, set by kv.set_optimizer ('sgd+momentum': "
                        "momentum 0.9); empty: the servers keep the sum")
    p.add_argument("--json", type=Path, default=None, help="also write the result to this file")
    args = p.parse_args(argv)
    if args.workers < 1 or args.servers < 1:
        p.error(f"need at least 1 worker and 1 server, got --workers {args.workers} --servers {args.servers}")
    if args.iters < 1 or args.warmup < 0:
        p.error(f"need --iters >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    try:
        args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if not args.size_list:
        p.error("--sizes is empty")
    return args


# --------------------------------------------------------------------------- worker role


def worker_main() -> int:
    """One worker: time push+pull of every size and write the times to the result directory."""
    import mxnet as mx

    sizes = [int(s) for s in os.environ["HORA_MXBENCH_SIZES"].split(",")]
    iters, warmup = int(os.environ["HORA_MXBENCH_ITERS"]), int(os.environ["HORA_MXBENCH_WARMUP"])
    kv = mx.kv.create("dist_sync")
    rank, nworkers = kv.rank, kv.num_workers
    optimizer = os.environ.get("HORA_MXBENCH_OPTIMIZER", "")
    if optimizer:  # pickled to the servers, which then update every key on each round's merged push
        name, momentum = optimizer.removesuffix("+momentum"), optimizer.endswith("+momentum")
        kv.set_optimizer(mx.optimizer.create(name, **({"momentum": 0.9} if momentum else {})))
    times: dict[str, list[float]] = {}
    for key, nbytes in enumerate(sizes):
        n = nbytes // 4
        kv.init(key, mx.nd.zeros(n, dtype="float32"))
        grad, out = mx.nd.ones(n, dtype="float32"), mx.nd.zeros(n, dtype="float32")
        mx.nd.waitall()
        ts = []
        for i in range(warmup + iters):
            kv._barrier()  # every iteration starts together; the time is then this worker's wait for the round
            t0 = time.perf_counter()
            kv.push(key, grad)
            kv.pull(key, out=out)
            out.wait_to_read()
            dt = time.perf_counter() - t0
            if i == 0 and not optimizer:
                got = float(out[0].asscalar())
                if got != nworkers:  # no updater: the server stores the sum of the workers' pushes
                    raise SystemExit(f"worker {rank}: pulled {got} for key {key}, expected {nworkers}")
            if i >= warmup:
                ts.append(dt)
        times[str(nbytes)] = ts
        print(f"worker {rank}: {nbytes} B median {statistics.median(ts) * 1e3:.2f} ms", file=sys.stderr,
              flush=True)
    out_dir = Path(os.environ["HORA_MXBENCH_OUT"])
    (out_dir / f"worker-{rank}.json").write_text(json.dumps({"rank": rank, "times": times}))
    return 0


# --------------------------------------------------------------------------- launcher


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib(pid: int) -> float | None:
    """Peak resident set (VmHWM) of a live process in MiB, None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def launch(args: argparse.Namespace) -> dict:
    """Start scheduler, servers and workers; wait for the workers; return the merged result.

    Raises:
        SystemExit: a role failed or the job outlived ``--timeout`` (every process is killed first).
    """
    port = free_port()
    out_dir = Path(tempfile.mkdtemp(prefix="hora-mxbench-"))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_", "HORA_"))}
    base.update({
        "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
        "DMLC_NUM_SERVER": str(args.servers), "DMLC_NUM_WORKER": str(args.workers),
        "DMLC_NODE_HOST": "127.0.0.1",  # ps-lite would otherwise guess an interface
        "HORA_MXBENCH_SIZES": ",".join(map(str, args.size_list)), "HORA_MXBENCH_ITERS": str(args.iters),
        "HORA_MXBENCH_WARMUP": str(args.warmup), "HORA_MXBENCH_OUT": str(out_dir),
        "HORA_MXBENCH_OPTIMIZER": args.optimizer,
    })
    if args.omp_threads is not None:
        base["OMP_NUM_THREADS"] = str(args.omp_threads)
    procs: list[tuple[str, subprocess.Popen]] = []

    def start(role: str, cmd: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env={**base, "DMLC_ROLE": role}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE if role == "worker" else subprocess.DEVNULL,
                                start_new_session=True)
        procs.append((role, proc))
        return proc

    server_cmd = [sys.executable, "-c", "import mxnet"]  # the import runs the server/scheduler loop
    start("scheduler", server_cmd)
    servers = [start("server", server_cmd) for _ in range(args.servers)]
    workers = [start("worker", [sys.executable, os.path.abspath(__file__), "--role-worker"])
               for _ in range(args.workers)]
    deadline = time.monotonic() + args.timeout
    server_rss: dict[int, float] = {}
    try:
        while any(w.poll() is None for w in workers):
            if time.monotonic() > deadline:
                raise SystemExit(f"MXNet job did not finish within --timeout {args.timeout:.0f} s; killed it")
            failed = [w for w in workers if w.poll() not in (None, 0)]
            if failed:
                err = failed[0].stderr.read().decode(errors="replace") if failed[0].stderr else ""
                raise SystemExit(f"an MXNet worker exited with status {failed[0].returncode}:\n{err[-3000:]}")
            for i, s in enumerate(servers):
                rss = peak_rss_mib(s.pid)
                if rss is not None:
                    server_rss[i] = rss
            time.sleep(0.2)
        for w in workers:
            if w.returncode != 0:
                err = w.stderr.read().decode(errors="replace") if w.stderr else ""
                raise SystemExit(f"an MXNet worker exited with status {w.returncode}:\n{err[-3000:]}")
        for _, p in procs:  # servers and the scheduler leave once the workers have finalised
            try:
                p.wait(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for _, p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if p.stderr:
                p.stderr.close()

    per_worker = [json.loads(f.read_text())["times"] for f in sorted(out_dir.glob("worker-*.json"))]
    for f in out_dir.iterdir():
        f.unlink()
    out_dir.rmdir()
    if len(per_worker) != args.workers:
        raise SystemExit(f"only {len(per_worker)} of {args.workers} workers wrote results")
    rows = []
    for nbytes in args.size_list:
        slowest = [max(w[str(nbytes)][i] for w in per_worker) for i in range(args.iters)]
        rows.append({"bytes": nbytes, "median_s": statistics.median(slowest), "min_s": min(slowest),
                     "max_s": max(slowest), "times_s": slowest})
    import mxnet
    import numpy

    return {
        "peer": "mxnet", "mxnet": mxnet.__version__, "numpy": numpy.__version__,
        "python": platform.python_version(), "kvstore": "dist_sync",
        "workers": args.workers, "servers": args.servers, "iters": args.iters, "warmup": args.warmup,
        "optimizer": args.optimizer,
        "bigarray_bound": int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND", "1000000")),
        "server_peak_rss_mib": [server_rss.get(i) for i in range(args.servers)],
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Run as a worker role (``--role-worker``) or as the launcher of a whole MXNet job."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--role-worker"]:
        return worker_main()
    args = parse_args(argv)
    result = launch(args)
    text = json.dumps(result)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
