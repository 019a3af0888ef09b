"""Timelines of real jobs under `hora run`: the spans per tensor, start/stop at run time, SIGTERM, every rank."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from tests.conftest import ROOT, job_env

SCRIPT = "tests/scripts/timeline_job.py"


def spans_by_tensor(events):
    """tensor name -> the names of the spans (B events) and instants (X) recorded for it."""
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
             and "name" in e.get("args", {})}
    seen = defaultdict(list)
    for e in events:
        if e["ph"] in "BX" and e.get("pid") in names:
            seen[names[e["pid"]]].append(e["name"])
    return seen


def closing_args(events, tensor):
    pid = next(e["pid"] for e in events if e["ph"] == "M" and e.get("args", {}).get("name") == tensor)
    return [e["args"] for e in events if e.get("pid") == pid and e["ph"] == "E" and "args" in e]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_named_collectives_give_their_spans(run_job, tmp_path, controller):
    path = tmp_path / "tl.json"
    proc = run_job(2, [sys.executable, SCRIPT, "spans", str(tmp_path)], mpi=controller == "mpi", timeout=180,
                   extra_args=["--timeline-filename", str(path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = json.loads(path.read_text())
    assert not (tmp_path / "tl.rank1.json").exists()  # rank 0 only by default
    seen = spans_by_tensor(events)
    backend = controller.upper()
    for k in range(3):
        spans = seen[f"allreduce.grad.{k}"]
        assert spans.count("NEGOTIATE_ALLREDUCE") == 3 and spans.count("ALLREDUCE") == 3, spans
        assert spans.count("0") == 3 and spans.count("1") == 3  # an instant per rank and step
        for activity in ("QUEUE", "MEMCPY_IN_FUSION_BUFFER", f"{backend}_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"):
            assert spans.count(activity) == 3, (activity, spans)
    big = seen["allreduce.grad.big"]
    assert big.count(f"{backend}_ALLREDUCE") == 3 and "MEMCPY_IN_FUSION_BUFFER" not in big  # reduced in place
    assert seen["allgather.gathered"].count(f"{backend}_ALLGATHER") == 3
    assert seen["allgather.gathered"].count("NEGOTIATE_ALLGATHER") == 3
    assert seen["broadcast.weights"].count(f"{backend}_BCAST") == 3
    assert closing_args(events, "allreduce.grad.big") == [{"dtype": "float32", "shape": "[300000]"}] * 3
    assert closing_args(events, "allgather.gathered") == [{"dtype": "float32", "shape": "[2, 2]"}] * 3
    for pid in {e["pid"] for e in events if "pid" in e}:  # every B has its E
        phases = [e["ph"] for e in events if e.get("pid") == pid]
        assert phases.count("B") == phases.count("E"), pid
    assert not any(e.get("name") == "CYCLE_START" for e in events)


def test_start_and_stop_at_run_time_write_several_files(run_job, tmp_path):
    proc = run_job(2, [sys.executable, SCRIPT, "startstop", str(tmp_path)], timeout=180,
                   env={"HORA_TIMELINE_ALL_RANKS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for n in (1, 2, 3):
        for name in (f"run{n}.json", f"run{n}.rank1.json"):
            events = json.loads((tmp_path / name).read_text())
            seen = spans_by_tensor(events)
            assert seen["allreduce.grad.0"].count("ALLREDUCE") == 1, (name, seen)  # the stopped steps are absent
            assert any(e.get("name") == "CYCLE_START" for e in events) == (n == 2), name


def test_sigterm_mid_job_leaves_valid_json(run_job, tmp_path):
    path = tmp_path / "tl.json"
    proc = run_job(2, [sys.executable, SCRIPT, "sigterm", str(tmp_path)], timeout=180,
                   env={"HOROVOD_TIMELINE": str(path), "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    assert proc.returncode != 0
    events = json.loads(path.read_text())  # strict JSON
    seen = spans_by_tensor(events)
    assert seen["allreduce.grad.0"].count("ALLREDUCE") >= 5, seen
    assert any(e.get("name") == "CYCLE_START" for e in events)


def test_interrupting_hora_run_leaves_valid_json(tmp_path):
    """Ctrl-C on the launcher: it forwards the signal, the workers close the file and exit."""
    path = tmp_path / "tl.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hora.runner.cli", "run", "-np", "2", "--gloo", "--timeline-filename", str(path),
         sys.executable, SCRIPT, "forever", str(tmp_path)],
        env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-3000:]
    events = json.loads(path.read_text())  # strict JSON
    assert spans_by_tensor(events)["allreduce.grad.0"].count("ALLREDUCE") >= 5
