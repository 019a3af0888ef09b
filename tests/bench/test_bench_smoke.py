"""Real ``hora bench`` runs on 2 local ranks, the plots, and the MXNet peer when its venv exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hora.bench import report

ROOT = Path(__file__).resolve().parents[2]
MXNET_VENV = Path(os.environ.get("HORA_MXNET_VENV", Path.home() / ".cache" / "hora" / "mxnet-venv"))
MXNET_PYTHON = MXNET_VENV / "bin" / "python"


def bench_command() -> list[str]:
    """``hora bench`` as the console script runs it."""
    return [sys.executable, "-m", "hora.cli", "bench"]


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "OMPI_", "PMIX_", "DMLC_"))}
    out["PYTHONPATH"] = str(ROOT)
    return out


def test_allreduce_smoke_json_on_two_ranks(tmp_path):
    plot = tmp_path / "ar.png"
    proc = subprocess.run([*bench_command(), "allreduce", "--sizes", "4KiB,64KiB", "--iters", "3", "--json",
                           "--plot", str(plot), "--no-progress"],
                          capture_output=True, text=True, timeout=240, env=env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["benchmark"] == "allreduce" and doc["where"] == "localhost"
    rows = doc["rows"]
    assert sorted((r["backend"], r["bytes"]) for r in rows) == [("gloo", 4096), ("gloo", 65536), ("mpi", 4096),
                                                                 ("mpi", 65536)]
    for r in rows:
        assert r["np"] == 2 and 0 < r["min_s"] <= r["time_s"] < 10
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_s"])
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (2 - 1) / 2)
        assert r["predicted_s"] > 0 and r["ratio"] == pytest.approx(r["time_s"] / r["predicted_s"])
    assert "| backend" in proc.stderr and "measured/model" in proc.stderr  # the table, on stderr beside --json
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_kvstore_runs_or_says_why_not(tmp_path):
    out = tmp_path / "kv.json"
    proc = subprocess.run([*bench_command(), "kvstore", "--workers", "2", "--servers", "1", "--sizes", "4KiB",
                           "--iters", "2", "--warmup", "1", "--json", str(out), "--no-progress", "--timeout", "120"],
                          capture_output=True, text=True, timeout=300, env=env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    ran = {(r["kvstore"], r["servers"]) for r in doc["rows"]}
    skipped = " ".join(doc["skipped"])
    for kvstore, servers in (("dist_sync", 1), ("dist_sync_allreduce", 0)):
        assert (kvstore, servers) in ran or f"skipping hora {kvstore}" in skipped
    assert all("is not importable" in s or "does not start servers" in s for s in doc["skipped"])
    for r in doc["rows"]:
        assert r["workers"] == 2 and r["time_s"] > 0 and r["predicted_s"] > 0


def test_plots_from_rows(tmp_path):
    pytest.importorskip("matplotlib")
    train_rows = [{"strategy": "allreduce", "np": n, "img_s": 100.0 * n * 0.9, "predicted_img_s": 95.0 * n,
                   "efficiency": 0.9, "predicted_efficiency": 0.95} for n in (1, 2, 4)]
    kv_rows = [{"system": "hora dist_sync", "servers": k, "bytes": 4 << 20, "time_s": 0.1 / k, "predicted_s": 0.09 / k}
               for k in (1, 2)] + [{"system": "hora dist_sync_allreduce", "servers": 0, "bytes": 4 << 20,
                                    "time_s": 0.04}]
    report.plot_train(train_rows, str(tmp_path / "t.png"), "train")
    report.plot_kvstore(kv_rows, str(tmp_path / "k.png"), "kvstore")
    for name in ("t.png", "k.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.skipif(not MXNET_PYTHON.exists(), reason="MXNet peer venv missing: bash benchmarks/mxnet_peer/setup.sh")
def test_mxnet_peer_runs_dist_sync(tmp_path):
    out = tmp_path / "mx.json"
    proc = subprocess.run([str(MXNET_PYTHON), str(ROOT / "benchmarks" / "mxnet_peer" / "kvstore_bench.py"),
                           "--workers", "2", "--servers", "2", "--sizes", "4KiB,4MiB", "--iters", "2", "--warmup", "1",
                           "--timeout", "120", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, env=env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mxnet"] == "1.9.1" and doc["workers"] == 2 and doc["servers"] == 2
    assert [r["bytes"] for r in doc["rows"]] == [4096, 4 << 20]
    assert all(len(r["times_s"]) == 2 and r["median_s"] > 0 for r in doc["rows"])
