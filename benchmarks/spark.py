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
3. **Feeding** (``--rows`` rows of one ``--width``-float32 array column,
   1M x 784 by default, in 8 Parquet files that pyarrow writes in seconds):
   each of 2 ranks of ``hora.spark.run(fn, df=...)`` reads its half as
   NumPy batches of ``--feed-batch`` rows for ``--epochs`` epochs, against
   pyarrow (``ParquetFile.iter_batches``, the same batches and conversion)
   reading the same halves in 2 processes at once, as the ranks do, and one
   alone.  Two ways in: ``spark.read.parquet(path)`` itself, whose files the
   ranks read directly (:mod:`hora.spark.files`), and the same scan behind a
   filter that keeps every row, which Spark hands over (``mapInArrow`` after
   a repartition, spilled to a local Arrow file).  For each: the rank's
   first epoch as it reads it, the first pass from ``run()`` called (job
   launch and Spark's transfer included) against pyarrow's from its process's
   start, the later epochs, and each side's peak RSS.  ``--breakdown`` also
   times Spark handing the rows to Python alone, with and without a shuffle.

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
    p.add_argument("--epochs", type=int, default=3, help="epochs each rank reads when feeding (the first timed apart)")
    p.add_argument("--ways", default="files,spark",
                   help="feeding: files (the ranks read the Parquet files), spark (Spark hands the rows over)")
    p.add_argument("--breakdown", action="store_true",
                   help="feeding: also time Spark handing the rows to Python with and without a shuffle")
    p.add_argument("--parts", default="1,2,3", help="which parts to run")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--peer-read", nargs=4, metavar=("DIR", "BATCH", "PART", "PARTS"), help=argparse.SUPPRESS)
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


def feed_rank(batch: int, epochs: int) -> dict[str, float]:
    """One rank's passes over its partition of ``df=``: when it started and when its first epoch ended
    (``time.time()``, to set against the moment ``run()`` was called), the first epoch's seconds from
    ``hora.spark.data()`` on, the rows and seconds of the later epochs, its peak RSS."""
    started = time.time()
    import pyarrow.parquet  # noqa: F401  (imported before the timing starts, as the peer's imports are)

    import hora.spark

    read_start = time.time()
    part = hora.spark.data()
    rows = 0
    for chunk in part.batches(batch, columns=["x"], even=False):
        rows += len(chunk["x"])
    first_end = time.time()
    later_rows, t = 0, time.perf_counter()
    for _ in range(epochs - 1):
        for chunk in part.batches(batch, columns=["x"], even=False):
            later_rows += len(chunk["x"])
    return {"rows": rows, "started": started, "first_end": first_end, "first_read_s": first_end - read_start,
            "later_rows": later_rows, "later_s": time.perf_counter() - t,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def write_parquet(directory: str, rows: int, width: int, files: int = 8) -> None:
    """The data set: ``rows`` rows of one ``width``-float32 array column ``x``, in ``files`` Parquet files
    written with pyarrow (row groups of 16,384 rows), which Spark reads as ``array<float>``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory)
    rng = np.random.default_rng(0)
    per_file = -(-rows // files)
    for index in range(files):
        count = min(per_file, rows - index * per_file)
        if count <= 0:
            break
        values = pa.array(rng.random((count, width), dtype=np.float32).ravel())
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(values, width)})
        pq.write_table(table, os.path.join(directory, f"part-{index:05d}.parquet"), row_group_size=16384)


def feed_parquet(directory: str, batch: int, part: int, parts: int) -> dict[str, float]:
    """The peer, in a process of its own: pyarrow reads part ``part`` of ``parts`` of the Parquet files (a
    contiguous run of files, as a rank's share is a contiguous run of rows) with ``ParquetFile.iter_batches``,
    the fastest of pyarrow's readers here, into NumPy ``(batch, width)`` float32 arrays; rows, seconds and
    peak RSS."""
    import glob

    import pyarrow.parquet as pq

    from hora.spark.partition import column_to_numpy

    paths = sorted(glob.glob(os.path.join(directory, "*.parquet")))
    start = time.perf_counter()
    rows = 0
    for path in paths[part * len(paths) // parts:(part + 1) * len(paths) // parts]:
        for record in pq.ParquetFile(path).iter_batches(batch_size=batch, columns=["x"]):
            rows += len(column_to_numpy(record.column(0), "x"))
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def peer_read(directory: str, batch: int, parts: int, which: list[int]) -> list[dict[str, float]]:
    """:func:`feed_parquet` for the parts in ``which``, each in a new Python process (so its peak RSS is its
    own), all at once; each result also has ``wall_s``, from starting the process to its end."""
    import subprocess

    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--peer-read", directory, str(batch), str(part), str(parts)],
                              stdout=subprocess.PIPE, text=True) for part in which]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"the pyarrow reader exited with code {proc.returncode}")
        results.append({**json.loads(out.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t0})
    return results


def _count_rows(batches):
    """A pass-through stage's function: reads every Arrow batch Spark hands to Python, yields the count."""
    import pyarrow as pa

    rows = sum(b.num_rows for b in batches)
    yield pa.RecordBatch.from_arrays([pa.array([rows], pa.int64())], names=["rows"])


def spark_stages(df, num_proc: int) -> dict[str, float]:
    """Where the first pass goes: seconds for Spark to hand ``df``'s rows to Python as Arrow (a
    ``mapInArrow`` that only counts them), with whole input partitions per task and after a repartition."""
    out = {}
    for name, frame in (("narrow", df.coalesce(num_proc)), ("shuffle", df.repartition(num_proc))):
        t = time.perf_counter()
        frame.mapInArrow(_count_rows, "rows long").collect()
        out[name] = time.perf_counter() - t
    return out


def feed(spark, args: argparse.Namespace, scratch: str, env: dict[str, str]) -> dict[str, object]:
    """Part 3: the data set written, the pyarrow peer, Spark's own stages, then ``run(fn, df=...)``."""
    import hora.spark

    path = os.path.join(scratch, "data.parquet")
    t = time.perf_counter()
    write_parquet(path, args.rows, args.width)
    print(f"  wrote {args.rows} rows x {args.width} float32 to Parquet with pyarrow in {time.perf_counter() - t:.1f} s",
          flush=True)
    df = spark.read.parquet(path)
    alone = peer_read(path, args.feed_batch, 2, [0])[0]  # also warms the page cache for Spark's read
    pair = peer_read(path, args.feed_batch, 2, [0, 1])  # two readers at once, as the two ranks read
    for name, result in [("alone", alone), *((f"with another reader, part {i}", r) for i, r in enumerate(pair))]:
        print(f"  pyarrow Parquet read, {name}: {result['rows']} rows in {result['seconds']:.2f} s "
              f"({result['rows'] / result['seconds']:,.0f} rows/s; {result['wall_s']:.2f} s from the process's start), "
              f"peak RSS {result['rss_mb']:.0f} MB   load {load()}", flush=True)
    out: dict[str, object] = {"parquet_alone": alone, "parquet_pair": pair,
                              "input_partitions": df.rdd.getNumPartitions()}
    if args.breakdown:
        stages = spark_stages(df, 2)
        out["spark_stages_s"] = stages
        print(f"  Spark to Python as Arrow, counting only: whole input partitions {stages['narrow']:.1f} s, "
              f"after a repartition {stages['shuffle']:.1f} s   load {load()}", flush=True)
    from pyspark.sql import functions as F

    from hora.spark.files import scan_files

    # The same rows both ways: the plain scan, which the ranks read from the files, and the scan behind a filter
    # that keeps every row, which makes Spark hand the rows over (mapInArrow after a repartition).
    ways = [("files", df), ("spark", df.where(F.col("x").isNotNull()))]
    for way, frame in ways:
        if way not in args.ways.split(","):
            continue
        assert (scan_files(frame) is not None) == (way == "files")
        t0 = time.time()
        results = hora.spark.run(feed_rank, args=(args.feed_batch, args.epochs), num_proc=2, env=env, df=frame)
        end_to_end = time.time() - t0
        summary: dict[str, object] = {"ranks": results, "end_to_end_s": end_to_end}
        for rank, r in enumerate(results):
            peer = pair[rank]
            peer_rate = peer["rows"] / peer["seconds"]
            peer_launch_rate = peer["rows"] / peer["wall_s"]
            first_rate = r["rows"] / (r["first_end"] - t0)
            read_rate = r["rows"] / r["first_read_s"]
            later_rate = r["later_rows"] / r["later_s"] if r["later_s"] > 0 else float("nan")
            summary[f"rank{rank}"] = {
                "first_pass_rows_per_s": first_rate, "first_epoch_in_rank_rows_per_s": read_rate,
                "later_rows_per_s": later_rate, "first_in_rank_ratio": read_rate / peer_rate,
                "later_ratio": later_rate / peer_rate, "first_from_run_ratio": first_rate / peer_launch_rate}
            print(f"feeding via {way}, rank {rank}: {r['rows']:.0f} rows. First epoch, inside the rank: "
                  f"{r['first_read_s']:.2f} s = {read_rate:,.0f} rows/s = {read_rate / peer_rate:.3f}x pyarrow's "
                  f"part {rank} ({peer_rate:,.0f} rows/s). First pass from run() called: {r['first_end'] - t0:.1f} s "
                  f"(fn started after {r['started'] - t0:.1f} s) = {first_rate:,.0f} rows/s = "
                  f"{first_rate / peer_launch_rate:.3f}x pyarrow's from its process's start ({peer['wall_s']:.2f} s). "
                  f"Later epochs {later_rate:,.0f} rows/s = {later_rate / peer_rate:.2f}x. Peak RSS "
                  f"{r['rss_mb']:.0f} MB (pyarrow's {peer['rss_mb']:.0f} MB)   load {load()}", flush=True)
        out[way] = summary
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer_read:
        print(json.dumps(feed_parquet(args.peer_read[0], *(int(a) for a in args.peer_read[1:]))))
        return 0
    parts = {int(p) for p in args.parts.split(",") if p}
    from pyspark.sql import SparkSession

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
                figures["feed"] = feed(spark, args, scratch, env)
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
