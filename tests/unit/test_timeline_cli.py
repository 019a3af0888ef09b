"""``hora timeline``: the table and the picture from a recorded file, and the run flags that feed the workers."""

from __future__ import annotations

import json
import time

import numpy as np

from hora.cli import main
from hora.core.negotiation import HEADER, NameCache, Ready, Signature
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.timeline import Bucket, Timeline
from hora.runner import cli as runner_cli
from hora.timeline_cli import summarize


def record(path, steps=4, slow_rank=1):
    """A two-rank timeline of two allreduces per step, rank ``slow_rank`` ready 5 ms after rank 0."""
    tl = Timeline(path, rank=0, flush_interval_s=0.01)
    cache = NameCache(8)
    readies = {}
    for name, shape in (("a", (4,)), ("b", (1000,))):
        s = Signature(CollectiveType.ALLREDUCE, (("float32", shape, ()),), ReduceOp.SUM, -1, 1.0, 1.0, 0, "cpu")
        readies[name] = Ready(name, 0, [s, s])
        cache.remember(name, 0, [s.encode()] * 2, readies[name])
    members = {0: (0, 1)}
    t = time.monotonic()
    for _ in range(steps):
        pending = {n: type("R", (), {"kind": CollectiveType.ALLREDUCE, "submitted_at": t})() for n in readies}
        tl.observe_round(t + 0.001, pending, cache, np.array([0, 0, 0, 1, 1]), HEADER, None, members, [])
        tl.observe_round(t + 0.006, pending, cache, np.array([0, 0, 0, 2, 2]), HEADER, None, members,
                         list(readies.values()))
        tl.buckets([Bucket("gloo", True, ["a", "b"], t + 0.007, t + 0.008, t + 0.018, t + 0.019)])
        t += 0.02
    tl.close()


def test_summary_counts_phases_steps_and_the_slowest_rank(tmp_path):
    path = tmp_path / "tl.json"
    record(path)
    summary = summarize(json.loads(path.read_text()))
    assert summary.steps == 4 and set(summary.tensors) == {"allreduce.a", "allreduce.b"}
    a = summary.tensors["allreduce.a"]
    assert a.ops == 4
    assert abs(a.phases["negotiate"] - 4 * 6000) < 50  # submitted at t, ready everywhere at t + 6 ms
    assert abs(a.phases["memcpy"] - 4 * 2000) < 50 and abs(a.phases["collective"] - 4 * 10000) < 50
    assert abs(a.phases["queue"] - 4 * 1000) < 50
    assert a.last_ranks == {1: 4}


def test_hora_timeline_prints_the_tables_and_draws_a_png(tmp_path, capsys):
    path, png = tmp_path / "tl.json", tmp_path / "phases.png"
    record(path)
    assert main(["timeline", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "2 tensors, 8 collectives, 4 steps" in out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert lines["negotiate"] == ["48.000", "12.000"]  # total and per step, ms
    assert lines["collective"] == ["80.000", "20.000"]
    assert "waited longest for the slowest rank" in out and "1 (4)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_hora_timeline_reads_a_file_cut_off_by_a_kill(tmp_path, capsys):
    path = tmp_path / "tl.json"
    record(path, steps=3)
    text = path.read_text()
    path.write_text(text[: text.rindex("]")].rstrip().rstrip(","))  # no closing bracket
    assert main(["timeline", str(path)]) == 0
    assert "3 steps" in capsys.readouterr().out


def test_hora_timeline_names_a_file_that_is_no_timeline(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text("hello")
    assert main(["timeline", str(path)]) == 1
    assert "not a timeline" in capsys.readouterr().err


def test_run_flags_become_worker_variables(tmp_path):
    parser = runner_cli.build_parser()
    args = parser.parse_args(["run", "-np", "2", "--timeline-filename", "t.json", "--timeline-mark-cycles",
                              "--autotune", "--autotune-log-file", "at.csv", "python", "x.py"])
    config = runner_cli.config_from_args(args)
    assert config.env["HORA_TIMELINE_MARK_CYCLES"] == "1" and config.env["HORA_AUTOTUNE"] == "1"
    assert config.env["HORA_AUTOTUNE_LOG"].endswith("/at.csv")
