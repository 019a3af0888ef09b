"""hora.spark's three targets, measured in one run on a real standalone Spark cluster (one master, one worker).

1. **Time to the first collective**, from ``run()`` being called on the
   driver to the first allreduce done on rank 0: ``hora.spark.run`` against
   Spark's own ``TorchDistributor(num_processes=2, local_mode=False,
   use_gpu=False)``, on the same cluster and session, with the same function
   body (each library's init, then one allreduce of one float, returning the
   time).  The two alternate, ``--repeats`` times each.
2. **Throughput**: the MLP training function of ``benchmarks/ray.py``
   (784-1024-1024-10, SGD, batch ``--batch`` per rank, 1 thread per rank,
   ``--steps`` timed steps after ``--warmup``, slowest rank) inside
   ``hora.spark.run`` and inside ``hora.run(..., use_gloo=True)`` (the path
   of ``hora run -np 2 --gloo``), in ABBA blocks with new processes on both
   sides; the ratio is the median of the per-pair ratios.  The ranks' CPU
   time per step is printed beside it: on a loaded machine it shows whether
   a gap is the ranks' own work or their share of the CPUs.
3. **Feeding** (``--rows`` rows of ``--width`` float32s, 1M x 784 by default):
   Spark writes the data to a local Parquet directory once; then one rank of
   ``hora.spark.run(fn, df=spark.read.parquet(...))`` reads its partition as
   NumPy batches of ``--feed-batch`` rows (the rank's rows/s, and its peak
   RSS), against one process reading the same Parquet files with pyarrow
   into the same NumPy batches.  The end-to-end time of the ``df=`` job
   (Spark's read, repartition, Arrow transfer, the spill and the read) is
   printed too.

Run::

    python benchmarks/spark.py                            # everything, 2 ranks
    python benchmarks/spark.py --rows 200000 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# This folder holds ray.py, which would hide Ray's package from an import of ray: drop the folder from the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="first-collective runs of each library")
    p.add_argument("--blocks", type=int, default=3, help="MLP blocks of each engine (ABBA order)")
    p.add_argument("--steps", type=int, default=40, help="timed MLP steps per block")
    p.add_argument("--warmup", type=int, default=5, help="untimed MLP steps per block")
    p.add_argument("--batch", type=int, default=128, help="MLP batch per rank")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the feeding DataFrame (0: skip part 3)")
    p.add_argument("--width", type=int, default=784, help="float32 columns per row (one array column)")
    p.add_argument("--feed-batch", type=int, default=1024, help="rows per NumPy batch when feeding")
    p.add_argument("--parts", default="1,2,3", help="which parts to run")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--peer-read", nargs=3, metavar=("DIR", "BATCH", "ROWS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _ray_bench():
    """benchmarks/ray.py as a module (its MLP block), shipped to the ranks by value."""
    import cloudpickle

    spec = importlib.util.spec_from_file_location("hora_bench_ray", REPO / "benchmarks" / "ray.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hora_bench_ray"] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def hora_first_collective() -> float:
    import torch

    import hora.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(1), name="first")
    return time.time()


def torch_first_collective() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    done = time.time()
    dist.destroy_process_group()
    return done


def feed_rank(batch: int) -> dict[str, float]:
    """One rank's pass over its partition of ``df=``: rows, seconds, peak RSS."""
    import hora.spark

    part = hora.spark.data()
    start = time.perf_counter()
    rows = 0
    for chunk in part.batches(batch, columns=["x"], even=False):
        rows += len(chunk["x"])
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def feed_parquet(directory: str, batch: int, limit: int) -> dict[str, float]:
    """The peer, in a process of its own: pyarrow reads the Parquet files into NumPy batches of ``batch`` rows
    (``limit`` rows); rows, seconds and peak RSS."""
    import pyarrow.dataset as ds

    from hora.spark.partition import column_to_numpy

    start = time.perf_counter()
    rows = 0
    for record in ds.dataset(directory, format="parquet").to_batches(columns=["x"], batch_size=batch):
        rows += len(column_to_numpy(record.column(0), "x"))
        if rows >= limit:
            break
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def peer_read(directory: str, batch: int, limit: int) -> dict[str, float]:
    """:func:`feed_parquet` in a new Python process (its peak RSS is then its own)."""
    import subprocess

    out = subprocess.run([sys.executable, __file__, "--peer-read", directory, str(batch), str(limit)],
                         capture_output=True, text=True, check=True, timeout=3600).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer_read:
        print(json.dumps(feed_parquet(args.peer_read[0], int(args.peer_read[1]), int(args.peer_read[2]))))
        return 0
    parts = {int(p) for p in args.parts.split(",") if p}
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import hora
    import hora.spark
    from hora.spark.driver import slot_count
    from hora.spark.standalone import StandaloneCluster

    print(f"load before: {load()}   date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    figures: dict[str, object] = {"load_before": load()}
    env = {"OMP_NUM_THREADS": "1"}
    scratch = tempfile.mkdtemp(prefix="hora-spark-bench-")
    with StandaloneCluster(cores=2, memory_mb=2048) as cluster:
        spark = (SparkSession.builder.master(cluster.url).appName("hora-spark-bench")
                 .config("spark.executor.cores", "1").config("spark.cores.max", "2")
                 .config("spark.executor.memory", "768m").config("spark.driver.memory", "1g")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", "2")
                 .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", str(REPO)))
                 .config("spark.executorEnv.OMP_NUM_THREADS", "1").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        try:
            deadline = time.monotonic() + 180
            while slot_count(spark.sparkContext)[0] < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            if 1 in parts:
                from pyspark.ml.torch.distributor import TorchDistributor

                first: dict[str, list[float]] = {"hora": [], "torch": []}
                for _ in range(args.repeats):
                    for name in ("hora", "torch"):
                        t0 = time.time()
                        if name == "hora":
                            done = hora.spark.run(hora_first_collective, num_proc=2, env=env)[0]
                        else:
                            distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
                            done = distributor.run(torch_first_collective)
                        first[name].append(done - t0)
                        print(f"  first collective {name:6s} {done - t0:7.2f} s   load {load()}", flush=True)
                ratio = statistics.median(first["hora"]) / statistics.median(first["torch"])
                figures["first_collective_s"] = first
                figures["first_collective_ratio"] = ratio
                print(f"time to first collective: hora.spark median {statistics.median(first['hora']):.2f} s, "
                      f"TorchDistributor median {statistics.median(first['torch']):.2f} s, ratio {ratio:.3f}",
                      flush=True)
            if 2 in parts:
                bench = _ray_bench()
                block = (args.steps, args.warmup, args.batch, str(REPO / "examples" / "torch" / "models.py"))
                rates: dict[str, list[float]] = {"spark": [], "gloo": []}
                cpu: dict[str, list[float]] = {"spark": [], "gloo": []}  # rank CPU seconds per timed step
                order = ["spark", "gloo", "gloo", "spark"]
                for i in range(args.blocks * 2):
                    engine = order[i % 4]
                    if engine == "spark":
                        results = hora.spark.run(bench.mlp_block, args=block, num_proc=2, env=env)
                    else:
                        results = hora.run(bench.mlp_block, args=block, np=2, use_gloo=True, env=env)
                    rates[engine].append(results[0]["samples_per_s"])
                    cpu[engine].append(statistics.mean(r["cpu_s"] for r in results) / args.steps)
                    print(f"  block {i + 1:2d} {engine:5s} {results[0]['samples_per_s']:9.1f} samples/s, "
                          f"{cpu[engine][-1] * 1e3:.1f} ms CPU per step per rank   load {load()}", flush=True)
                ratios = [s / g for s, g in zip(rates["spark"], rates["gloo"], strict=True)]
                cpu_ratios = [g / s for s, g in zip(cpu["spark"], cpu["gloo"], strict=True)]
                figures["mlp_rates"] = rates
                figures["mlp_ratios"] = ratios
                figures["mlp_cpu_per_step_s"] = cpu
                figures["mlp_cpu_ratios"] = cpu_ratios
                print(f"MLP inside hora.spark.run / hora run --gloo: median of pairs {statistics.median(ratios):.3f} "
                      f"(pairs {', '.join(f'{r:.3f}' for r in ratios)}); by the ranks' CPU time per step (gloo's / "
                      f"spark's): {statistics.median(cpu_ratios):.3f}", flush=True)
            if 3 in parts and args.rows > 0:
                path = os.path.join(scratch, "data.parquet")
                t = time.perf_counter()
                columns = [F.rand(seed=i).cast("float") for i in range(args.width)]
                spark.range(args.rows).select(F.array(*columns).alias("x")).write.parquet(path)
                print(f"  wrote {args.rows} rows x {args.width} floats to Parquet in {time.perf_counter() - t:.1f} s",
                      flush=True)
                t = time.perf_counter()
                results = hora.spark.run(feed_rank, args=(args.feed_batch,), num_proc=2, env=env,
                                         df=spark.read.parquet(path))
                end_to_end = time.perf_counter() - t
                rank0 = results[0]
                peer = peer_read(path, args.feed_batch, int(rank0["rows"]))
                ours_rate = rank0["rows"] / rank0["seconds"]
                peer_rate = peer["rows"] / peer["seconds"]
                figures["feed"] = {"ranks": results, "parquet": peer, "end_to_end_s": end_to_end,
                                   "ratio": ours_rate / peer_rate}
                print(f"feeding: rank 0 read {rank0['rows']:.0f} rows in {rank0['seconds']:.2f} s "
                      f"({ours_rate:,.0f} rows/s, peak RSS {rank0['rss_mb']:.0f} MB); pyarrow Parquet read of "
                      f"the same rows {peer['seconds']:.2f} s ({peer_rate:,.0f} rows/s, peak RSS "
                      f"{peer['rss_mb']:.0f} MB); ratio {ours_rate / peer_rate:.3f}; the whole df= job "
                      f"{end_to_end:.1f} s", flush=True)
        finally:
            spark.stop()
            shutil.rmtree(scratch, ignore_errors=True)
    figures["load_after"] = load()
    print(f"load after: {figures['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
