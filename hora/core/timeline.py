"""The timeline: a Chrome trace of what the engine did, in Horovod's format.

Rank 0 (or every rank, with ``HORA_TIMELINE_ALL_RANKS``) writes a JSON array of trace events that
``chrome://tracing`` and Perfetto open.  As in Horovod each tensor is a "process" (``M`` events name it)
and each collective two spans on it: ``NEGOTIATE_<OP>``, from the first rank seen ready to the round that
finds it ready on every rank, with an instant per rank as this rank learns of it (``ready k/n`` when the
summed readiness count cannot say which ranks); then ``<OP>``, holding ``QUEUE`` (behind the round's
earlier buckets), ``MEMCPY_IN_FUSION_BUFFER``, the backend's ``MPI_ALLREDUCE`` / ``GLOO_ALLREDUCE`` /
``NCCL_ALLREDUCE`` ..., ``MEMCPY_OUT_FUSION_BUFFER``, and closed by an event with the dtype and shape.
``CYCLE_START`` instants mark the rounds with ``mark_cycles``.  docs/timeline.md says more.

Recording never blocks a collective: the engine appends a named record (:class:`ReadyRound`,
:class:`Negotiation`, :class:`Buckets`, ...) to a bounded queue, and one writer thread per process
formats and writes the queues of every open recording.  A full queue drops records and the file gets a
``TIMELINE_DROPPED`` instant with the count.  The file is valid JSON after every write (each batch goes
before a closing ``]`` that the next batch overwrites), after ``stop_timeline()``, and after SIGINT or
SIGTERM, whose handlers write the queue and then hand the signal on.  After a SIGKILL the last line may
be cut off: every event is on its own line, and :func:`load` reads up to the last complete one.  A size
cap (``HORA_TIMELINE_MAX_MB``) stops the recording, or with ``HORA_TIMELINE_ROTATE=1`` moves the file to
``<name>.1.json``, ``<name>.2.json`` ... and starts a new one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hora.core.negotiation import CacheEntry, NameCache, Ready, Signature
from hora.core.ops import CollectiveType
from hora.errors import ConfigError

if TYPE_CHECKING:
    from hora.core.hooks import RecordedEngine, RoundRecorder
    from hora.core.request import Request

log = logging.getLogger(__name__)

MiB = 1024 * 1024
QUEUE = "QUEUE"
MEMCPY_IN = "MEMCPY_IN_FUSION_BUFFER"
MEMCPY_OUT = "MEMCPY_OUT_FUSION_BUFFER"

#: Control requests that never appear in a timeline.
_HIDDEN = frozenset({CollectiveType.JOIN, CollectiveType.ADD_PROCESS_SET, CollectiveType.REMOVE_PROCESS_SET})

#: CollectiveType.X.name, without the enum's property lookup each time
_KIND_NAME = {kind: kind.name for kind in CollectiveType}
#: The backend activity's suffix per collective (Horovod's spellings: MPI_BCAST, not MPI_BROADCAST).
_ACTIVITY = {**_KIND_NAME, CollectiveType.BROADCAST: "BCAST"}
#: Where a text formatted once for several tensors takes each one's pid.
_PID = "<pid>"


# ------------------------------------------------------------------ records
class Cycle(NamedTuple):
    """An engine round started at ``at`` (``time.monotonic()``, as every time here)."""

    at: float


class ReadyRound(NamedTuple):
    """This rank's tensors found ready on every rank of their set in the round ending at ``at``."""

    at: float
    names: list[str]
    starts: list[float]  # when this rank submitted each
    rankses: list[Sequence[int]]  # each tensor's process-set ranks
    readies: list[Ready]


class Negotiation(NamedTuple):
    """A negotiation followed rank by rank, from ``start`` to ``end`` (None: still open at the stop)."""

    name: str
    kind: CollectiveType
    start: float
    instants: list[tuple[float, str]]  # (when, who): a rank, or ``ready k/n``
    end: float | None
    signature: Signature | None  # the agreed one, whose <OP> span follows
    error: str | None  # the ranks disagreed: no <OP> follows


class Bucket(NamedTuple):
    """One allreduce bucket: its tensors' names (None for a joined rank's zeros) and its times."""

    backend: str
    fused: bool
    names: list[str | None]
    start: float  # packing (fused) or the collective starts
    packed: float  # the collective starts
    reduced: float  # the collective is done
    done: float  # the results are in place


class Buckets(NamedTuple):
    """A round's allreduce buckets, in the order they ran."""

    buckets: list[Bucket]


class Single(NamedTuple):
    """An allgather, broadcast, alltoall or reducescatter: its backend call's start and end."""

    backend: str
    kind: CollectiveType
    name: str
    start: float
    done: float


@dataclasses.dataclass(slots=True)
class _Negotiating:  # a negotiation still open, as the engine's thread follows it
    kind: CollectiveType
    start: float
    known: set[int]  # the ranks known to be ready
    count: int  # the highest readiness count seen
    instants: list[tuple[float, str]]


class _OpenOp(NamedTuple):  # an <OP> span open in the file, since ``at``
    pid: int
    at: float
    signature: Signature


#: The closing ``args`` of a signature's ``<OP>`` span, by ``id`` (checked by identity): the engine's
#: name cache hands the same Signature objects every step, and every recording shares the table.
_CLOSING_ARGS: dict[int, tuple[Signature, str]] = {}


def _closing_args(sig: Signature) -> str:
    """``, "args": {"dtype": ..., "shape": ...}`` for the event closing ``sig``'s ``<OP>`` span."""
    cached = _CLOSING_ARGS.get(id(sig))
    if cached is not None and cached[0] is sig:
        return cached[1]
    tensors = sig.tensors
    if len(tensors) == 1:
        dtype, shape = tensors[0][0], str(list(tensors[0][1]))
    else:
        dtype, shape = ",".join(t[0] for t in tensors), str([list(t[1]) for t in tensors])
    args = f', "args": {{"dtype": {json.dumps(dtype)}, "shape": {json.dumps(shape)}}}'
    if len(_CLOSING_ARGS) > 4096:
        _CLOSING_ARGS.clear()
    _CLOSING_ARGS[id(sig)] = (sig, args)
    return args


def _span(pid: int | str, what: str, begin: int, end: int) -> str:
    """A ``B`` and its ``E`` event on ``pid`` (times in the file's microseconds)."""
    return (f'{{"ph": "B", "name": "{what}", "ts": {begin}, "pid": {pid}}},\n'
            f'{{"ph": "E", "ts": {end}, "pid": {pid}}}')


def rank_path(path: str | os.PathLike, rank: int) -> str:
    """Where ``rank`` writes its timeline: ``path`` itself for rank 0, ``<stem>.rank<r><suffix>`` beside it else."""
    p = Path(path)
    return str(p) if rank == 0 else str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def display_name(kind: CollectiveType, name: str) -> str:
    """A tensor's name in the trace, Horovod's way: ``allreduce.<name>`` unless the name already says so."""
    prefix = kind.label + "."
    return name if name.startswith(prefix) else prefix + name


class _WriterThread:
    """The one daemon thread that writes every open timeline's queue: starting a recording starts no thread."""

    _current: _WriterThread | None = None
    _lock = threading.RLock()  # re-entrant: close() may run from a signal handler that interrupted add()

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.timelines: frozenset[Timeline] = frozenset()
        self.wake = threading.Event()
        threading.Thread(target=self._run, name="hora-timeline-writer", daemon=True).start()

    @classmethod
    def get(cls) -> _WriterThread:
        with cls._lock:
            if cls._current is None or cls._current.pid != os.getpid():
                cls._current = cls()
            return cls._current

    def add(self, timeline: Timeline) -> None:
        with self._lock:  # the set is replaced, never changed: the thread iterates a snapshot
            self.timelines = self.timelines | {timeline}
        self.wake.set()

    def remove(self, timeline: Timeline) -> None:
        with self._lock:
            self.timelines = self.timelines - {timeline}

    def _run(self) -> None:
        while True:
            timelines = self.timelines
            interval = min((t.flush_interval_s for t in timelines), default=None)
            self.wake.wait(interval)
            self.wake.clear()
            for timeline in self.timelines & timelines:  # a timeline just added waits an interval
                timeline._write_queued()


class Timeline:
    """One recording: the engine's :class:`~hora.core.hooks.RoundRecorder` and the file the writer thread writes.

    The engine's calls only append to a bounded queue, written every ``flush_interval_s``.
    :meth:`close` writes the rest and closes the array; it is safe twice and from a signal handler.

    Args:
        path: the file to write (created or truncated).
        rank: this process's rank.
        mark_cycles: record a ``CYCLE_START`` instant per engine round.
        max_bytes: stop (or rotate) when the file reaches this size; 0: no cap.
        rotate: at the cap, move the file aside and start a new one instead of stopping.
        queue_events: records the queue holds before new ones are dropped.
        flush_interval_s: how often the writer wakes to write what is queued.
        on_stop: called (from the writer thread) when the size cap or an error stops the recording.

    Raises:
        ConfigError: the file cannot be created, naming the path.
    """

    def __init__(self, path: str | os.PathLike, *, rank: int = 0, mark_cycles: bool = False, max_bytes: int = 0,
                 rotate: bool = False, queue_events: int = 1 << 16, flush_interval_s: float = 0.05,
                 on_stop: Callable[[], None] | None = None) -> None:
        if queue_events < 1:
            raise ConfigError(f"HORA_TIMELINE_QUEUE={queue_events} must be at least 1")
        self.path, self.rank = str(path), rank
        self.mark_cycles, self.max_bytes, self.rotate = mark_cycles, max_bytes, rotate
        self.capacity, self.flush_interval_s = queue_events, flush_interval_s
        self.dropped = 0  # records dropped because the queue was full (engine thread only)
        self.rotations = 0
        self._queue: collections.deque = collections.deque()
        self._on_stop = on_stop
        self._t0 = time.monotonic()
        self._epoch_us = int(time.time() * 1e6)
        self._negotiating: dict[str, _Negotiating] = {}  # engine thread only
        # the writer's state, for the file being written
        self._pids: dict[str, int] = {}
        self._ops: dict[str, _OpenOp] = {}
        self._unended: list[int] = []  # pids of negotiations written without their end (at the stop)
        self._fd: int | None = None
        self._body_end = 0  # where the closing bracket is, which the next write overwrites
        self._written_drops = 0
        self._writers = {Cycle: self._write_cycle, ReadyRound: self._write_ready_round,
                         Negotiation: self._write_negotiation, Buckets: self._write_buckets,
                         Single: self._write_single}
        self._closed = threading.Event()
        self._stopped = False
        self._write_lock = threading.Lock()
        self._open_file()
        self._writer = _WriterThread.get()
        self._writer.add(self)
        log.info("timeline: rank %d records to %s", rank, self.path)

    # ------------------------------------------------------------- recording
    def put(self, record: tuple) -> None:
        """Queue one record; drop and count it when the queue is full (never blocks)."""
        if len(self._queue) < self.capacity:
            self._queue.append(record)
        else:
            self.dropped += 1

    def cycle(self, at: float) -> None:
        """A round started at ``at``."""
        self.put(Cycle(at))

    def buckets(self, done: list[Bucket]) -> None:
        """A round's allreduce buckets, in the order they ran, as one record."""
        self.put(Buckets(done))

    def single(self, backend: str, kind: CollectiveType, name: str, start: float, done: float) -> None:
        """One allgather, broadcast, alltoall or reducescatter: when its backend call started and ended."""
        self.put(Single(backend, kind, name, start, done))

    def observe_round(self, at: float, pending: Mapping[str, Request], cache: NameCache, totals: np.ndarray,
                      header: int, announcements: Sequence[Mapping[str, bytes]] | None,
                      members: Mapping[int, Sequence[int]], ready: Sequence[Ready]) -> None:
        """Record what one negotiation round showed: who became ready, what is ready everywhere.

        Args:
            at: when the round's negotiation finished (``time.monotonic()``).
            pending: this rank's pending requests by negotiated name.
            cache: the engine's name cache.
            totals: the summed readiness vector.
            header: index of the first cached id's slot in ``totals``.
            announcements: per rank, the names announced this round (None without a second phase).
            members: process-set id -> its ranks.
            ready: the round's ready list.
        """
        counts = np.asarray(totals)[header:]
        neg = self._negotiating
        if not neg and announcements is None and ready:
            at_once = self._ready_at_once(at, pending, counts, members, ready)
            if at_once is not None:
                self.put(at_once)
                return
        by_id, by_name = cache.by_id, cache.by_name
        seen = {by_id[i].name: int(counts[i]) for i in np.flatnonzero(counts).tolist() if i < len(by_id)}
        announced: dict[str, set[int]] = {}  # name -> the ranks that announced it (new, or a changed signature)
        signatures: dict[str, bytes] = {}
        for r, ann in enumerate(announcements or ()):
            for name, raw in ann.items():
                announced.setdefault(name, set()).add(r)
                signatures.setdefault(name, raw)
        ready_by_name = {r.name: r for r in ready}
        at_once = ReadyRound(at, [], [], [], [])
        for name in seen.keys() | announced.keys():
            entry, state = by_name.get(name), neg.get(name)
            kind = state.kind if state is not None else _kind_of(signatures.get(name), entry)
            if kind is None or kind in _HIDDEN:
                continue
            ranks = members.get(entry.process_set if entry is not None else 0, ())
            count, r = seen.get(name, 0), ready_by_name.get(name)
            if (state is None and not announced and count == len(ranks) and name in pending and r is not None
                    and r.error is None and self.rank in ranks):
                at_once.names.append(name)  # ready everywhere in the first round that counts it
                at_once.starts.append(pending[name].submitted_at)
                at_once.rankses.append(ranks)
                at_once.readies.append(r)
            else:
                self._progress(name, kind, at, count + len(announced.get(name, ())), announced.get(name, set()),
                               ranks, pending)
        for r in ready:
            state = neg.pop(r.name, None)
            if state is not None:
                error = None if r.error is None else str(r.error)
                self.put(Negotiation(r.name, state.kind, state.start, state.instants, at,
                                     r.first() if error is None else None, error))
        if at_once.names:
            self.put(at_once)

    def _ready_at_once(self, at: float, pending: Mapping[str, Request], counts: np.ndarray,
                       members: Mapping[int, Sequence[int]], ready: Sequence[Ready]) -> ReadyRound | None:
        """The usual round in one pass: this rank's requests are the ``ready`` ones, ready everywhere; else None."""
        # Without announcements every pending name is cached and counted, so as many counted names as
        # pending ones and ready ones means the three are the same names.
        if not len(ready) == len(pending) == np.count_nonzero(counts):
            return None
        rankses = [members.get(r.process_set, ()) for r in ready]
        # each count is at most its set's size, so equal sums mean every one is full (no joined rank's gap)
        if int(counts.sum()) != sum(map(len, rankses)) or any([r.error is not None for r in ready]):
            return None
        names = [r.name for r in ready]
        try:
            starts = [pending[name].submitted_at for name in names]
        except KeyError:  # not the same names after all
            return None
        return ReadyRound(at, names, starts, rankses, list(ready))

    def _progress(self, name: str, kind: CollectiveType, at: float, count: int, announced: set[int],
                  ranks: Sequence[int], pending: Mapping[str, Request]) -> None:
        """Account for what this round says of ``name``: ``count`` ranks ready, ``announced`` by name."""
        if self.rank not in ranks:
            return  # another process set's collective: this rank never runs it
        mine = name in pending
        state = self._negotiating.get(name)
        if state is None:
            state = _Negotiating(kind, pending[name].submitted_at if mine else at, set(), 0, [])
            self._negotiating[name] = state
        known, instants = state.known, state.instants
        if mine and self.rank not in known:
            known.add(self.rank)
            instants.append((pending[name].submitted_at, str(self.rank)))
        newly = sorted(announced - known)
        if count > state.count:
            state.count = count
            unknown = [r for r in ranks if r not in known and r not in newly and (r != self.rank or mine)]
            if len(unknown) == count - len(known) - len(newly):  # the count says which ranks they are
                newly += unknown
            elif count > len(known) + len(newly):
                instants.append((at, f"ready {count}/{len(ranks)}"))
        known.update(newly)
        instants += [(at, str(r)) for r in newly]

    # ---------------------------------------------------------------- writer
    def _open_file(self) -> None:
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        except OSError as e:
            raise ConfigError(f"cannot write the timeline to {self.path}: {e}; set HORA_TIMELINE "
                              "(--timeline-filename) to a writable path") from e
        self._pids, self._ops, self._unended = {}, {}, []
        self._write_at(b"[\n", 0)
        self._body_end = 2
        self._append([
            json.dumps({"name": "process_name", "ph": "M", "pid": 0,
                        "args": {"start_time_since_epoch_in_micros": self._epoch_us}}),
            json.dumps({"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}),
        ])

    def _write_at(self, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:  # a short write (a full disk raises instead): write the rest
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def _append(self, lines: list[str]) -> None:
        """Write event lines before the closing bracket, leaving a valid array (the file only grows)."""
        if not lines:
            return
        body = ((",\n" if self._body_end > 2 else "") + ",\n".join(lines)).encode()
        self._write_at(body + b"\n]\n", self._body_end)
        self._body_end += len(body)

    def _us(self, t: float) -> int:
        return int((t - self._t0) * 1e6)

    def _pid(self, name: str, kind: CollectiveType, out: list[str]) -> int:
        """``name``'s pid in this file, naming a new one with ``kind``'s display name."""
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            shown = json.dumps(display_name(kind, name))
            out.append(f'{{"name": "process_name", "ph": "M", "pid": {pid}, "args": {{"name": {shown}}}}},\n'
                       f'{{"name": "process_sort_index", "ph": "M", "pid": {pid}, "args": {{"sort_index": {pid}}}}}')
        return pid

    def _close_op(self, name: str, at: float, out: list[str]) -> None:
        """End ``name``'s ``<OP>`` span at ``at`` with its dtype and shape, if it is open in this file."""
        op = self._ops.pop(name, None)
        if op is not None:
            out.append(f'{{"ph": "E", "ts": {self._us(at)}, "pid": {op.pid}{_closing_args(op.signature)}}}')

    def _write_cycle(self, rec: Cycle, out: list[str]) -> None:
        out.append(f'{{"ph": "i", "name": "CYCLE_START", "ts": {self._us(rec.at)}, "s": "g"}}')

    def _write_ready_round(self, rec: ReadyRound, out: list[str]) -> None:
        """Each tensor's ``NEGOTIATE_<OP>`` span with its instants, and the start of its ``<OP>``."""
        me, end, t0 = self.rank, self._us(rec.at), self._t0
        pids, ops = self._pids, self._ops
        tails: dict[tuple[CollectiveType, int], str] = {}  # the events after this rank's instant, by kind and set
        for name, start, ranks, ready in zip(rec.names, rec.starts, rec.rankses, rec.readies, strict=True):
            sig = ready.first()
            kind = sig.kind
            if kind in _HIDDEN:
                continue
            tail = tails.get((kind, id(ranks)))
            if tail is None:
                tail = tails[kind, id(ranks)] = "".join(
                    [*[f'{{"ph": "X", "name": "{r}", "ts": {end}, "pid": {_PID}, "dur": 0}},\n' for r in ranks
                       if r != me],
                     f'{{"ph": "E", "ts": {end}, "pid": {_PID}}},\n'
                     f'{{"ph": "B", "name": "{_KIND_NAME[kind]}", "ts": {end}, "pid": {_PID}}}'])
            if name in ops:  # the last one never finished (its bucket failed)
                self._close_op(name, start, out)
            pid = pids.get(name) or self._pid(name, kind, out)
            ts = int((start - t0) * 1e6)
            out.append(f'{{"ph": "B", "name": "NEGOTIATE_{_KIND_NAME[kind]}", "ts": {ts}, "pid": {pid}}},\n'
                       f'{{"ph": "X", "name": "{me}", "ts": {ts}, "pid": {pid}, "dur": 0}},\n'
                       + tail.replace(_PID, str(pid)))
            ops[name] = _OpenOp(pid, rec.at, sig)
            if kind is CollectiveType.BARRIER:  # nothing runs for a barrier once it is negotiated
                self._close_op(name, rec.at, out)

    def _write_negotiation(self, rec: Negotiation, out: list[str]) -> None:
        """A negotiation followed rank by rank: its span, its instants and, when it ended, the start of ``<OP>``."""
        if rec.name in self._ops:
            self._close_op(rec.name, rec.start, out)
        pid = self._pid(rec.name, rec.kind, out)
        out.append(f'{{"ph": "B", "name": "NEGOTIATE_{rec.kind.name}", "ts": {self._us(rec.start)}, "pid": {pid}}}')
        out += [f'{{"ph": "X", "name": {json.dumps(who)}, "ts": {self._us(ts)}, "pid": {pid}, "dur": 0}}'
                for ts, who in sorted(rec.instants)]
        if rec.end is None:  # still negotiating when the recording stopped: _close_spans ends it
            self._unended.append(pid)
            return
        end = self._us(rec.end)
        if rec.error is not None:
            out.append(f'{{"ph": "E", "ts": {end}, "pid": {pid}, "args": {{"error": {json.dumps(rec.error)}}}}}')
            return
        out.append(f'{{"ph": "E", "ts": {end}, "pid": {pid}}},\n'
                   f'{{"ph": "B", "name": "{rec.kind.name}", "ts": {end}, "pid": {pid}}}')
        self._ops[rec.name] = _OpenOp(pid, rec.end, rec.signature)
        if rec.kind is CollectiveType.BARRIER:
            self._close_op(rec.name, rec.end, out)

    def _write_buckets(self, rec: Buckets, out: list[str]) -> None:
        """Per tensor of each bucket: ``QUEUE``, the bucket's activities, and the end of its ``<OP>`` span.

        A bucket's events are the same for each of its tensors but for the pid: they are formatted once,
        with a placeholder for it.
        """
        us, ops = self._us, self._ops
        for b in rec.buckets:
            t0, t1, t2, t3 = us(b.start), us(b.packed), us(b.reduced), us(b.done)
            activity = f"{b.backend.upper()}_ALLREDUCE"
            steps = [(MEMCPY_IN, t0, t1), (activity, t1, t2), (MEMCPY_OUT, t2, t3)] if b.fused else [(activity, t1, t2)]
            activities = ",\n".join([_span(_PID, what, begin, end) for what, begin, end in steps])
            queued_at, text = None, ""
            for name in dict.fromkeys(b.names):  # a request of several tensors shares one name
                if name is None:
                    continue
                op = ops.pop(name, None)
                if op is None:  # its negotiation is not in this file: the activities alone
                    pid = self._pids.get(name) or self._pid(name, CollectiveType.ALLREDUCE, out)
                    out.append(activities.replace(_PID, str(pid)))
                    continue
                if op.at != queued_at:  # the tensors of a round share their QUEUE's start
                    queued_at = op.at
                    text = (f'{_span(_PID, QUEUE, us(op.at), t0)},\n{activities},\n'
                            f'{{"ph": "E", "ts": {t3}, "pid": {_PID}')
                out.append(f"{text.replace(_PID, str(op.pid))}{_closing_args(op.signature)}}}")

    def _write_single(self, rec: Single, out: list[str]) -> None:
        pid = self._pid(rec.name, rec.kind, out)
        start, done = self._us(rec.start), self._us(rec.done)
        op = self._ops.get(rec.name)
        if op is not None:
            out.append(_span(pid, QUEUE, self._us(op.at), start))
        out.append(_span(pid, f"{rec.backend.upper()}_{_ACTIVITY.get(rec.kind, rec.kind.name)}", start, done))
        self._close_op(rec.name, rec.done, out)

    def _write_queued(self) -> None:
        """Write what is queued (the writer thread's periodic call); any error stops this recording only."""
        try:
            with self._write_lock:
                self._drain_locked()
        except Exception as e:  # noqa: BLE001 - the writer thread serves every recording: it must go on
            log.error("timeline: writing %s failed (%s: %s); the recording stops here", self.path,
                      type(e).__name__, e)
            self._stop_recording()

    def _drain_locked(self) -> None:
        q, writers, out = self._queue, self._writers, []
        if self._fd is None or self._stopped:
            q.clear()
            return
        while q:
            rec = q.popleft()
            writers[type(rec)](rec, out)
        dropped = self.dropped
        if dropped != self._written_drops:
            if self._written_drops == 0:
                log.warning("timeline: the queue of %d records was full; dropping records (raise "
                            "HORA_TIMELINE_QUEUE, or mark fewer cycles)", self.capacity)
            out.append(f'{{"ph": "i", "name": "TIMELINE_DROPPED", "ts": {self._us(time.monotonic())}, '
                       f'"s": "g", "args": {{"records": {dropped - self._written_drops}}}}}')
            self._written_drops = dropped
        self._append(out)
        if self.max_bytes and self._body_end >= self.max_bytes:
            self._at_cap()

    def _at_cap(self) -> None:
        mb = self.max_bytes / MiB
        if not self.rotate:
            self._append([f'{{"ph": "i", "name": "TIMELINE_STOPPED", "ts": {self._us(time.monotonic())}, "s": "g", '
                          f'"args": {{"reason": "size cap HORA_TIMELINE_MAX_MB={mb:g} reached"}}}}'])
            log.warning("timeline: %s reached HORA_TIMELINE_MAX_MB=%g; recording stopped (set "
                        "HORA_TIMELINE_ROTATE=1 to continue in a new file)", self.path, mb)
            self._stop_recording()
            return
        self._close_spans(time.monotonic())
        self._close_file()
        self.rotations += 1
        p = Path(self.path)
        moved = p.with_name(f"{p.stem}.{self.rotations}{p.suffix}")
        os.replace(p, moved)
        log.warning("timeline: %s reached HORA_TIMELINE_MAX_MB=%g; moved it to %s and started a new file",
                    self.path, mb, moved)
        self._open_file()

    def _close_spans(self, at: float) -> None:
        """End every span still open, so the file nests cleanly when it is closed."""
        end = self._us(at)
        self._append([f'{{"ph": "E", "ts": {end}, "pid": {pid}}}'
                      for pid in [*self._unended, *(op.pid for op in self._ops.values())]])
        self._ops, self._unended = {}, []

    def _close_file(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _stop_recording(self) -> None:
        self._stopped = True
        self._close_file()
        if self._on_stop is not None:
            self._on_stop()

    # ----------------------------------------------------------------- close
    @property
    def active(self) -> bool:
        """True while the recording runs (not closed, not stopped by the cap or an error)."""
        return not self._closed.is_set() and not self._stopped

    def _flush_negotiations(self) -> None:
        """Queue the negotiations still open (a stalled rank), which are otherwise written when they end."""
        for name, st in self._negotiating.copy().items():  # a copy in one step: the engine's thread may go on
            self.put(Negotiation(name, st.kind, st.start, st.instants.copy(), None, None, None))

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued and close the array, from the calling thread (idempotent).

        Waits at most ``timeout`` seconds for a write the writer thread has under way.
        """
        if self._closed.is_set():
            return
        self._flush_negotiations()
        self._closed.set()
        self._writer.remove(self)
        if not self._write_lock.acquire(timeout=timeout):
            log.error("timeline: %s is still being written after %.0f s; leaving it as it is", self.path, timeout)
            return
        try:
            self._drain_locked()
            if self._fd is not None and not self._stopped:  # (the size cap may have stopped it)
                self._close_spans(time.monotonic())
        except OSError as e:
            log.error("timeline: closing %s failed: %s", self.path, e)
        finally:
            self._close_file()
            self._write_lock.release()
        if self.dropped:
            log.warning("timeline: %d records were dropped because the writer fell behind (see the "
                        "TIMELINE_DROPPED instants in %s)", self.dropped, self.path)
        log.info("timeline: rank %d closed %s", self.rank, self.path)


def _kind_of(raw: bytes | None, entry: CacheEntry | None) -> CollectiveType | None:
    """A name's collective: from the signature it was announced with, its validated Ready, or a rank's signature."""
    if raw is None and entry is not None:
        if entry.ready is not None:
            return entry.ready.first().kind
        raw = next((s for s in entry.signatures if s is not None), None)
    return None if raw is None else Signature.decode(raw).kind


# ------------------------------------------------------------------ signals
_handlers_lock = threading.Lock()
_live: set[Timeline] = set()
_previous: dict[int, Any] = {}


def _on_signal(signum: int, frame: Any) -> None:
    for tl in list(_live):
        tl.close(timeout=2.0)
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def watch_signals(timeline: Timeline) -> None:
    """Close ``timeline`` cleanly on SIGINT and SIGTERM, then pass the signal on to the handler that was there.

    Only the main thread can install handlers: elsewhere this does nothing (the file is valid up to its
    last write).  :func:`unwatch_signals` puts them back, unless someone installed their own since.
    """
    with _handlers_lock:
        _live.add(timeline)
        if _previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                current = signal.getsignal(sig)
                if current is signal.SIG_IGN:
                    continue
                _previous[sig] = current
                signal.signal(sig, _on_signal)
            except (ValueError, OSError) as e:  # not the main interpreter, or an odd platform
                log.debug("timeline: cannot watch signal %s: %s", sig, e)


def unwatch_signals(timeline: Timeline) -> None:
    """Forget ``timeline``; restore the previous handlers when it was the last one open."""
    with _handlers_lock:
        _live.discard(timeline)
        if _live or not _previous or threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in list(_previous.items()):
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(sig) is _on_signal:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        _previous.clear()


# ------------------------------------------------------------------ reading
def load(path: str | os.PathLike) -> list[dict]:
    """The events of a timeline file up to the last complete one (a killed writer leaves no ``]``).

    Raises:
        ConfigError: the file is not a timeline at all (no opening ``[``).
    """
    text = Path(path).read_text(errors="replace")
    with contextlib.suppress(json.JSONDecodeError):
        events = json.loads(text)
        if isinstance(events, list):
            return events
    stripped = text.lstrip()
    if not stripped.startswith("["):
        raise ConfigError(f"{path} is not a timeline (a JSON array of trace events)")
    events = []
    for line in stripped[1:].splitlines():
        line = line.strip().rstrip(",")
        if line and line != "]":
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                break  # the cut-off end of a killed writer
    return events


# ------------------------------------------------------------ engine control
def start(engine: RecordedEngine, path: str | os.PathLike, mark_cycles: bool = False) -> Timeline | None:
    """Start recording ``engine`` into ``path`` (rank 0 only, unless ``HORA_TIMELINE_ALL_RANKS`` is set).

    A recording under way is closed; the new file starts with the next round (starting the file already
    being written changes nothing).  Every rank may call this, as ``hvd.start_timeline``; the ranks that
    do not write return None.

    Raises:
        ConfigError: the file cannot be created.
    """
    config = engine.config
    if engine.rank != 0 and not config.timeline_all_ranks:
        return None
    target = rank_path(path, engine.rank)
    current = engine.timeline
    if isinstance(current, Timeline) and current.path == target and current.active:
        current.mark_cycles = mark_cycles
        return current

    def detach() -> None:
        if engine.timeline is tl:
            engine.set_timeline(None)

    tl = Timeline(
        target, rank=engine.rank, mark_cycles=mark_cycles, max_bytes=int(config.timeline_max_mb * MiB),
        rotate=config.timeline_rotate, queue_events=config.timeline_queue, on_stop=detach,
    )
    _retire(engine.set_timeline(tl))
    watch_signals(tl)
    return tl


def stop(engine: RecordedEngine) -> None:
    """Stop recording ``engine``: write what is queued and close the file as a complete JSON array."""
    _retire(engine.set_timeline(None))


def _retire(previous: RoundRecorder | None) -> None:
    if isinstance(previous, Timeline):
        previous.close()
        unwatch_signals(previous)
