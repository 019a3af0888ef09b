"""Autotune in a real job: it finds the clearly best setting, every rank switches with it, the log has its columns."""

from __future__ import annotations

import csv
import sys

import pytest

from hora.core.autotune import COLUMNS

MiB = 1024 * 1024


# gloo only: there a call costs ~0.5 ms, so fusing 200 tiny tensors is clearly best.  Under MPI a call costs
# ~5 us, less than each request's Python, and on a quiet host fused and unfused steps score alike (measured
# 2026-11-25: 0.77 vs 0.78 MB/s), so "clearly best" would depend on the machine's load.
@pytest.mark.parametrize("controller", ["gloo"])
def test_autotune_picks_fusion_for_many_tiny_tensors(run_job, tmp_path, controller):
    log_file = tmp_path / "autotune.csv"
    proc = run_job(2, [sys.executable, "tests/scripts/autotune_job.py", "70"], mpi=controller == "mpi", timeout=240,
                   extra_args=["--autotune", "--autotune-log-file", str(log_file)],
                   env={"HORA_AUTOTUNE_SPACE": "fusion_mb=0,64;cycle_ms=0.5,5;direct_kb=1024;overlap=1",
                        "HORA_AUTOTUNE_STEPS_PER_SAMPLE": "5", "HORA_AUTOTUNE_MAX_SAMPLES": "4"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.reader(log_file.open()))
    assert rows[0] == COLUMNS
    chosen = rows[-1]
    assert chosen[0] == "chosen" and chosen[3] == "64", rows
    trials = rows[1:-1]
    assert {r[3] for r in trials if r[1] == "trial"} == {"0", "64"}
    fused = [float(r[-1]) for r in trials if r[3] == "64"]
    unfused = [float(r[-1]) for r in trials if r[3] == "0"]
    assert sum(fused) / len(fused) > 1.2 * sum(unfused) / len(unfused), rows  # clearly best
    assert f"settings everywhere: fusion={64 * MiB}" in proc.stdout
    assert "autotune: settled after" in proc.stderr and "--fusion-threshold-mb 64" in proc.stderr
