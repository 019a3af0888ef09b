"""Stateful compression across processes: a checkpoint taken mid-training resumes identically in fresh processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import COMPRESSION_CHECKPOINT, checkpoint_resumes

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CASES = [(2, "gloo", "powersgd:2"), (2, "mpi", "powersgd:2"), (3, "gloo", "fp16+ef"), (3, "mpi", "powersgd:1")]


@pytest.mark.parametrize(("np", "controller", "spec"), CASES, ids=[f"{c}-np{n}-{s}" for n, c, s in CASES])
def test_checkpoint_resumes_identically_in_a_fresh_process(run_job, tmp_path, np, controller, spec):
    for mode in ("full", "resume"):
        proc = run_job(np, [sys.executable, str(COMPRESSION_CHECKPOINT), "--framework", "torch", "--mode", mode,
                            "--dir", str(tmp_path), "--compression", spec], mpi=controller == "mpi", timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoint_resumes(tmp_path, np)
    # The checkpoint holds the compressor's state (so the test above depends on it).
    saved = torch.load(tmp_path / "ckpt.0.pt")["optimizer"]["hora_compression"]
    assert saved["step"] == 3 and saved["tensors"]


def test_powersgd_rank2_accuracy_within_one_point_of_uncompressed():
    """The digits MLP 64-1024-1024-10 on 2 ranks, the same steps with and without PowerSGD rank 2 (torch)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compression_accuracy.py"
    proc = subprocess.run([sys.executable, str(script), "--frameworks", "torch"], capture_output=True, text=True,
                          timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    acc = {r["compression"]: r["accuracy"] for r in rows}
    assert acc["none"] > 0.95, acc
    assert abs(acc["none"] - acc["powersgd:2"]) <= 0.01, acc
