"""benchmarks/allreduce.py (the issue-2 comparison) runs end to end on 2 ranks, every peer included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_every_part_and_peer_with_a_paired_ratio(tmp_path, run_job):
    out = tmp_path / "bench.json"
    proc = run_job(2, [sys.executable, str(ROOT / "benchmarks" / "allreduce.py"), "--part", "sizes", "mlp",
                        "--sizes", "4K,2M", "--min-repeats", "2", "--max-repeats", "3", "--mlp-steps", "3",
                        "--mlp-repeats", "1", "--mlp-warmup", "1", "--mlp-paired-repeats", "2", "--json", str(out)],
                   mpi=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    sizes = {(r["engine"], r["bytes"]): r for r in data["results"]["sizes"]}
    assert set(sizes) == {(e, b) for e in ("mpi", "gloo", "hora-mpi", "hora-gloo") for b in (4096, 2 << 20)}, (
        data["notes"], proc.stdout[-3000:])
    for engine in ("hora-mpi", "hora-gloo"):
        assert "paired_ratio" not in sizes[(engine, 4096)]  # below --pair-from
        assert sizes[(engine, 2 << 20)]["paired_ratio"] > 0
    mlp = data["results"]["mlp"]
    engines = [r["engine"] for r in mlp if "paired_block" not in r]
    assert engines == ["1 process × 1 thread", "1 process × 2 threads", "ddp", "hora-mpi", "hora-gloo"]
    assert all(r["samples_per_s"] > 0 for r in mlp)
    for phase in ("hora-mpi", "hora-gloo"):
        paired = {r["engine"]: r for r in mlp if r.get("paired_block") == phase}
        assert set(paired) == {"1 process × 1 thread", "2 processes, no communication",
                               "raw MPI (mpi4py) allreduce loop", "ddp", phase}
        assert paired["ddp"]["vs_ddp_paired"] == 1.0 and paired[phase]["efficiency_paired"] > 0
    assert any(note.startswith("malloc: every peer") for note in data["notes"]), data["notes"]
    assert "÷ best raw, paired" in proc.stdout


def _common():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import common
    finally:
        sys.path.pop(0)
    return common


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_balanced_order_has_every_case_follow_every_other_once(n):
    import itertools

    names = [f"case{i}" for i in range(n)]
    order = _common().balanced_order(names)
    assert sorted(set(order)) == names and len(order) == max(1, n * (n - 1))
    follows = [(order[i - 1], order[i]) for i in range(len(order))] if n > 1 else []
    assert sorted(follows) == sorted(itertools.permutations(names, 2))  # the wrap counts: the order is cyclic


def test_time_interleaved_values_are_per_cycle_means_in_the_balanced_order():
    common = _common()
    calls = []
    clock = iter(range(1000))
    cases = {name: (lambda name=name: calls.append(name)) for name in ("hora", "mpi", "gloo")}
    real_perf_counter = common.time.perf_counter
    common.time.perf_counter = lambda: float(next(clock))  # every call takes one "second"
    try:
        times = common.time_interleaved(None, cases, warmup=1, repeats=4)
    finally:
        common.time.perf_counter = real_perf_counter
    order = common.balanced_order(list(cases))
    assert calls == ["hora", "mpi", "gloo"] + order * 2  # warm-up, then ceil(4 / 2) = 2 cycles
    assert times == {name: [1.0, 1.0] for name in cases}
