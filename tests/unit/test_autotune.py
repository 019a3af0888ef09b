"""Autotune's search and its rank-0 bookkeeping, with a fake clock standing in for the job."""

from __future__ import annotations

import csv
import math
from types import SimpleNamespace

import pytest

from hora.core import autotune
from hora.core.autotune import COLUMNS, Autotuner, Search, Settings, parse_space
from hora.core.negotiation import Signature
from hora.core.ops import CollectiveType, ReduceOp
from hora.errors import ConfigError

MiB = 1024 * 1024


def fake_ready(name, numel=1024):
    s = Signature(CollectiveType.ALLREDUCE, (("float32", (numel,), ()),), ReduceOp.SUM, -1, 1.0, 1.0, 0, "cpu")
    return SimpleNamespace(name=name, error=None, first=lambda: s)


def peak_scorer(best: Settings):
    """Bytes per second that fall off smoothly with the distance from ``best`` (in the search's features)."""
    target = autotune.features(best)

    def score(s: Settings) -> float:
        f = autotune.features(s)
        return 1e9 * math.exp(-0.15 * sum((a - b) ** 2 for a, b in zip(f, target, strict=True)))

    return score


class FakeJob:
    """Steps of 3 named allreduces; a step takes (bytes / score) seconds under the settings in force."""

    def __init__(self, tuner: Autotuner, score):
        self.now = 0.0
        self.tuner = tuner
        self.score = score
        self.settings = tuner._current
        self.steps = 0
        self.switch_steps = []

    def clock(self) -> float:
        return self.now

    def step(self) -> None:
        readies = [fake_ready(f"g{i}") for i in range(3)]
        if self.tuner.proposal() is not None:  # the round that carries it applies it everywhere
            self.settings = Settings(**self.tuner.proposal())
            self.tuner.applied()
            self.switch_steps.append(self.steps)
        for r in readies:
            self.tuner.after_round([r])
            self.now += 4096 / self.score(self.settings)
        self.steps += 1


@pytest.mark.parametrize("best_index", [0, 17, 40])
def test_search_with_a_fake_scorer_finds_the_best_candidate_in_under_300_steps(tmp_path, best_index):
    space = autotune.SPACE
    best = space[best_index]
    log_file = tmp_path / "autotune.csv"
    tuner = Autotuner(space[5], candidates=space, steps_per_sample=10, warmup_samples=1, max_samples=20,
                      log_file=str(log_file))
    job = FakeJob(tuner, peak_scorer(best))
    tuner._clock = job.clock
    while not tuner.done and job.steps < 400:
        job.step()
    assert tuner.done and tuner.chosen == best, (tuner.chosen, best)
    assert job.settings == best  # what every rank runs with at the end
    assert tuner.steps <= 300
    rows = list(csv.reader(log_file.open()))
    assert rows[0] == COLUMNS
    assert rows[-1][0] == "chosen" and float(rows[-1][3]) == best.fusion_threshold_bytes / MiB
    trials = rows[1:-1]
    assert sum(r[1] == "trial" for r in trials) == 20 and sum(r[1] == "recheck" for r in trials) == 3
    assert all(float(r[-1]) > 0 for r in trials)


def test_every_trial_is_measured_after_the_switch_and_a_settling_step():
    space = autotune.grid(fusion_mb=(1, 64), cycle_ms=(1,), direct_bytes=(MiB,), overlap=(True,))
    tuner = Autotuner(space[0], candidates=space, steps_per_sample=4, warmup_samples=1, max_samples=2, recheck=0)
    seen = []

    def score(s):
        seen.append(s)
        return 1e9 if s.fusion_threshold_bytes == 64 * MiB else 1e8

    job = FakeJob(tuner, score)
    tuner._clock = job.clock
    while not tuner.done:
        job.step()
    # warmup (4 steps), trial 1 (4), switch, settle (1), trial 2 (4), then the best, already in force
    assert [t.ended_at_step for t in tuner.trials] == [8, 13]
    assert job.switch_steps == [9]  # the job started on the best: only one switch
    assert tuner.chosen.fusion_threshold_bytes == 64 * MiB
    assert tuner.trials[1].score / tuner.trials[0].score == pytest.approx(10, rel=0.01)


def test_search_starts_from_the_jobs_own_settings():
    search = Search(autotune.SPACE, initial=3)
    assert search.ask() == autotune.SPACE[0]


def test_parse_space():
    space = parse_space("fusion_mb=0,64; overlap=0")
    assert {s.fusion_threshold_bytes for s in space} == {0, 64 * MiB}
    assert {s.overlap for s in space} == {False}
    assert len(space) == 2 * 2 * 3  # cycle and direct keep their defaults
    with pytest.raises(ConfigError, match="HORA_AUTOTUNE_SPACE"):
        parse_space("fusion=1")


def test_pinned_names_the_flags_and_variables():
    text = Settings(16 * MiB, 2.5, 4 * MiB, False).pinned()
    assert "--fusion-threshold-mb 16" in text and "--cycle-time-ms 2.5" in text
    assert f"HORA_DIRECT_THRESHOLD={4 * MiB}" in text and "HORA_OVERLAP=0" in text
