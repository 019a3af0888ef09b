"""``hora timeline FILE``: a summary of a recorded timeline, for those who would rather look than scroll.

It reads a timeline (hora's, or Horovod's: the format is the same) with the
lenient reader of :mod:`hora.core.timeline`, so a file cut off by a killed
job works too, and prints:

* the time spent per phase, in total and per step: ``negotiate``
  (``NEGOTIATE_*`` spans), ``queue`` (``QUEUE``), ``memcpy`` (in and out of the
  fusion buffer) and ``collective`` (the backend's own activity,
  ``MPI_ALLREDUCE``, ``GLOO_ALLREDUCE``...; any other activity counts as
  ``other``).  Times add up over tensors, which overlap, so a phase can take
  more time than the trace lasts;
* the same per tensor;
* the tensors that waited longest for the slowest rank: the longest
  negotiations, with the rank that was last most often when the trace names it.

A *step* is taken to be one collective of each tensor: the number of steps is
the median count of collectives per tensor, unless ``--steps`` says otherwise.
``--plot out.png`` draws the phases over time (matplotlib).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
from collections.abc import Iterable

from hora.core.timeline import MEMCPY_IN, MEMCPY_OUT, QUEUE, load
from hora.errors import ConfigError

HELP = "summarize a timeline file: time per phase and tensor, and who waited for the slowest rank"
PHASES = ("negotiate", "queue", "memcpy", "collective", "other")


@dataclasses.dataclass
class TensorStats:
    """What one tensor (a trace "process") spent its time on, in microseconds."""

    name: str
    ops: int = 0
    phases: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    negotiations: list[float] = dataclasses.field(default_factory=list)
    last_ranks: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass
class Summary:
    """A timeline digested: per-tensor statistics and every span by phase, for the plot."""

    tensors: dict[str, TensorStats]
    spans: dict[str, list[tuple[float, float]]]  # phase -> (start, end) in microseconds
    start_us: float
    end_us: float
    steps: int
    notes: list[str]

    def total(self, phase: str) -> float:
        return sum(t.phases[phase] for t in self.tensors.values())


def phase_of(span: str, depth: int) -> str | None:
    """The phase a span belongs to: ``depth`` is how many spans enclose it; None for a collective's own span."""
    if span.startswith("NEGOTIATE_"):
        return "negotiate"
    if depth == 0:
        return None
    if span == QUEUE:
        return "queue"
    if span in (MEMCPY_IN, MEMCPY_OUT):
        return "memcpy"
    if "_" in span and span.split("_", 1)[0] in ("MPI", "GLOO", "NCCL", "CCL", "DDL"):
        return "collective"
    return "other"


def summarize(events: Iterable[dict], steps: int | None = None) -> Summary:
    """Digest trace events into a :class:`Summary`.

    Spans are matched per tensor in time order (a stable sort keeps the
    file's order between events with the same timestamp); an ``E`` without its
    ``B`` (the start of a rotated file) is skipped, and spans still open at
    the end are counted as notes.
    """
    names: dict[int, str] = {}
    by_pid: dict[int, list[dict]] = collections.defaultdict(list)
    notes: list[str] = []
    t_min, t_max = float("inf"), float("-inf")
    for e in events:
        ph = e.get("ph")
        if ph == "M":
            if e.get("name") == "process_name" and "name" in e.get("args", {}):
                names[e["pid"]] = e["args"]["name"]
            continue
        if "ts" in e:
            t_min, t_max = min(t_min, e["ts"]), max(t_max, e["ts"])
        if ph == "i" and e.get("name") in ("TIMELINE_DROPPED", "TIMELINE_STOPPED"):
            notes.append(f"{e['name']}: {e.get('args', {})}")
        if "pid" in e and ph in ("B", "E", "X"):
            by_pid[e["pid"]].append(e)
    tensors: dict[str, TensorStats] = {}
    spans: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASES}
    unclosed = 0
    for pid, evs in by_pid.items():
        stats = tensors.setdefault(names.get(pid, f"pid {pid}"), TensorStats(names.get(pid, f"pid {pid}")))
        stack: list[tuple[str, float, list[str]]] = []
        for e in sorted(evs, key=lambda ev: ev["ts"]):
            if e["ph"] == "B":
                stack.append((e.get("name", "?"), e["ts"], []))
            elif e["ph"] == "X":
                if stack:
                    stack[-1][2].append(str(e.get("name")))
            elif stack:
                span, start, instants = stack.pop()
                phase = phase_of(span, len(stack))
                dur = e["ts"] - start
                if phase is None:
                    stats.ops += 1
                    continue
                stats.phases[phase] += dur
                spans[phase].append((start, e["ts"]))
                if phase == "negotiate":
                    stats.negotiations.append(dur)
                    if len(instants) > 1 and instants[-1].isdigit():
                        stats.last_ranks[int(instants[-1])] += 1
        unclosed += len(stack)
    if unclosed:
        notes.append(f"{unclosed} span(s) never closed (the recording ended inside them)")
    counts = [t.ops for t in tensors.values() if t.ops]
    if steps is None:
        steps = int(statistics.median(counts)) if counts else 0
    if t_min == float("inf"):
        t_min = t_max = 0.0
    return Summary(tensors, spans, t_min, t_max, steps, notes)


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def format_summary(summary: Summary, top: int = 20) -> str:
    """The tables ``hora timeline`` prints."""
    out: list[str] = []
    n_ops = sum(t.ops for t in summary.tensors.values())
    steps = max(summary.steps, 1)
    out.append(f"{len(summary.tensors)} tensors, {n_ops} collectives, {summary.steps} steps, "
               f"{(summary.end_us - summary.start_us) / 1e6:.3f} s traced")
    out.append("")
    out.append(f"{'phase':<12} {'total ms':>12} {'per step ms':>12}")
    for phase in PHASES:
        total = summary.total(phase)
        if phase == "other" and not total:
            continue
        out.append(f"{phase:<12} {_ms(total):>12} {_ms(total / steps):>12}")
    out.append("(times add up over tensors, which overlap)")
    out.append("")
    ranked = sorted(summary.tensors.values(), key=lambda t: -sum(t.phases.values()))
    width = max([len(t.name) for t in ranked[:top]] + [6])
    header = f"{'tensor':<{width}} {'ops':>5} " + " ".join(f"{p + ' ms':>13}" for p in PHASES[:4])
    out.append(f"per tensor (top {min(top, len(ranked))} of {len(ranked)} by time)")
    out.append(header)
    for t in ranked[:top]:
        out.append(f"{t.name:<{width}} {t.ops:>5} " + " ".join(f"{_ms(t.phases[p]):>13}" for p in PHASES[:4]))
    out.append("")
    waited = sorted((t for t in summary.tensors.values() if t.negotiations), key=lambda t: -sum(t.negotiations))
    out.append("waited longest for the slowest rank (negotiation: first rank ready -> last rank ready)")
    out.append(f"{'tensor':<{width}} {'total ms':>10} {'mean ms':>10} {'max ms':>10}  last rank (times)")
    for t in waited[: min(top, 10)]:
        last = ", ".join(f"{r} ({n})" for r, n in t.last_ranks.most_common(3)) or "-"
        out.append(f"{t.name:<{width}} {_ms(sum(t.negotiations)):>10} "
                   f"{_ms(sum(t.negotiations) / len(t.negotiations)):>10} {_ms(max(t.negotiations)):>10}  {last}")
    for note in summary.notes:
        out.append(f"note: {note}")
    return "\n".join(out)


def plot(summary: Summary, path: str) -> None:
    """Draw the phases over time (one row per phase, every span of every tensor) into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [p for p in PHASES if summary.spans[p]]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * max(len(rows), 1)))
    colors = {"negotiate": "tab:orange", "queue": "tab:gray", "memcpy": "tab:green", "collective": "tab:blue",
              "other": "tab:purple"}
    t0 = summary.start_us
    for i, phase in enumerate(rows):
        bars = [((s - t0) / 1000, max((e - s) / 1000, 1e-3)) for s, e in summary.spans[phase]]
        ax.broken_barh(bars, (i - 0.4, 0.8), color=colors[phase], alpha=0.6)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("time since the trace started (ms)")
    ax.set_title(f"timeline: {len(summary.tensors)} tensors, {summary.steps} steps")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``hora timeline``."""
    parser.add_argument("file", metavar="FILE", help="a timeline written by hora (or Horovod)")
    parser.add_argument("--steps", type=int, help="training steps the trace covers (default: the median "
                                                   "number of collectives per tensor)")
    parser.add_argument("--top", type=int, default=20, help="tensors to list (default 20)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the phases over time into this PNG file")


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hora timeline``: print the summary, and draw it with ``--plot``."""
    try:
        events = load(args.file)
    except (OSError, ConfigError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    summary = summarize(events, args.steps)
    print(f"timeline {args.file}:")
    print(format_summary(summary, args.top))
    if args.plot:
        plot(summary, args.plot)
        print(f"phases over time drawn in {args.plot}")
    return 0
