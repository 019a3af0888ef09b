"""hora's parameter server against MXNet 1.9.1's own, and against allreduce, in one run.

The load of issue 3's benchmark: W workers push+pull one float32 key per
size (4 MiB and 64 MiB by default) through

* MXNet 1.9.1 ``dist_sync`` with S = 1, 2 servers, run by
  ``benchmarks/mxnet_peer/kvstore_bench.py`` in its own venv (made by
  ``benchmarks/mxnet_peer/setup.sh`` when missing; ``--no-mxnet`` skips it),
* hora ``dist_sync`` with the same W and S (``hora run -np W -s S``),
* hora ``dist_sync_allreduce`` (no servers),

and prints one markdown table: the median push+pull time per iteration of
the slowest worker, the cost model's time, hora over MXNet, each row over
allreduce and over its own single-server time.

``--optimizers sgd,sgd+momentum,adam,adagrad,lamb`` instead times one
dist_sync job per server optimizer (issue 30: the servers' update of each push
is part of the push+pull), ``--repeat`` interleaved rounds, each over the
first optimizer's time; MXNet's own ``dist_sync`` with the same optimizer set
by ``kv.set_optimizer`` runs before each hora job (``--no-mxnet`` skips it),
and a second table gives hora over MXNet per optimizer.  A last table times
each optimizer's update of a key of each size alone, in this process: its
CPU time over all threads (which load from other processes barely moves) and
its wall time.  Where every role shares the host's cores, a step's extra time
over the first optimizer follows the extra CPU time divided among the cores.

``--sparse`` instead runs the row_sparse embedding benchmark of issue 30
(:mod:`benchmarks.kvstore_sparse`: 1,000,000 x 64 float32, 10,000 rows
pushed and ``row_sparse_pull``-ed per step, MXNet and hora jobs alternating).

``--transports shm,tcp,curve`` instead compares hora's own transports in one
run (issue 19): shared memory (the default on one host), the socket
(``HORA_PS_SHM=0``, handshake-authenticated, HMAC per message) and the
socket with CURVE encryption (``HORA_PS_SHM=0 HORA_PS_ENCRYPT=1``), each
``--repeat`` times, interleaved, so that load drifts hit every transport
alike.  hora rows that this checkout
cannot run yet (no ``hora.kvstore.dist``, or ``hora run`` without ``-s``) are
skipped with the reason.  All roles share this host's cores, so the machine
should be quiet::

    python benchmarks/kvstore.py
    python benchmarks/kvstore.py --workers 2 --servers 1,2 --sizes 4MiB,16MiB,64MiB --iters 10 --json kv.json
    python benchmarks/kvstore.py --transports shm,tcp,curve --servers 1 --sizes 64MiB --iters 30 --repeat 3
    python benchmarks/kvstore.py --optimizers sgd,sgd+momentum,adam,adagrad,lamb --servers 1 --sizes 64MiB --repeat 3
    python benchmarks/kvstore.py --sparse --servers 1 --repeat 3 --iters 20 --mxnet-venv /work/main/.venv-mxnet
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hora.bench import kvstore as hkv  # noqa: E402
from hora.bench.options import RunOptions, cost_model, model_doc, ratio  # noqa: E402
from hora.bench.report import machine, markdown_table, write_json  # noqa: E402
from hora.bench.units import fmt_bytes, fmt_ratio, fmt_seconds, parse_sizes  # noqa: E402
from hora.errors import HoraError  # noqa: E402

PEER_DIR = REPO / "benchmarks" / "mxnet_peer"
DEFAULT_VENV = Path.home() / ".cache" / "hora" / "mxnet-venv"
MXNET = "mxnet 1.9.1 dist_sync"
#: hora's parameter-server transports, as the environment of every role.
TRANSPORTS = {"shm": {}, "tcp": {"HORA_PS_SHM": "0"}, "curve": {"HORA_PS_SHM": "0", "HORA_PS_ENCRYPT": "1"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", "-n", type=int, default=2, help="workers W (MXNet and hora)")
    p.add_argument("--servers", "-s", default="1,2", help="server counts S, comma-separated")
    p.add_argument("--sizes", default="4MiB,64MiB", help="key sizes (float32)")
    p.add_argument("--iters", type=int, default=10, help="timed push+pull iterations per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per size")
    p.add_argument("--backend", choices=("gloo", "mpi"), default="gloo", help="hora controller of the workers")
    p.add_argument("--no-mxnet", action="store_true", help="skip the MXNet peer")
    p.add_argument("--no-allreduce", action="store_true", help="skip hora's dist_sync_allreduce row")
    p.add_argument("--transports", default="", help=f"compare hora's transports instead ({', '.join(TRANSPORTS)})")
    p.add_argument("--optimizers", default="", help="compare server optimizers instead (the first is the baseline)")
    p.add_argument("--repeat", type=int, default=1,
                   help="with --transports/--optimizers/--sparse: interleaved runs of each")
    p.add_argument("--sparse", action="store_true", help="the row_sparse embedding benchmark instead")
    p.add_argument("--mxnet-venv", type=Path, default=Path(os.environ.get("HORA_MXNET_VENV", DEFAULT_VENV)),
                   help="venv of the MXNet peer (created by setup.sh when missing)")
    p.add_argument("--link", default="auto", help="link rate for the cost model ('auto': loopback measured)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--json", type=Path, default=None, help="also write every row to this file")
    args = p.parse_args(argv)
    try:
        args.size_list = parse_sizes(args.sizes, multiple_of=4)
        args.server_list = [int(s) for s in args.servers.split(",") if s.strip()]
    except (HoraError, ValueError) as e:
        p.error(str(e))
    args.transport_list = [t.strip() for t in args.transports.split(",") if t.strip()]
    args.optimizer_list = [t.strip().lower() for t in args.optimizers.split(",") if t.strip()]
    from hora.kvstore.optimizer import OPTIMIZERS

    bad = [o for o in args.optimizer_list if o.removesuffix("+momentum") not in OPTIMIZERS]
    if bad:
        p.error(f"unknown server optimizers {bad} (choose from {', '.join(OPTIMIZERS)}, or sgd+momentum)")
    unknown = [t for t in args.transport_list if t not in TRANSPORTS]
    if unknown or args.repeat < 1:
        p.error(f"unknown transports {unknown} (choose from {', '.join(TRANSPORTS)}) or --repeat {args.repeat} < 1")
    if args.workers < 1 or not args.server_list or min(args.server_list) < 1:
        p.error(f"need --workers >= 1 and server counts >= 1, got {args.workers} and {args.servers}")
    return args


def mxnet_python(venv: Path) -> Path:
    """The venv's python, after running the (idempotent) setup script.

    Raises:
        RuntimeError: the setup script failed; its output is in the message.
    """
    proc = subprocess.run(["bash", str(PEER_DIR / "setup.sh"), str(venv)], capture_output=True, text=True,
                          timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks/mxnet_peer/setup.sh failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def mxnet_rows(python: Path, args: argparse.Namespace, servers: int, model: Any,
               optimizer: str = "") -> tuple[list[dict], dict]:
    """Run the MXNet peer with ``servers`` servers (and ``optimizer`` on them); its rows and its raw result."""
    cmd = [str(python), str(PEER_DIR / "kvstore_bench.py"), "--workers", str(args.workers), "--servers",
           str(servers), "--sizes", ",".join(map(str, args.size_list)), "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--timeout", str(args.timeout),
           *(["--optimizer", optimizer] if optimizer else [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "DMLC_", "OMPI_", "PMIX_"))}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 60, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"MXNet peer failed ({proc.returncode}):\n{proc.stderr[-3000:]}{proc.stdout[-1000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = []
    for r in result["rows"]:
        predicted = hkv.predict(model, "dist_sync", r["bytes"], args.workers, servers)
        rows.append({"system": MXNET, "kvstore": "dist_sync", "workers": args.workers, "servers": servers,
                     "bytes": r["bytes"], "time_s": r["median_s"], "min_s": r["min_s"], "predicted_s": predicted,
                     "ratio": ratio(r["median_s"], predicted)})
    return rows, result


def comparison_table(rows: list[dict[str, Any]]) -> str:
    """One line per (size, servers): MXNet, hora dist_sync, hora/MXNet, hora allreduce, the model."""
    allreduce = {r["bytes"]: r["time_s"] for r in rows if r["kvstore"] == "dist_sync_allreduce"}
    keys = sorted({(r["bytes"], r["servers"]) for r in rows if r["servers"]})
    body = []
    for nbytes, servers in keys:
        def t(system: str, nbytes: int = nbytes, servers: int = servers) -> float | None:
            found = [r["time_s"] for r in rows if r["system"] == system and r["bytes"] == nbytes
                     and r["servers"] == servers]
            return found[0] if found else None

        mx, hora = t(MXNET), t("hora dist_sync")
        model = next(r["predicted_s"] for r in rows if r["bytes"] == nbytes and r["servers"] == servers)
        body.append([fmt_bytes(nbytes), str(servers), fmt_seconds(mx), fmt_seconds(hora), fmt_ratio(ratio(hora, mx)),
                     fmt_seconds(allreduce.get(nbytes)), fmt_ratio(ratio(mx, allreduce.get(nbytes))),
                     fmt_ratio(ratio(hora, allreduce.get(nbytes))), fmt_seconds(model)])
    headers = ["size", "servers", "MXNet dist_sync", "hora dist_sync", "hora / MXNet", "hora allreduce",
               "MXNet / allreduce", "hora / allreduce", "model (PS)"]
    return markdown_table(headers, body)


def transport_rows(args: argparse.Namespace, options: RunOptions, model: Any) -> list[dict[str, Any]]:
    """hora ``dist_sync`` over each of ``args.transport_list``, ``args.repeat`` interleaved rounds; one row per
    (round, transport, servers, size), tagged with ``transport`` and ``round``."""
    config = hkv.KVStoreConfig(sizes=args.size_list, workers=args.workers, servers=args.server_list,
                               allreduce=False, backend=args.backend, iters=args.iters, warmup=args.warmup)
    rows: list[dict[str, Any]] = []
    for round_ in range(args.repeat):
        for name in args.transport_list:
            print(f"hora dist_sync over {name} (round {round_ + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
            saved = {k: os.environ.get(k) for k in ("HORA_PS_SHM", "HORA_PS_ENCRYPT")}
            os.environ.update(TRANSPORTS[name])  # every role of the job inherits it
            try:
                for row in hkv.run(config, options, model):
                    rows.append({**row, "transport": name, "round": round_})
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
    return rows


def optimizer_rows(args: argparse.Namespace, options: RunOptions, model: Any,
                   python: Path | None = None) -> list[dict[str, Any]]:
    """hora ``dist_sync`` with each of ``args.optimizer_list`` on the servers, ``args.repeat`` interleaved rounds;
    one row per (round, optimizer, servers, size), tagged ``transport`` (the optimizer) and ``round``.  With
    ``python`` (the MXNet venv's), MXNet's own ``dist_sync`` with the same optimizer runs just before each
    hora job, tagged ``system``."""
    rows: list[dict[str, Any]] = []
    for round_ in range(args.repeat):
        for name in args.optimizer_list:
            if python is not None:
                for servers in args.server_list:
                    print(f"MXNet dist_sync with {name} on the servers (round {round_ + 1}/{args.repeat}) ...",
                          file=sys.stderr, flush=True)
                    mx, _ = mxnet_rows(python, args, servers, model, optimizer=name)
                    rows += [{**row, "transport": name, "round": round_} for row in mx]
            print(f"hora dist_sync with {name} on the servers (round {round_ + 1}/{args.repeat}) ...", file=sys.stderr,
                  flush=True)
            config = hkv.KVStoreConfig(sizes=args.size_list, workers=args.workers, servers=args.server_list,
                                       allreduce=False, backend=args.backend, iters=args.iters, warmup=args.warmup,
                                       optimizer=name)
            rows += [{**row, "transport": name, "round": round_} for row in hkv.run(config, options, model)]
    return rows


def transport_table(rows: list[dict[str, Any]], label: str = "transport") -> str:
    """Per (size, servers): each transport's (or optimizer's) median over rounds, its spread, and over the first."""
    names = list(dict.fromkeys(r["transport"] for r in rows))
    body = []
    for nbytes, servers in sorted({(r["bytes"], r["servers"]) for r in rows}):
        times = {n: sorted(r["time_s"] for r in rows if r["transport"] == n and r["bytes"] == nbytes
                           and r["servers"] == servers) for n in names}
        median = {n: t[len(t) // 2] for n, t in times.items()}
        for n in names:
            spread = ", ".join(fmt_seconds(x) for x in times[n])
            body.append([fmt_bytes(nbytes), str(servers), n, fmt_seconds(median[n]), spread,
                         fmt_ratio(ratio(median[n], median[names[0]]))])
    return markdown_table(["size", "servers", label, "push+pull (median)", "each round", f"over {names[0]}"], body)


def update_table(args: argparse.Namespace) -> str:
    """Each of ``args.optimizer_list`` updating one float32 key of each size in this process, as a server's
    updater does (after one untimed update): median CPU time (all threads) and wall time over ``args.iters``
    updates, and the CPU time over the first optimizer's."""
    import time

    import numpy as np

    from hora.kvstore.optimizer import create, create_updater

    out = []
    for nbytes in args.size_list:
        rng = np.random.default_rng(0)
        grad = rng.standard_normal(nbytes // 4, dtype=np.float32)
        first = None
        for name in args.optimizer_list:
            base, momentum = name.removesuffix("+momentum"), name.endswith("+momentum")
            updater = create_updater(create(base, **({"momentum": 0.9} if momentum else {})))
            weight = rng.standard_normal(grad.size, dtype=np.float32)
            updater("k", grad, weight)
            cpu, wall = [], []
            for _ in range(args.iters):
                c, t = time.process_time(), time.perf_counter()
                updater("k", grad, weight)
                cpu.append(time.process_time() - c)
                wall.append(time.perf_counter() - t)
            c_med, w_med = float(np.median(cpu)), float(np.median(wall))
            first = c_med if first is None else first
            out.append([fmt_bytes(nbytes), name, fmt_seconds(c_med), fmt_seconds(w_med), fmt_ratio(c_med / first)])
    return markdown_table(["size", "server optimizer", "update CPU (median)", "update wall (median)",
                           "CPU over first"], out)


def optimizer_table(rows: list[dict[str, Any]]) -> str:
    """Per (size, servers, optimizer): MXNet's and hora's medians over rounds, hora over MXNet, and each over
    its own first optimizer's time."""
    names = list(dict.fromkeys(r["transport"] for r in rows))
    body = []
    for nbytes, servers in sorted({(r["bytes"], r["servers"]) for r in rows}):
        def median(system: str, name: str, nbytes: int = nbytes, servers: int = servers) -> float | None:
            t = sorted(r["time_s"] for r in rows if (r["system"] == MXNET) == (system == MXNET)
                       and r["transport"] == name and r["bytes"] == nbytes and r["servers"] == servers)
            return t[len(t) // 2] if t else None

        for n in names:
            mx, hora = median(MXNET, n), median("hora", n)
            body.append([fmt_bytes(nbytes), str(servers), n, fmt_seconds(mx), fmt_seconds(hora),
                         fmt_ratio(ratio(hora, mx)), fmt_ratio(ratio(mx, median(MXNET, names[0]))),
                         fmt_ratio(ratio(hora, median("hora", names[0])))])
    return markdown_table(["size", "servers", "server optimizer", "MXNet dist_sync", "hora dist_sync",
                           "hora / MXNet", f"MXNet over its {names[0]}", f"hora over its {names[0]}"], body)


def main(argv: list[str] | None = None) -> int:
    """Run MXNet, then hora; print the tables; write JSON."""
    args = parse_args(argv)
    if args.sparse:
        import kvstore_sparse

        python = None if args.no_mxnet else str(mxnet_python(args.mxnet_venv))
        return kvstore_sparse.main(["--workers", str(args.workers), "--servers", str(args.server_list[0]),
                                    "--repeat", str(args.repeat), "--iters", str(args.iters), "--timeout",
                                    str(args.timeout), *(["--mxnet-python", python] if python else []),
                                    *(["--json", str(args.json)] if args.json else [])])
    options = RunOptions(timeout_s=args.timeout)
    model = cost_model(args.link, None, options)
    if args.optimizer_list:
        python = None if args.no_mxnet else mxnet_python(args.mxnet_venv)
        rows = optimizer_rows(args, options, model, python)
        print(f"\n{args.workers} workers on localhost, {args.repeat} interleaved round(s)\n")
        print(transport_table([r for r in rows if r["system"] != MXNET], "server optimizer"))
        if python is not None:
            print()
            print(optimizer_table(rows))
        print(f"\nEach optimizer's update alone, in this process ({os.cpu_count()} cores)\n")
        print(update_table(args))
        if args.json is not None:
            write_json({"benchmark": "kvstore-optimizers", "machine": machine(), "model": model_doc(model),
                        "rows": rows}, str(args.json))
        return 0
    if args.transport_list:
        rows = transport_rows(args, options, model)
        print(f"\n{args.workers} workers on localhost, {args.repeat} interleaved round(s)\n")
        print(transport_table(rows))
        if args.json is not None:
            write_json({"benchmark": "kvstore-transports", "machine": machine(), "model": model_doc(model),
                        "rows": rows}, str(args.json))
        return 0
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    raw_mxnet = []
    if not args.no_mxnet:
        python = mxnet_python(args.mxnet_venv)
        for servers in args.server_list:
            print(f"MXNet dist_sync: {args.workers} workers, {servers} servers ...", file=sys.stderr, flush=True)
            mx, raw = mxnet_rows(python, args, servers, model)
            rows += mx
            raw_mxnet.append(raw)
    config = hkv.KVStoreConfig(sizes=args.size_list, workers=args.workers, servers=args.server_list,
                               allreduce=not args.no_allreduce, backend=args.backend, iters=args.iters,
                               warmup=args.warmup)
    rows += hkv.run(config, options, model, skipped)
    hkv.add_comparisons(rows)
    print(f"\n{args.workers} workers on localhost; cost model: {model.bandwidth_bps / 1e9:.3g} Gbit/s loopback, "
          f"{model.latency_s * 1e6:.3g} µs latency, CPU sums {model.reduce_bytes_per_s / 1e9:.3g} GB/s\n")
    print(comparison_table(rows))
    print()
    print(hkv.table(rows))
    for raw in raw_mxnet:
        rss = ", ".join(f"{x:.0f}" for x in raw["server_peak_rss_mib"] if x is not None)
        print(f"\nMXNet {raw['servers']} server(s): peak RSS {rss} MiB each", end="")
    seen: set[int] = set()
    for row in rows:  # one hora job per server count carries every size: report each job once
        if row.get("kvstore") == "dist_sync" and row["servers"] not in seen and row.get("server_peak_rss_mib"):
            seen.add(row["servers"])
            rss = ", ".join(f"{x:.0f}" for x in row["server_peak_rss_mib"])
            stored = ", ".join(f"{x:.0f}" for x in row["server_stored_mib"])
            print(f"\nhora {row['servers']} server(s): peak RSS {rss} MiB each, holding {stored} MiB", end="")
    print()
    for line in skipped:
        print(f"\n{line}")
    if args.json is not None:
        write_json({"benchmark": "kvstore-vs-mxnet", "machine": machine(), "model": model_doc(model), "rows": rows,
                    "mxnet": raw_mxnet, "skipped": skipped}, str(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
