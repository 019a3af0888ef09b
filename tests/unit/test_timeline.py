"""The timeline writer on its own: the format, a full queue, the size cap, signals, and reading a cut-off file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hora.core import timeline as tlmod
from hora.core.negotiation import HEADER, NameCache, Ready, Signature
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.timeline import Bucket, Timeline, load, rank_path

ROOT = Path(__file__).resolve().parents[2]


def sig(kind=CollectiveType.ALLREDUCE, shape=(4,), dtype="float32"):
    return Signature(kind, ((dtype, tuple(shape), ()),), ReduceOp.SUM, -1, 1.0, 1.0, 0, "cpu")


def events_of(path):
    with open(path) as f:
        return json.load(f)  # strict: the file must be complete JSON


def test_rank_path_and_display_name():
    assert rank_path("/x/tl.json", 0) == "/x/tl.json"
    assert rank_path("/x/tl.json", 3) == "/x/tl.rank3.json"
    assert tlmod.display_name(CollectiveType.ALLREDUCE, "w") == "allreduce.w"
    assert tlmod.display_name(CollectiveType.ALLREDUCE, "allreduce.noname.1") == "allreduce.noname.1"


def test_one_collective_gives_horovods_spans(tmp_path):
    """A name seen in two rounds: negotiation with an instant per rank, then the op with its activities."""
    path = tmp_path / "tl.json"
    tl = Timeline(path, rank=0, mark_cycles=True, flush_interval_s=0.01)
    cache = NameCache(16)
    s = sig()
    ready = Ready("w", 0, [s, s])
    cache.remember("w", 0, [s.encode(), s.encode()], ready)
    pending = {"w": SimpleNamespace(kind=CollectiveType.ALLREDUCE, submitted_at=time.monotonic())}
    members = {0: (0, 1)}
    t = time.monotonic()
    tl.cycle(t)
    # round 1: only rank 0 marked it; round 2: both did
    tl.observe_round(t + 0.001, pending, cache, np.array([0, 0, 0, 1]), HEADER, None, members, [])
    tl.observe_round(t + 0.002, pending, cache, np.array([0, 0, 0, 2]), HEADER, None, members, [ready])
    tl.buckets([Bucket("mpi", True, ["w"], t + 0.003, t + 0.004, t + 0.005, t + 0.006)])
    tl.close()
    ev = events_of(path)
    assert ev[0]["args"]["start_time_since_epoch_in_micros"] > 0
    assert {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.w"}} in ev
    spans = [(e["ph"], e.get("name")) for e in ev if e.get("pid") == 1 and e["ph"] != "M"]
    assert spans == [
        ("B", "NEGOTIATE_ALLREDUCE"), ("X", "0"), ("X", "1"), ("E", None),
        ("B", "ALLREDUCE"), ("B", "QUEUE"), ("E", None), ("B", "MEMCPY_IN_FUSION_BUFFER"), ("E", None),
        ("B", "MPI_ALLREDUCE"), ("E", None), ("B", "MEMCPY_OUT_FUSION_BUFFER"), ("E", None), ("E", None),
    ]
    closing = [e for e in ev if e.get("pid") == 1][-1]
    assert closing["args"] == {"dtype": "float32", "shape": "[4]"}
    assert any(e.get("name") == "CYCLE_START" and e["ph"] == "i" for e in ev)


def one_round(tl, names, t, ready=True):
    """Every name of this rank's found ready on both ranks in the round at ``t`` (the steady state)."""
    cache = NameCache(16)
    s = sig()
    for name in names:
        cache.remember(name, 0, [s.encode(), s.encode()], Ready(name, 0, [s, s]))
    pending = {n: SimpleNamespace(kind=CollectiveType.ALLREDUCE, submitted_at=t - 0.004) for n in names}
    totals = np.array([0, 0, 0] + [2] * len(names))
    tl.observe_round(t, pending, cache, totals, HEADER, None, {0: (0, 1)},
                     [cache.by_name[n].ready for n in names] if ready else [])


def test_a_collective_ready_everywhere_in_one_round_gives_the_same_spans(tmp_path):
    """A round that finds every tensor ready at once (one record) gives the spans of the rank-by-rank path."""
    path = tmp_path / "tl.json"
    tl = Timeline(path, rank=0, flush_interval_s=0.01)
    t = time.monotonic()
    one_round(tl, ["w", "v"], t)
    tl.buckets([Bucket("gloo", True, ["w", "v"], t + 0.001, t + 0.002, t + 0.003, t + 0.004)])
    tl.close()
    ev = events_of(path)
    for pid in (1, 2):
        mine = [e for e in ev if e.get("pid") == pid and e["ph"] != "M"]
        assert [(e["ph"], e.get("name")) for e in mine] == [
            ("B", "NEGOTIATE_ALLREDUCE"), ("X", "0"), ("X", "1"), ("E", None),
            ("B", "ALLREDUCE"), ("B", "QUEUE"), ("E", None), ("B", "MEMCPY_IN_FUSION_BUFFER"), ("E", None),
            ("B", "GLOO_ALLREDUCE"), ("E", None), ("B", "MEMCPY_OUT_FUSION_BUFFER"), ("E", None), ("E", None),
        ]
        negotiate, mine_ready, other_ready = mine[0]["ts"], mine[1]["ts"], mine[2]["ts"]
        assert negotiate == mine_ready < other_ready == mine[3]["ts"] == mine[4]["ts"]  # submitted, then the round
        assert [e["ts"] for e in mine] == sorted(e["ts"] for e in mine)
        assert mine[-1]["args"] == {"dtype": "float32", "shape": "[4]"}


class SteadyJob:
    """Rounds of a training step as the engine records them: five allreduces, ready everywhere in one round,
    reduced in a fused bucket of three and two buckets in place.  The Ready objects live on, as in the
    engine's name cache."""

    NAMES = ["w1", "w2", "w3", "big1", "big2"]
    BUCKETS = [(["w1", "w2", "w3"], True), (["big1"], False), (["big2"], False)]

    def __init__(self):
        self.cache = NameCache(16)
        for i, name in enumerate(self.NAMES):
            s = sig(shape=(i + 1, 3))
            self.cache.remember(name, 0, [s.encode(), s.encode()], Ready(name, 0, [s, s]))

    def record(self, path, starts, batched):
        """One recording, one step at each of ``starts``; returns its events and its zero.

        ``batched``: a round's buckets come as one record, as the executor hands them over, rather than
        one by one; in both cases the writer writes once in the middle of the second round.
        """
        tl = Timeline(path, rank=0, flush_interval_s=3600)
        for k, t in enumerate(starts):
            pending = {n: SimpleNamespace(kind=CollectiveType.ALLREDUCE, submitted_at=t + 1e-4 * i)
                       for i, n in enumerate(self.NAMES)}
            tl.observe_round(t + 0.001, pending, self.cache, np.array([0, 0, 0] + [2] * len(self.NAMES)), HEADER,
                             None, {0: (0, 1)}, [self.cache.by_name[n].ready for n in self.NAMES])
            done = []
            for j, (names, fused) in enumerate(self.BUCKETS):
                b = t + 0.001 + 0.002 * (j + 1)
                done.append(Bucket("mpi", fused, names, b, b + 3e-4, b + 6e-4, b + 9e-4))
                if not batched or j == 0:
                    tl.buckets(done)
                    done = []
                if k == 1 and j == 0:
                    tl._write_queued()  # a write in the middle of a round
            if done:
                tl.buckets(done)
        tl.close()
        return events_of(path), tl._t0


@pytest.mark.parametrize("batched", [False, True], ids=["bucket-by-bucket", "round-at-once"])
def test_every_step_of_a_steady_job_gives_each_tensor_its_spans_at_the_engines_times(tmp_path, batched):
    """Each step: per tensor, its negotiation from its submission to the round, then its bucket's activities
    at the times the executor reported, and the closing dtype and shape."""
    job = SteadyJob()
    starts = [1.0 + 0.01 * k for k in range(4)]
    events, t0 = job.record(tmp_path / "tl.json", starts, batched)

    def us(t):
        return int((t - t0) * 1e6)

    pids = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
            and e["pid"]}
    for i, name in enumerate(job.NAMES):
        j = next(j for j, (names, _) in enumerate(job.BUCKETS) if name in names)
        fused = job.BUCKETS[j][1]
        expected = []
        for t in starts:
            submitted, at, b = us(t + 1e-4 * i), us(t + 0.001), t + 0.001 + 0.002 * (j + 1)
            t0_, t1, t2, t3 = us(b), us(b + 3e-4), us(b + 6e-4), us(b + 9e-4)
            expected += [("B", "NEGOTIATE_ALLREDUCE", submitted), ("X", "0", submitted), ("X", "1", at),
                         ("E", None, at), ("B", "ALLREDUCE", at), ("B", "QUEUE", at), ("E", None, t0_)]
            if fused:
                expected += [("B", "MEMCPY_IN_FUSION_BUFFER", t0_), ("E", None, t1)]
            expected += [("B", "MPI_ALLREDUCE", t1), ("E", None, t2)]
            if fused:
                expected += [("B", "MEMCPY_OUT_FUSION_BUFFER", t2), ("E", None, t3)]
            expected.append(("E", None, t3))
        mine = [e for e in events if e.get("pid") == pids[f"allreduce.{name}"] and e["ph"] != "M"]
        assert [(e["ph"], e.get("name"), e["ts"]) for e in mine] == expected, name
        assert [e["args"] for e in mine if "args" in e] == [{"dtype": "float32", "shape": f"[{i + 1}, 3]"}] * 4


def test_recordings_share_one_writer_thread_and_write_through_a_symlink(tmp_path):
    """Starting and stopping a timeline starts no thread; a symlinked path keeps its link."""
    target = tmp_path / "real.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    Timeline(tmp_path / "warm.json", rank=0).close()
    threads = threading.active_count()
    for _ in range(20):
        tl = Timeline(link, rank=0, flush_interval_s=0.001)
        one_round(tl, ["w"], time.monotonic())
        tl.close()
        assert threading.active_count() == threads
    assert link.is_symlink()
    assert [e["name"] for e in events_of(target) if e.get("ph") == "B"] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]


@pytest.mark.timeout(60)
def test_a_write_that_fails_stops_only_its_own_recording(tmp_path, caplog):
    """The shared writer thread goes on serving the other recordings; the failed one says why and closes at once."""
    broken = Timeline(tmp_path / "broken.json", rank=0, flush_interval_s=0.01)
    healthy = Timeline(tmp_path / "healthy.json", rank=0, flush_interval_s=0.01)

    def full_disk(lines):
        raise OSError(28, "No space left on device")

    broken._append = full_disk
    t = time.monotonic()
    one_round(broken, ["w"], t)
    one_round(healthy, ["w"], t)
    deadline = time.monotonic() + 30
    while broken.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not broken.active
    assert f"writing {broken.path} failed (OSError" in caplog.text and "the recording stops here" in caplog.text
    one_round(healthy, ["v"], time.monotonic() + 0.01)
    time.sleep(0.1)  # the writer thread's next writes
    broken.close()
    healthy.close()
    names = [e["name"] for e in events_of(tmp_path / "healthy.json") if e.get("ph") == "B"]
    assert names.count("NEGOTIATE_ALLREDUCE") == 2
    assert events_of(tmp_path / "broken.json")[0]["ph"] == "M"  # what it wrote before still loads


def test_a_negotiation_whose_collective_never_ran_is_written_at_close(tmp_path):
    """A one-round negotiation waits for its bucket to be written; closing the file writes it anyway."""
    path = tmp_path / "tl.json"
    tl = Timeline(path, rank=0, flush_interval_s=0.01)
    one_round(tl, ["w"], time.monotonic())
    time.sleep(0.05)  # the writer has seen it
    tl.close()
    mine = [(e["ph"], e.get("name")) for e in events_of(path) if e.get("pid") == 1 and e["ph"] != "M"]
    assert mine == [("B", "NEGOTIATE_ALLREDUCE"), ("X", "0"), ("X", "1"), ("E", None), ("B", "ALLREDUCE"),
                    ("E", None)]


def test_a_name_announced_with_another_kind_is_labelled_anew_in_a_later_recording(tmp_path):
    """Labels outlive a recording (a timeline started at run time reuses them), but follow the name's kind."""
    for kind, path in ((CollectiveType.ALLREDUCE, tmp_path / "a.json"),
                       (CollectiveType.ALLGATHER, tmp_path / "b.json")):
        tl = Timeline(path, rank=0, flush_interval_s=0.01)
        s = sig(kind)
        ready = Ready("x", 0, [s, s])
        pending = {"x": SimpleNamespace(kind=kind, submitted_at=time.monotonic())}
        announced = [{"x": s.encode()}, {"x": s.encode()}]
        tl.observe_round(time.monotonic(), pending, NameCache(16), np.array([0, 0, 0]), HEADER, announced,
                         {0: (0, 1)}, [ready])
        tl.close()
        ev = events_of(path)
        assert {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"{kind.label}.x"}} in ev
        assert [e["name"] for e in ev if e.get("pid") == 1 and e["ph"] == "B"] == [f"NEGOTIATE_{kind.name}",
                                                                                    kind.name]


def test_readiness_that_the_counts_cannot_attribute_is_named_by_count(tmp_path):
    """Four ranks, rank 0 not ready, two of three others ready: the count cannot say which two."""
    path = tmp_path / "tl.json"
    tl = Timeline(path, rank=0, flush_interval_s=0.01)
    cache = NameCache(16)
    s = sig()
    cache.remember("w", 0, [s.encode()] * 4, Ready("w", 0, [s] * 4))
    tl.observe_round(time.monotonic(), {}, cache, np.array([0, 0, 0, 2]), HEADER, None, {0: (0, 1, 2, 3)}, [])
    tl.close()
    assert [e["name"] for e in events_of(path) if e["ph"] == "X"] == ["ready 2/4"]


def test_a_full_queue_drops_records_and_never_blocks(tmp_path):
    path = tmp_path / "tl.json"
    tl = Timeline(path, rank=0, mark_cycles=True, queue_events=100, flush_interval_s=60)  # the writer sleeps
    start = time.perf_counter()
    for _ in range(100_000):
        tl.cycle(time.monotonic())
    elapsed = time.perf_counter() - start
    assert tl.dropped == 100_000 - 100
    assert elapsed < 2.0, f"recording 100k records with a full queue took {elapsed:.2f} s"
    tl.close()
    ev = events_of(path)
    assert sum(e.get("name") == "CYCLE_START" for e in ev) == 100
    assert [e["args"]["records"] for e in ev if e.get("name") == "TIMELINE_DROPPED"] == [99_900]


def fill(tl, batches=40, per_batch=200):
    for _ in range(batches):
        for _ in range(per_batch):
            tl.cycle(time.monotonic())
        time.sleep(0.01)


def test_size_cap_stops_and_says_so(tmp_path, caplog):
    path = tmp_path / "tl.json"
    stopped = []
    tl = Timeline(path, rank=0, max_bytes=20_000, flush_interval_s=0.005, on_stop=lambda: stopped.append(1))
    fill(tl)
    time.sleep(0.05)
    assert not tl.active and stopped == [1]
    tl.close()
    ev = events_of(path)
    assert ev[-1]["name"] == "TIMELINE_STOPPED" and "HORA_TIMELINE_MAX_MB" in ev[-1]["args"]["reason"]
    assert os.path.getsize(path) < 20_000 + 200 * 80  # at most one batch past the cap
    assert "recording stopped" in caplog.text


def test_size_cap_rotates_into_numbered_files(tmp_path, caplog):
    path = tmp_path / "tl.json"
    tl = Timeline(path, rank=0, max_bytes=20_000, rotate=True, flush_interval_s=0.005)
    fill(tl)
    tl.close()
    parts = sorted(tmp_path.glob("tl.*.json"))
    assert len(parts) >= 2 and tl.rotations == len(parts)
    for part in [*parts, path]:
        ev = events_of(part)
        assert ev[0]["name"] == "process_name"  # every part opens like a timeline
    assert "started a new file" in caplog.text


def test_load_reads_a_file_cut_off_by_sigkill(tmp_path):
    path = tmp_path / "tl.json"
    tl = Timeline(path, rank=0, mark_cycles=True, flush_interval_s=0.01)
    for _ in range(10):
        tl.cycle(time.monotonic())
    tl.close()
    text = path.read_text()
    cut = text[: text.rindex("}") - 5]  # the last event half written, no closing bracket
    path.write_text(cut)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)
    assert sum(e.get("name") == "CYCLE_START" for e in load(path)) == 9


SIGNAL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from hora.core.timeline import Timeline, watch_signals
    chained = sys.argv[2] == "chained"
    if chained:
        def mine(signum, frame):
            open(sys.argv[1] + ".handler", "w").write(str(signum))
            sys.exit(3)
        signal.signal(signal.SIGTERM, mine)
    tl = Timeline(sys.argv[1], rank=0, mark_cycles=True, flush_interval_s=60)
    watch_signals(tl)
    for _ in range(50):
        tl.cycle(time.monotonic())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    sys.exit(0)
""")


@pytest.mark.parametrize("mode", ["default", "chained"])
def test_sigterm_leaves_valid_json_and_reaches_the_previous_handler(tmp_path, mode):
    """The queue (50 records the sleeping writer never wrote) is drained, then the signal goes on:
    to the default action (the process dies of SIGTERM) or to the handler the program had."""
    path = tmp_path / "tl.json"
    proc = subprocess.run([sys.executable, "-c", SIGNAL_SCRIPT, str(path), mode], cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if mode == "default":
        assert proc.returncode == -signal.SIGTERM, proc.stderr
    else:
        assert proc.returncode == 3, proc.stderr
        assert Path(str(path) + ".handler").read_text() == str(int(signal.SIGTERM))
    assert sum(e.get("name") == "CYCLE_START" for e in events_of(path)) == 50


def test_unwritable_path_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    from hora.errors import ConfigError

    with pytest.raises(ConfigError, match="HORA_TIMELINE"):
        Timeline(blocker / "tl.json")


def test_the_timeline_and_the_autotuner_have_what_the_engine_calls(tmp_path):
    """The engine calls its hooks only through the protocols of hora.core.hooks: the implementations keep up."""
    import typing

    from hora.core import hooks
    from hora.core.autotune import Autotuner

    tl = Timeline(tmp_path / "tl.json")
    tl.close()
    for protocol, implementation in ((hooks.RoundRecorder, tl), (hooks.Tuner, Autotuner)):
        attributes = set(typing.get_type_hints(protocol))
        methods = {n for n in vars(protocol) if not n.startswith("_")} - attributes
        assert methods, protocol
        for name in methods:
            assert callable(getattr(implementation, name, None)), (implementation, name)
        for name in attributes:
            assert hasattr(implementation, name), (implementation, name)
