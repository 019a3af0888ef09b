"""``hora bench``: argument parsing only.

Four benchmarks, each a sub-command whose flags become a config dataclass
handed to its module (:mod:`hora.bench.plan`, :mod:`.allreduce`,
:mod:`.train`, :mod:`.kvstore`):

    hora bench plan --workers 64 --servers 32 --link 25gbit --model-mb 100
    hora bench allreduce --sizes 4KiB,1MiB,64MiB --backends gloo,mpi -np 2,4 --json out.json --plot ar.png
    hora bench train -np 1,2,4 --strategy allreduce,ps --model resnet18
    hora bench kvstore --workers 2 --servers 1,2,4 --sizes 4MiB,64MiB
    hora bench kvstore --emulate-hosts 16 --link 1gbit --workers 8 --servers 1,2,4,8 --sizes 16MiB --repeat 3

The measuring ones run real ``hora run`` jobs (``-H``/``--hostfile`` pass
through to the launcher), show a progress bar on stderr, print a markdown
table at the end with the cost model's prediction beside every measured row,
write JSON with ``--json [FILE]`` (stdout without FILE; the table then goes
to stderr) and a PNG with ``--plot FILE``.

The ``hora`` CLI (:mod:`hora.cli`) mounts this with :func:`add_arguments` and
:func:`run_command` (its SUBCOMMANDS table); :func:`add_parser` does the same
on any ``add_subparsers()`` object, and ``python -m hora.bench.cli`` runs it
alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hora.errors import ConfigError, HoraError

HELP = "benchmark allreduce, parameter servers and training; predict with the cost model"


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,2,4") from None
    if not values:
        raise argparse.ArgumentTypeError("the list is empty")
    return values


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_output_options(p: argparse.ArgumentParser) -> None:
    """``--json [FILE]``."""
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the results as JSON to FILE, or to stdout without FILE (the table then goes to stderr)")


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Flags every measuring benchmark shares: hosts, emulation, the model's link, output."""
    where = p.add_argument_group("where the jobs run (passed to hora run)")
    where.add_argument("-H", "--hosts", metavar="HOSTS", help="host1:slots,host2:slots, or a hostfile path")
    where.add_argument("--hostfile", metavar="FILE", help="file with one 'host slots=N' per line")
    where.add_argument("--hora-run-args", metavar="ARGS", default="",
                       help="more hora run flags, quoted (e.g. '--network-interface eth0')")
    where.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="limit for each job")
    emu = p.add_argument_group("emulated cluster and cost model")
    emu.add_argument("--emulate-hosts", type=int, metavar="N",
                     help="run every rank and server on its own emulated host (network namespaces)")
    emu.add_argument("--link", default="auto", metavar="RATE",
                     help="link rate in tc units (1gbit, 10gbit, 25gbit): the emulated links, and the model's; "
                          "'auto' on localhost measures one loopback TCP stream")
    emu.add_argument("--latency", default=None, metavar="TIME", help="one-way latency per message (0.1ms)")
    emu.add_argument("--overhead", default=None, metavar="TIME",
                     help="fixed software cost per collective or push+pull for the model (e.g. 2ms; default 0)")
    emu.add_argument("--no-cpu-term", action="store_true",
                     help="leave the CPU out of the model: the reduction time (measured on this host otherwise) "
                          "and, on an emulated cluster, the machine's measured rate of moving bytes between hosts")
    emu.add_argument("--no-calibrate", action="store_true",
                     help="on an emulated cluster, model the nominal --link rate instead of measuring the links' "
                          "TCP goodput and the machine's transfer rate once at the start")
    out = p.add_argument_group("output")
    add_output_options(out)
    out.add_argument("--plot", metavar="FILE", help="draw the results into a PNG (needs matplotlib)")
    out.add_argument("--repeat", type=int, default=1, metavar="R",
                     help="run everything R times (each on a fresh emulated cluster) and report each row's median")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sub-commands of ``hora bench`` and their flags, added to ``parser``."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")

    def child(name: str, help_text: str, handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.set_defaults(bench_handler=handler, subparser=p)
        return p

    p = child("plan", "predict ring-allreduce vs parameter-server times for a cluster (cost model only)", _plan)
    p.add_argument("--workers", "-n", type=int, required=True, help="workers W")
    p.add_argument("--servers", "-s", type=int, default=None, help="servers k of interest (default: W)")
    p.add_argument("--link", required=True, metavar="RATE", help="link rate, tc units: 1gbit, 10gbit, 25gbit")
    p.add_argument("--latency", default="0", metavar="TIME", help="one-way latency per message, e.g. 5us")
    p.add_argument("--model-mb", type=float, default=100.0, help="gradient MiB exchanged per step")
    p.add_argument("--compute-ms", type=float, default=None, help="compute time per step, for scaling efficiency")
    p.add_argument("--overlap", type=float, default=0.0, help="fraction of the exchange hidden behind compute")
    p.add_argument("--colocated", action="store_true", help="servers on the workers' hosts (MXNet launch.py)")
    p.add_argument("--reduce-gbps", type=float, default=None,
                   help="GB/s a host sums buffers at (default: leave the CPU out)")
    p.add_argument("--compression", default="none", metavar="SPEC",
                   help="also price a compressed ring: fp16, bf16, fp16+ef, powersgd:RANK")
    p.add_argument("--gradients", default=None, metavar="MODEL",
                   help="a real model's parameter shapes and size: resnet50, vgg16, mlp (overrides --model-mb)")
    p.add_argument("--compress-gflops", type=float, default=None,
                   help="GFLOP/s of the compressor's arithmetic (default: leave it out)")
    add_output_options(p)

    p = child("allreduce", "hora allreduce over sizes x backends: time, algbw, busbw, cost model", _allreduce)
    p.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB,64MiB", help="message sizes (KiB, MiB, GiB)")
    p.add_argument("--backends", type=_names, default=["gloo", "mpi"], help="gloo and/or mpi")
    p.add_argument("-np", "--num-proc", type=_ints, default=[2], help="rank counts, e.g. 2,4,8")
    p.add_argument("--iters", type=int, default=10, help="timed allreduces per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed allreduces per size")
    add_run_options(p)

    p = child("train", "synthetic training img/s at N ranks and scaling efficiency", _train)
    p.add_argument("-np", "--num-proc", type=_ints, default=[1, 2], help="rank counts, e.g. 1,2,4")
    p.add_argument("--strategy", type=_names, default=["allreduce"], help="allreduce and/or ps")
    p.add_argument("--servers", "-s", type=int, default=None, help="servers for --strategy ps (default: N)")
    p.add_argument("--backend", choices=("gloo", "mpi"), default="gloo", help="hora controller")
    p.add_argument("--model", default="resnet18", help="resnet18, resnet50 or mlp")
    p.add_argument("--compression", default="none", metavar="SPEC",
                   help="allreduce compressor: none, fp16, bf16, fp16+ef, powersgd:RANK")
    p.add_argument("--batch-size", type=int, default=32, help="batch per rank")
    p.add_argument("--image-size", type=int, default=32, help="side of the synthetic images")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps")
    p.add_argument("--steps", type=int, default=5, help="steps per timed iteration")
    p.add_argument("--iters", type=int, default=3, help="timed iterations")
    add_run_options(p)

    p = child("kvstore", "push+pull through parameter servers (S = 1, 2, 4...) vs allreduce", _kvstore)
    p.add_argument("--workers", "-n", type=_ints, default=[2],
                   help="workers W, or several counts (2,4,8) to see the time against W")
    p.add_argument("--servers", "-s", type=_ints, default=[1, 2], help="server counts, e.g. 1,2,4,8")
    p.add_argument("--sizes", default="4MiB,64MiB", help="key sizes (float32)")
    p.add_argument("--no-allreduce", action="store_true", help="skip dist_sync_allreduce")
    p.add_argument("--backend", choices=("gloo", "mpi"), default="gloo", help="hora controller of the workers")
    p.add_argument("--iters", type=int, default=10, help="timed push+pull iterations per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per size")
    add_run_options(p)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to an ``add_subparsers()`` object; its handler is ``args.handler(args, args.subparser)``."""
    p = subparsers.add_parser("bench", help=HELP, description=HELP, allow_abbrev=False)
    add_arguments(p)
    p.set_defaults(handler=run_command, subparser=p)
    return p


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hora bench ...``: run the chosen benchmark; exit status 0, 1 (it failed) or 2 (bad flags)."""
    handler = getattr(args, "bench_handler", None)
    if handler is None:
        parser.print_usage(sys.stderr)
        print("hora bench: error: choose a benchmark: plan, allreduce, train or kvstore", file=sys.stderr)
        return 2
    try:
        return handler(args)
    except ConfigError as e:
        parser.error(str(e))  # usage + message, exit 2
    except HoraError as e:
        print(f"hora bench {args.bench_command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hora bench {args.bench_command}: interrupted", file=sys.stderr)
        return 130
    return 0  # unreachable: parser.error exits


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hora.bench.cli ...``: the same as ``hora bench ...``."""
    parser = argparse.ArgumentParser(prog="hora bench", description=HELP, allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_command(args, getattr(args, "subparser", parser))


# --------------------------------------------------------------------------- handlers


def _plan(args: argparse.Namespace) -> int:
    from hora.bench import plan
    from hora.bench.model import CostModel
    from hora.bench.report import write_json
    from hora.bench.units import MiB, parse_duration, parse_rate

    config = plan.PlanConfig(workers=args.workers, servers=args.servers, payload_bytes=int(args.model_mb * MiB),
                             compute_s=None if args.compute_ms is None else args.compute_ms / 1e3,
                             overlap=args.overlap, colocated=args.colocated, compression=args.compression,
                             gradients=args.gradients,
                             compress_flops=math.inf if args.compress_gflops is None else args.compress_gflops * 1e9)
    if args.reduce_gbps is not None and args.reduce_gbps <= 0:
        raise ConfigError(f"--reduce-gbps {args.reduce_gbps} must be > 0")
    model = CostModel(bandwidth_bps=parse_rate(args.link), latency_s=parse_duration(args.latency),
                      reduce_bytes_per_s=float("inf") if args.reduce_gbps is None else args.reduce_gbps * 1e9)
    result = plan.predict(config, model)
    text = plan.render(config, model, result)
    if args.json is not None:
        from hora.bench.options import model_doc

        write_json({"benchmark": "plan", "config": dataclasses.asdict(config), "model": model_doc(model), **result},
                   args.json)
    print(text, file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


#: Per measuring benchmark: the measured time of a row, and the fields that name a row.
_ROW_TIME = {"allreduce": "time_s", "kvstore": "time_s", "train": "step_s"}
_ROW_KEY = {"allreduce": ("backend", "np", "bytes"), "kvstore": ("system", "workers", "servers", "bytes"),
            "train": ("strategy", "np", "servers")}


def _measure(args: argparse.Namespace, name: str, config: Any, module: Any, plot: Callable[..., None]) -> int:
    """Shared tail of the measuring benchmarks: model, run (``--repeat`` times), table, JSON, plot.

    Each repeat starts (and on an emulated cluster calibrates) its own
    cluster; a row is the repeat with the median time, its prediction from
    that repeat's own calibration.
    """
    from hora.bench.options import RunOptions, calibrated, cost_model, model_doc
    from hora.bench.report import machine, median_rows, table_stream, write_json

    if args.repeat < 1:
        raise ConfigError(f"--repeat {args.repeat} must be >= 1")
    options = RunOptions.from_args(args)
    base = cost_model(args.link, args.latency, options, cpu_term=not args.no_cpu_term, overhead=args.overhead)
    skipped: list[str] = []
    load = {"before": idle_load()}
    runs, models, calibrations = [], [], []
    for _ in range(args.repeat):
        skipped.clear()
        with options.placement() as placement:
            model = calibrated(base, placement.calibration, cpu_term=not args.no_cpu_term)
            if name == "kvstore":
                runs.append(module.run(config, options, model, skipped, placement=placement))
            else:
                runs.append(module.run(config, options, model, placement=placement))
        models.append(model)
        calibrations.append(placement.calibration)
    load["after"] = idle_load()
    rows = median_rows(runs, _ROW_TIME[name], _ROW_KEY[name])
    if name == "kvstore":
        module.add_comparisons(rows)
    elif name == "train":
        module.add_efficiency(rows)
    title = f"hora bench {name} ({options.where})"
    stream = table_stream(args.json)
    model = models[0]
    print(f"\n{title}; cost model: {model.bandwidth_bps / 1e9:.3g} Gbit/s links, {model.latency_s * 1e6:.3g} µs "
          f"latency, CPU sums {model.reduce_bytes_per_s / 1e9:.3g} GB/s, overhead "
          f"{model.overhead_s * 1e6:g} µs per operation", file=stream)
    for i, calibration in enumerate(calibrations):
        if calibration is not None:
            run = f"run {i + 1}: " if len(calibrations) > 1 else ""
            print(f"calibrated on the emulated cluster, {run}{calibration.describe()}", file=stream)
    if any(calibrations):
        print("the model's link is the goodput" + ("" if args.no_cpu_term else "; no operation beats the bytes over "
              "all links / the machine's rate (bound: cpu)"), file=stream)
    if args.repeat > 1:
        print(f"each row: the median of {args.repeat} runs, each on a fresh cluster with its own calibration",
              file=stream)
    if None not in load.values():
        print(f"other load on this machine while no job ran: {100 * load['before']:.0f}% of its cores just before, "
              f"{100 * load['after']:.0f}% just after", file=stream)
    print(file=stream)
    print(module.table(rows) if rows else "(no rows)", file=stream)
    for line in skipped:
        print(f"\n{line}", file=stream)
    stream.flush()
    if args.json is not None:
        write_json({"benchmark": name, "where": options.where, "machine": machine(),
                    "config": dataclasses.asdict(config), "model": model_doc(model),
                    "models": [model_doc(m) for m in models],
                    "calibrations": [dataclasses.asdict(c) if c else None for c in calibrations],
                    "rows": rows, "runs": runs, "skipped": skipped, "idle_load": load}, args.json)
    if args.plot and rows:
        plot(rows, args.plot, title)
    return 0


def idle_load(seconds: float = 1.0) -> float | None:
    """The share of this machine's cores busy over ``seconds`` while the benchmark runs nothing: others' load."""
    import time

    from hora.bench.workers import host_cpu

    before = host_cpu()
    time.sleep(seconds)
    after = host_cpu()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _allreduce(args: argparse.Namespace) -> int:
    from hora.bench import allreduce
    from hora.bench.report import plot_allreduce
    from hora.bench.units import parse_sizes

    config = allreduce.AllreduceConfig(sizes=parse_sizes(args.sizes, multiple_of=4), backends=args.backends,
                                       num_procs=args.num_proc, iters=args.iters, warmup=args.warmup)
    return _measure(args, "allreduce", config, allreduce, plot_allreduce)


def _train(args: argparse.Namespace) -> int:
    from hora.bench import train
    from hora.bench.report import plot_train

    config = train.TrainConfig(num_procs=args.num_proc, strategies=args.strategy, servers=args.servers,
                               backend=args.backend, model=args.model, batch_size=args.batch_size,
                               image_size=args.image_size, warmup=args.warmup, steps=args.steps, iters=args.iters,
                               compression=args.compression)
    return _measure(args, "train", config, train, plot_train)


def _kvstore(args: argparse.Namespace) -> int:
    from hora.bench import kvstore
    from hora.bench.report import plot_kvstore
    from hora.bench.units import parse_sizes

    config = kvstore.KVStoreConfig(sizes=parse_sizes(args.sizes, multiple_of=4), workers=args.workers,
                                   servers=args.servers, allreduce=not args.no_allreduce, backend=args.backend,
                                   iters=args.iters, warmup=args.warmup)
    return _measure(args, "kvstore", config, kvstore, plot_kvstore)


if __name__ == "__main__":
    sys.exit(main())
