"""What ``hora bench`` shows: tables, the JSON document, progress bars and PNG plots.

Tables are GitHub-flavoured markdown, so a run pastes straight into
``docs/benchmarks.md``.  Plots use matplotlib's non-interactive Agg backend
and are imported only when ``--plot`` is given; progress bars use tqdm on
stderr and vanish when stderr is not a terminal.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from hora.errors import ConfigError


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table, padded so it also reads well in a terminal; numeric columns right-aligned."""
    def numeric(col: int) -> bool:
        return bool(rows) and all(str(r[col])[:1] in "0123456789-—." for r in rows)

    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = [numeric(i) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right,
                                                                                        strict=True)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if ra else (":" + "-" * (w + 1)) for w, ra in zip(widths, right,
                                                                                                 strict=True)) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def machine() -> dict[str, Any]:
    """Where the benchmark ran: date, host, CPU, cores, Python."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                cpu = text.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "hostname": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version()}


def write_json(doc: dict[str, Any], target: str) -> None:
    """Write ``doc`` to ``target`` (a path, or ``-`` for stdout)."""
    text = json.dumps(doc, indent=2, default=str)
    if target == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        Path(target).write_text(text + "\n")


def table_stream(json_target: str | None) -> TextIO:
    """Where the table goes: stderr when the JSON document takes stdout, else stdout."""
    return sys.stderr if json_target == "-" else sys.stdout


def median_rows(runs: Sequence[Sequence[dict[str, Any]]], time_key: str, key_fields: Sequence[str]
                ) -> list[dict[str, Any]]:
    """One row per row name: the run whose ``time_key`` is the median (the lower of the two middle ones).

    Rows are named by ``key_fields``; the chosen row keeps its own other
    fields (its prediction included) and gains ``runs_s``, every run's time
    in run order.  With one run the rows come back unchanged (plus ``runs_s``).
    """
    by_name: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for rows in runs:
        for row in rows:
            by_name.setdefault(tuple(row.get(f) for f in key_fields), []).append(row)
    merged = []
    for same in by_name.values():
        ordered = sorted(same, key=lambda r: r[time_key])
        chosen = dict(ordered[(len(ordered) - 1) // 2])
        chosen["runs_s"] = [r[time_key] for r in same]
        merged.append(chosen)
    return merged


def fmt_runs(row: dict[str, Any]) -> str:
    """``0.29–0.33 s`` over the runs of a row; ``—`` with one run."""
    runs = row.get("runs_s") or []
    if len(runs) < 2:
        return "—"
    return f"{min(runs):.3g}–{max(runs):.3g} s"


def with_runs(headers: Sequence[str], body: Sequence[Sequence[str]], rows: Sequence[dict[str, Any]]
              ) -> tuple[list[str], list[list[str]]]:
    """Headers and body with a ``runs (min–max)`` column added when some row has several runs."""
    if not any(len(r.get("runs_s") or []) > 1 for r in rows):
        return list(headers), [list(b) for b in body]
    return [*headers, "runs (min–max)"], [[*b, fmt_runs(r)] for b, r in zip(body, rows, strict=True)]


class Progress:
    """A tqdm bar on stderr (silent when stderr is not a terminal, or tqdm is missing)."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, disable=None, leave=False,
                             dynamic_ncols=True)

    def update(self, n: int = 1, status: str | None = None) -> None:
        """Advance by ``n`` units; ``status`` replaces the text after the bar."""
        if self._bar is not None:
            if status is not None:
                self._bar.set_postfix_str(status, refresh=False)
            self._bar.update(n)

    def write(self, text: str) -> None:
        """A message above the bar (to stderr)."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install 'hora[bench]' (or pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wrap(title: str, width: int = 60) -> str:
    """A long plot title broken into lines, so it fits a narrow figure."""
    import textwrap

    return "\n".join(textwrap.wrap(title, width)) or title


def _series(rows: Sequence[dict[str, Any]], key: Any) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def _save(plt: Any, fig: Any, path: str) -> None:
    """Lay out, write and release a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_allreduce(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Bus bandwidth against message size, one line per backend and N; dashed: the cost model.

    With one size and several rank counts, time against N instead (the
    ring's flat line).
    """
    if len({r["bytes"] for r in rows}) == 1 and len({r["np"] for r in rows}) > 1:
        _plot_allreduce_ranks(rows, path, title)
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (backend, n), rs in sorted(_series(rows, lambda r: (r["backend"], r["np"])).items()):
        rs = sorted(rs, key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in rs], [r["busbw"] / 1e9 for r in rs], marker="o", label=f"{backend}, {n} ranks")
    for n, rs in sorted(_series(rows, lambda r: r["np"]).items()):  # the model does not depend on the backend
        by_size = {r["bytes"]: r["predicted_s"] for r in rs if r.get("predicted_s")}
        if by_size and n > 1:
            xs = sorted(by_size)
            ax.plot(xs, [x / by_size[x] * 2 * (n - 1) / n / 1e9 for x in xs], linestyle="--", color="grey",
                    alpha=0.7, label=f"model, {n} ranks")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(_wrap(title), fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend()
    _save(plt, fig, path)


def _plot_allreduce_ranks(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Allreduce time against the number of ranks for one size, one line per backend; dashed: the model."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for backend, rs in sorted(_series(rows, lambda r: r["backend"]).items()):
        rs = sorted(rs, key=lambda r: r["np"])
        ns = [r["np"] for r in rs]
        line, = ax.plot(ns, [r["time_s"] * 1e3 for r in rs], marker="o", label=f"hora {backend} ring")
        ax.plot(ns, [r["predicted_s"] * 1e3 for r in rs], linestyle="--", color=line.get_color(), alpha=0.6,
                label="cost model")
    ax.set_xticks(sorted({r["np"] for r in rows}))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("ranks N (one emulated host each)")
    ax.set_ylabel("allreduce time (ms)")
    ax.set_title(_wrap(f"{title}, {rows[0]['bytes'] / (1 << 20):g} MiB"), fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend()
    _save(plt, fig, path)


def plot_train(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Images/s and scaling efficiency against N, one line per strategy; dashed: the cost model.

    The efficiency panel shows, per strategy, the efficiency against one rank
    (solid), the measured share of a step spent computing, ``C / step``
    (dotted, when the rows have it), and the model's ``C / (C + T_comm)``
    (dashed): the last two compare the exchange alone, while the first also
    carries whatever makes ``C`` grow with ``N`` (ranks sharing cores).
    """
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    for strategy, rs in sorted(_series(rows, lambda r: r["strategy"]).items()):
        rs = sorted(rs, key=lambda r: r["np"])
        ns = [r["np"] for r in rs]
        line, = ax1.plot(ns, [r["img_s"] for r in rs], marker="o", label=strategy)
        ax1.plot(ns, [r["predicted_img_s"] for r in rs], linestyle="--", color=line.get_color(), alpha=0.6)
        ax2.plot(ns, [100 * r["efficiency"] for r in rs], marker="o", color=line.get_color(),
                 label=f"{strategy}: vs 1 rank")
        if all("compute_s" in r and r.get("step_s") for r in rs):
            ax2.plot(ns, [100 * r["compute_s"] / r["step_s"] for r in rs], marker="x", linestyle=":",
                     color=line.get_color(), label=f"{strategy}: compute/step")
        ax2.plot(ns, [100 * r["predicted_efficiency"] for r in rs], linestyle="--", color=line.get_color(),
                 alpha=0.6, label=f"{strategy}: model C/(C+T)")
    ideal = sorted({r["np"] for r in rows})
    ax2.plot(ideal, [100] * len(ideal), color="grey", linewidth=0.8)
    for ax in (ax1, ax2):
        ax.set_xticks(ideal)
    ax1.set_xlabel("ranks")
    ax1.set_ylabel("images/s (all ranks)")
    ax2.set_xlabel("ranks")
    ax2.set_ylabel("scaling efficiency (%)")
    ax2.set_ylim(0, 110)
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize="x-small")
    fig.suptitle(_wrap(f"{title}; dashed: cost model", 90), fontsize="medium")
    _save(plt, fig, path)


def plot_kvstore(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Push+pull time against the number of servers, one panel per size; allreduce and MXNet as lines.

    With several worker counts, against the number of workers instead
    (:func:`plot_kvstore_workers`).
    """
    if len({r.get("workers") for r in rows}) > 1:
        plot_kvstore_workers(rows, path, title)
        return
    plt = _pyplot()
    sizes = sorted({r["bytes"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 4), squeeze=False)
    for ax, nbytes in zip(axes[0], sizes, strict=True):
        rs = [r for r in rows if r["bytes"] == nbytes]
        for system, srs in sorted(_series(rs, lambda r: r["system"]).items()):
            srs = sorted(srs, key=lambda r: r.get("servers") or 0)
            if len(srs) == 1 and not srs[0].get("servers"):
                ax.axhline(srs[0]["time_s"] * 1e3, linestyle=":", label=system, color="black")
                continue
            ax.plot([r["servers"] for r in srs], [r["time_s"] * 1e3 for r in srs], marker="o", label=system)
        model = {r["servers"]: r["predicted_s"] for r in rs if r.get("servers") and r.get("predicted_s")}
        if model:  # the same prediction for every PS system
            ks = sorted(model)
            ax.plot(ks, [model[k] * 1e3 for k in ks], linestyle="--", color="grey", label="cost model (PS)")
            ax.set_xticks(ks)
        ax.set_xlabel("servers")
        ax.set_ylabel("push+pull per iteration (ms)")
        ax.set_title(f"{nbytes / (1 << 20):g} MiB")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(_wrap(title), fontsize="medium")
    _save(plt, fig, path)


def plot_kvstore_workers(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Time per operation against the number of workers, one line per (system, servers) and size; dashed: model.

    The ring's bandwidth term stays flat in ``N`` while one server's grows
    linearly; this is the plot that shows it.
    """
    plt = _pyplot()
    sizes = sorted({r["bytes"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    for ax, nbytes in zip(axes[0], sizes, strict=True):
        rs = [r for r in rows if r["bytes"] == nbytes]
        for (system, servers), srs in sorted(_series(rs, lambda r: (r["system"], r["servers"] or 0)).items()):
            srs = sorted(srs, key=lambda r: r["workers"])
            label = f"{system}, {servers} server{'s' if servers > 1 else ''}" if servers else f"{system} (ring)"
            ns = [r["workers"] for r in srs]
            line, = ax.plot(ns, [r["time_s"] * 1e3 for r in srs], marker="o", label=label)
            if all(r.get("predicted_s") for r in srs):
                ax.plot(ns, [r["predicted_s"] * 1e3 for r in srs], linestyle="--", color=line.get_color(),
                        alpha=0.6)
        ns = sorted({r["workers"] for r in rs})
        ax.set_xticks(ns)
        ax.set_xlabel("workers N (one emulated host each)")
        ax.set_ylabel("time per push+pull or allreduce (ms)")
        ax.set_title(f"{nbytes / (1 << 20):g} MiB; dashed: cost model")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(_wrap(title), fontsize="medium")
    _save(plt, fig, path)
