"""Stateful compression under elastic training on TensorFlow and Keras: a reset from 3 ranks to 2 keeps compressing.

tests/scripts/compression_elastic.py runs on ``localhost:2,127.0.0.1:1``; the
rank started third raises before step 4, so the survivors restore their last
commit and re-form the ring as 2 ranks (elastic is gloo only).  After the
sync, both survivors hold rank 0's step and PowerSGD factors and residuals of
zero; they finish every step with the compressor and identical weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
pytest.importorskip("torch")  # elastic runs on gloo
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = ROOT / "tests" / "scripts" / "compression_elastic.py"
FLAVOURS = {
    "tf": ("tf", {}),
    "keras3-tf": ("keras3", {"KERAS_BACKEND": "tensorflow"}),
    "keras3-torch": ("keras3", {"KERAS_BACKEND": "torch"}),
    "tfkeras": ("tfkeras", {"TF_USE_LEGACY_KERAS": "1"}),
}


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_powersgd_keeps_training_after_a_reset_from_three_ranks_to_two(run_job, tmp_path: Path, flavour):
    framework, env = FLAVOURS[flavour]
    log = tmp_path / "log.jsonl"
    hosts = ["--min-np", "2", "--max-np", "3", "-H", "localhost:2,127.0.0.1:1"]
    proc = run_job(3, [sys.executable, str(SCRIPT), "--framework", framework, "--logfile", str(log), "--steps", "8",
                       "--fail-at", "4"], extra_args=hosts, timeout=540, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    first = [r for r in rows if r["event"] == "start" and r["size"] == 3]
    again = [r for r in rows if r["event"] == "start" and r["size"] == 2]
    end = [r for r in rows if r["event"] == "end"]
    assert len(first) == 3 and len(again) == 2 and len(end) == 2, rows
    # Restored to the last commit (4 steps done), then synced: rank 0's step and factors, no residuals.
    assert {(r["step"], r["compressor_step"]) for r in again} == {(4, 4)}, again
    assert all(r["residual"] == 0 for r in again), again
    assert len({r["q"] for r in again}) == 1, again
    # Both survivors compressed every remaining step and agree on the weights.
    assert {(r["size"], r["step"], r["compressor_step"]) for r in end} == {(2, 8, 8)}, end
    assert len({r["weights"] for r in end}) == 1, end
