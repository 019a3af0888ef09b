"""Autotune: the engine's knobs, tuned while the job trains (``hora run --autotune``, ``HOROVOD_AUTOTUNE=1``).

What is tuned, as a grid of candidates (:data:`SPACE`):

* the fusion threshold and the cycle time, as Horovod does;
* the direct threshold (tensors at least this large skip the fusion buffer);
* overlap: whether the engine's thread runs collectives as soon as they are
  submitted, or whoever waits for them does.  A ``DistributedOptimizer``
  picks its schedule (hooks or one grouped allreduce at ``step()``) when it
  is built, so autotune changes only the engine's side of it.

``HORA_GLOO_DEVICES`` (gloo's connections) is not tuned: the connections are
made when the process group is created, and changing them would mean
re-creating it in the middle of training.

How a trial is scored, as Horovod does: by bytes reduced per second over a
*sample* of ``steps_per_sample`` training steps, where a step ends when a
tensor name is reduced again (so unnamed collectives, whose names never
repeat, do not count steps).  The first ``warmup_samples`` samples are
discarded, and so is the first step after every change of settings (buffers
are reallocated then).  The search is a Gaussian process (scikit-learn's
``GaussianProcessRegressor``) with expected improvement over the untried
candidates; without scikit-learn the candidates are tried in a seeded random
order.  After ``max_samples`` trials the best few are measured once more and
the best mean wins.

Every rank must switch at the same step, because the fusion decisions of a
round must agree: only rank 0 measures and decides, and the decision travels
in the second phase of the engine's next negotiation round, which every rank
runs; every rank applies it there, before executing that round
(:meth:`hora.core.engine.Engine.retune`).

Rank 0 writes the CSV log (``--autotune-log-file``, ``HORA_AUTOTUNE_LOG``):
a header, one row per trial, the chosen settings last; and logs the chosen
settings once, as the flags and variables that pin them.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from hora.core.buffers import ITEMSIZE

if TYPE_CHECKING:
    from hora.config import EngineConfig
    from hora.core.negotiation import Ready

log = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """One point of the search: the engine knobs autotune sets."""

    fusion_threshold_bytes: int
    cycle_time_ms: float
    direct_threshold_bytes: int | None
    overlap: bool

    def knobs(self) -> dict[str, Any]:
        """As :meth:`~hora.core.engine.Engine.retune` takes them (and as they travel to the other ranks)."""
        return dataclasses.asdict(self)

    def pinned(self) -> str:
        """The flags and variables that pin these settings in a later run."""
        direct = "" if self.direct_threshold_bytes is None else f" HORA_DIRECT_THRESHOLD={self.direct_threshold_bytes}"
        return (f"hora run --fusion-threshold-mb {self.fusion_threshold_bytes / MiB:g} --cycle-time-ms "
                f"{self.cycle_time_ms:g} (or HORA_FUSION_THRESHOLD={self.fusion_threshold_bytes} "
                f"HORA_CYCLE_TIME={self.cycle_time_ms:g}){direct} HORA_OVERLAP={int(self.overlap)}")


def grid(
    fusion_mb: Iterable[float] = (1, 4, 16, 64),
    cycle_ms: Iterable[float] = (0.5, 2.5),
    direct_bytes: Iterable[int | None] = (256 * 1024, 4 * MiB, 64 * MiB),
    overlap: Iterable[bool] = (True, False),
) -> list[Settings]:
    """Every combination of the given values, as candidates."""
    return [Settings(int(f * MiB), float(c), d, bool(o))
            for f, c, d, o in itertools.product(fusion_mb, cycle_ms, direct_bytes, overlap)]


#: The default candidates: 4 fusion thresholds x 2 cycle times x 3 direct thresholds x overlap on/off.
SPACE: list[Settings] = grid()


def parse_space(text: str) -> list[Settings]:
    """Candidates from ``HORA_AUTOTUNE_SPACE``: ``fusion_mb=1,16,64;cycle_ms=0.5,2.5;direct_kb=256,4096;overlap=1,0``.

    Each part names one knob and its values; a knob left out keeps the
    default values of :data:`SPACE`.

    Raises:
        ConfigError: an unknown knob or a value that is not a number, naming it.
    """
    from hora.errors import ConfigError

    values: dict[str, list] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, _, raw = part.partition("=")
        key = key.strip()
        if key not in ("fusion_mb", "cycle_ms", "direct_kb", "overlap") or not raw:
            raise ConfigError(f"HORA_AUTOTUNE_SPACE: {part!r} is not one of fusion_mb=..., cycle_ms=..., "
                              "direct_kb=..., overlap=... (comma-separated values, parts separated by ';')")
        try:
            items = [float(v) for v in raw.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"HORA_AUTOTUNE_SPACE: {part!r} has a value that is not a number") from None
        if key == "direct_kb":
            values["direct_bytes"] = [int(v * 1024) for v in items]
        elif key == "overlap":
            values["overlap"] = [bool(v) for v in items]
        else:
            values[key] = items
    return grid(**values)


def features(s: Settings) -> list[float]:
    """A candidate as numbers for the Gaussian process: logarithms of the sizes and times, overlap as 0/1."""
    direct = s.direct_threshold_bytes if s.direct_threshold_bytes is not None else MiB
    return [math.log2(max(s.fusion_threshold_bytes, 1)), math.log2(s.cycle_time_ms), math.log2(direct),
            float(s.overlap)]


class Search:
    """Ask-and-tell search over a finite set of candidates.

    The first ``initial`` asks are the first candidate given (the job's own
    settings, as a baseline) and then seeded random ones; after that, the
    untried candidate with the highest expected improvement under a Gaussian
    process fitted to the scores so far.

    Args:
        candidates: the points to choose from.
        initial: asks before the Gaussian process takes over.
        seed: for the random choices.
    """

    def __init__(self, candidates: Sequence[Settings], initial: int = 5, seed: int = 0) -> None:
        if not candidates:
            raise ValueError("autotune needs at least one candidate")
        self.candidates = list(candidates)
        self.initial = initial
        self._rng = random.Random(seed)
        self._order = self.candidates[1:]
        self._rng.shuffle(self._order)
        self._order.insert(0, self.candidates[0])
        self.scores: dict[Settings, list[float]] = {}
        try:  # imported here, at init(): the first import takes a second or two
            import sklearn.gaussian_process  # noqa: F401

            self.model = "gaussian process"
        except ImportError:
            self.model = "random order"
            log.warning("autotune: scikit-learn is not installed, so candidates are tried in random order "
                        "(pip install scikit-learn for the Gaussian-process search)")

    def ask(self) -> Settings | None:
        """The next candidate to try; None once every candidate has been tried."""
        untried = [c for c in self.candidates if c not in self.scores]
        if not untried:
            return None
        if len(self.scores) < self.initial or self.model != "gaussian process":
            return next(c for c in self._order if c not in self.scores)
        return self._expected_improvement(untried)

    def tell(self, settings: Settings, score: float) -> None:
        """Record a score (higher is better) for ``settings``."""
        self.scores.setdefault(settings, []).append(score)

    def best(self, k: int = 1) -> list[Settings]:
        """The ``k`` candidates with the highest mean score."""
        ranked = sorted(self.scores, key=lambda s: -sum(self.scores[s]) / len(self.scores[s]))
        return ranked[:k]

    def _expected_improvement(self, untried: list[Settings]) -> Settings:
        import numpy as np
        from scipy.stats import norm
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

        tried = list(self.scores)
        x = np.array([features(s) for s in tried])
        y = np.array([sum(self.scores[s]) / len(self.scores[s]) for s in tried])
        scale = float(np.abs(y).max()) or 1.0
        # Fixed hyperparameters: fitting them is an optimisation loop, and this runs inside an engine
        # round.  Length scales are in the features' units (log2 of sizes and times; overlap 0/1).
        kernel = ConstantKernel(1.0, "fixed") * Matern(length_scale=[3.0, 2.0, 3.0, 1.0], length_scale_bounds="fixed",
                                                       nu=2.5) + WhiteKernel(0.05, "fixed")
        gp = GaussianProcessRegressor(kernel=kernel, normalize_y=True, optimizer=None)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence chatter on a handful of points
            gp.fit(x, y / scale)
        mean, std = gp.predict(np.array([features(s) for s in untried]), return_std=True)
        best = float(y.max() / scale)
        std = np.maximum(std, 1e-9)
        z = (mean - best - 0.01) / std
        ei = (mean - best - 0.01) * norm.cdf(z) + std * norm.pdf(z)
        return untried[int(np.argmax(ei))]


@dataclasses.dataclass
class Trial:
    """One scored sample: what ran, what it moved and how fast."""

    index: int
    phase: str  # "trial" or "recheck"
    settings: Settings
    steps: int
    bytes: int
    seconds: float
    ended_at_step: int

    @property
    def score(self) -> float:
        """Bytes reduced per second."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


COLUMNS = ["trial", "phase", "ended_at_step", "fusion_threshold_mb", "cycle_time_ms", "direct_threshold_bytes",
           "overlap", "steps", "bytes", "seconds", "score_bytes_per_s"]


class Autotuner:
    """Rank 0's side of autotuning: counts steps and bytes, scores samples, decides, logs.

    The engine calls :meth:`proposal` when it builds a round (a pending
    decision makes the round carry it to every rank), :meth:`applied` once the
    round applied it, and :meth:`after_round` with what the round executed.

    Args:
        start: the job's own settings (the first trial).
        steps_per_sample: steps in a scored sample.
        warmup_samples: samples discarded before the first trial.
        max_samples: trials before settling (each a different candidate).
        candidates: the search space (default :data:`SPACE`, with ``start`` first).
        log_file: CSV path, or None.
        recheck: how many of the best candidates are measured once more at the end.
        search: a ready-made search (tests pass one); built from the candidates otherwise.
        clock: the time source (tests pass their own).
    """

    def __init__(
        self,
        start: Settings,
        *,
        steps_per_sample: int = 10,
        warmup_samples: int = 1,
        max_samples: int = 20,
        candidates: Sequence[Settings] | None = None,
        log_file: str | None = None,
        recheck: int = 3,
        search: Search | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        space = [start] + [c for c in (candidates if candidates is not None else SPACE) if c != start]
        self.search = search if search is not None else Search(space)
        self.steps_per_sample = steps_per_sample
        self.max_samples = max_samples
        self.log_file = log_file
        self.trials: list[Trial] = []
        self.chosen: Settings | None = None
        self.steps = 0  # steps seen since autotune started
        self._clock = clock
        self._current = start
        self._pending: Settings | None = None
        self._recheck = recheck
        self._rechecks: list[Settings] | None = None
        self._phase = "trial"
        self._bytes_of: dict[str, int] = {}
        # the current window of steps: "warmup", "settle" (the step after a switch), "measure";
        # "waiting" while a switch travels to the other ranks; "done" at the end
        self._mode = "warmup" if warmup_samples else "measure"
        self._window = warmup_samples * steps_per_sample if warmup_samples else steps_per_sample
        self._counts: dict[str, int] = {}
        self._window_start = 0.0
        self._window_bytes = 0
        self._writer = None
        if log_file:
            self._log = open(log_file, "w", newline="")  # noqa: SIM115 - kept open for the trials
            self._writer = csv.writer(self._log)
            self._writer.writerow(COLUMNS)
            self._log.flush()

    @property
    def done(self) -> bool:
        """True once the chosen settings are applied everywhere."""
        return self._mode == "done"

    def proposal(self) -> dict[str, Any] | None:
        """Settings every rank must switch to in this round, or None."""
        return None if self._pending is None else self._pending.knobs()

    def applied(self) -> None:
        """The round carrying :meth:`proposal` applied it on every rank."""
        if self._pending is None:
            return
        self._current, self._pending = self._pending, None
        self._counts.clear()
        self._window_bytes = 0
        if self.chosen is not None:
            self._mode = "done"
            self._finish()
        else:
            self._mode, self._window = "settle", 1

    def after_round(self, ready: Iterable[Ready]) -> None:
        """Count the bytes and steps of a round's executed collectives; close a window when it is full.

        A window of k steps is full when a name it has seen k times comes
        round again; that collective opens the next window.
        """
        if self._mode in ("waiting", "done"):
            return
        counts = self._counts
        for r in ready:
            if r.error is not None:
                continue
            name = r.name
            n = self._bytes_of.get(name)
            if n is None:
                n = self._bytes_of[name] = sum(
                    ITEMSIZE.get(dtype, 4) * math.prod(shape) for dtype, shape, _ in r.first().tensors)
            seen = counts.get(name, 0)
            if seen >= self._window:
                self._end_window(self._clock())
                if self._mode in ("waiting", "done"):
                    return
                seen = 0
            if not counts:
                self._window_start = self._clock()
            counts[name] = seen + 1
            self._window_bytes += n

    def _end_window(self, now: float) -> None:
        self.steps += self._window
        mode = self._mode
        self._counts.clear()
        if mode == "measure":
            trial = Trial(len(self.trials) + 1, self._phase, self._current, self._window, self._window_bytes,
                          now - self._window_start, self.steps)
            self.trials.append(trial)
            self.search.tell(trial.settings, trial.score)
            self._write(trial)
            self._window_bytes = 0
            self._decide()
        else:
            self._window_bytes = 0
            self._mode, self._window = "measure", self.steps_per_sample

    def _decide(self) -> None:
        nxt: Settings | None = None
        if sum(t.phase == "trial" for t in self.trials) < self.max_samples:
            nxt = self.search.ask()
            self._phase = "trial"
        if nxt is None:
            if self._rechecks is None:
                self._rechecks = self.search.best(self._recheck) if self._recheck else []
            if self._rechecks:
                nxt = self._rechecks.pop(0)
                self._phase = "recheck"
            else:
                self.chosen = nxt = self.search.best(1)[0]
        if nxt == self._current:
            if self.chosen is not None:
                self._mode = "done"
                self._finish()
            else:
                self._mode, self._window = "measure", self.steps_per_sample
            return
        self._pending = nxt
        self._mode = "waiting"

    def _write(self, trial: Trial) -> None:
        log.debug("autotune: trial %d (%s) %s: %.1f MB/s", trial.index, trial.phase, trial.settings,
                  trial.score / 1e6)
        if self._writer is None:
            return
        s = trial.settings
        self._writer.writerow([trial.index, trial.phase, trial.ended_at_step, f"{s.fusion_threshold_bytes / MiB:g}",
                               f"{s.cycle_time_ms:g}", "" if s.direct_threshold_bytes is None else
                               s.direct_threshold_bytes, int(s.overlap), trial.steps, trial.bytes,
                               f"{trial.seconds:.6f}", f"{trial.score:.1f}"])
        self._log.flush()

    def _finish(self) -> None:
        s = self.chosen
        assert s is not None
        scores = self.search.scores.get(s, [0.0])
        mean = sum(scores) / len(scores)
        if self._writer is not None:
            self._writer.writerow(["chosen", "chosen", self.steps, f"{s.fusion_threshold_bytes / MiB:g}",
                                   f"{s.cycle_time_ms:g}", "" if s.direct_threshold_bytes is None
                                   else s.direct_threshold_bytes, int(s.overlap), "", "", "", f"{mean:.1f}"])
            self._log.close()
            self._writer = None
        log.warning("autotune: settled after %d steps and %d trials (%s) at %.1f MB/s; pin it with: %s",
                    self.steps, len(self.trials), self.search.model, mean / 1e6, s.pinned())

    def close(self) -> None:
        """Close the log; say so when the job ends before autotune settled."""
        if self._mode != "done":
            log.warning("autotune: the job ended after %d steps and %d trials, before autotune settled (it needs "
                        "about (HORA_AUTOTUNE_MAX_SAMPLES + 4) x (HORA_AUTOTUNE_STEPS_PER_SAMPLE + 1) steps, and "
                        "a step is counted only when a named collective comes round again)",
                        self.steps, len(self.trials))
        if self._writer is not None:
            self._log.close()
            self._writer = None


def start_settings(config: EngineConfig, overlap: bool) -> Settings:
    """The engine's current knobs as a :class:`Settings` (the first trial)."""
    return Settings(config.fusion_threshold_bytes, float(config.cycle_time_ms), config.direct_threshold_bytes,
                    bool(overlap))


def for_engine(config: EngineConfig, overlap: bool) -> Autotuner:
    """The autotuner rank 0's engine runs with ``config`` (``HORA_AUTOTUNE*`` knobs).

    With ``HORA_AUTOTUNE_SPACE`` the job's own settings are the first trial
    only when they are one of its candidates.
    """
    start = start_settings(config, overlap)
    candidates = parse_space(config.autotune_space) if config.autotune_space else None
    if candidates is not None and start not in candidates:
        start = candidates[0]
    return Autotuner(
        start, steps_per_sample=config.autotune_steps_per_sample, warmup_samples=config.autotune_warmup_samples,
        max_samples=config.autotune_max_samples, candidates=candidates, log_file=config.autotune_log_file,
    )
