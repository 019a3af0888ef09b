"""The timeline: a Chrome trace of what the engine did, in Horovod's format.

Rank 0 (or every rank, with ``HORA_TIMELINE_ALL_RANKS``) writes a JSON array
of trace events that ``chrome://tracing`` and Perfetto open.  As in Horovod
each tensor is a "process" (``M`` metadata events name it), and each
collective is two spans on it: ``NEGOTIATE_<OP>`` while the ranks become
ready, with one instant per rank as it does, then ``<OP>`` with the
activities nested in it (``QUEUE``, ``MEMCPY_IN_FUSION_BUFFER``, the
backend's own ``MPI_ALLREDUCE`` / ``GLOO_ALLREDUCE`` / ``NCCL_ALLREDUCE`` ...,
``MEMCPY_OUT_FUSION_BUFFER``); the event closing ``<OP>`` carries the dtype
and shape.  ``CYCLE_START`` instants mark the rounds with ``mark_cycles``.

What each phase means in hora:

* ``NEGOTIATE_<OP>`` opens when the first rank is seen ready and closes in
  the round that finds it ready on every rank.  The per-rank instants are
  what this rank knows: its own request at the time it was submitted; a rank
  that announced the name (a new name or changed shape) in that round; and,
  from the summed readiness vector of a cached name, the ranks it implies
  (all remaining ones when the count reaches the set's size, or the only
  candidates left).  When the count cannot say *which* ranks became ready the
  instant is named ``ready k/n`` instead of a rank number.  Another rank's
  readiness is seen at the round that reports it, not earlier.  A
  negotiation is written when it ends, as one record; one still open when the
  recording stops (a rank that never submitted) is written then, unended.
* ``QUEUE``: from the end of negotiation until this tensor's fusion bucket
  starts (it waits behind the round's earlier buckets).
* ``MEMCPY_IN_FUSION_BUFFER`` / ``MEMCPY_OUT_FUSION_BUFFER``: packing into and
  unpacking out of the fusion buffer (fused buckets only).
* ``<BACKEND>_<OP>``: from starting the backend collective until it is done.

Recording never blocks a collective: the engine appends a small tuple to a
bounded queue and a writer thread formats and writes it.  In the steady state
(every tensor of a step found ready on every rank in one round) the round's
negotiations travel as one record, and each tensor's whole collective is
written in one piece when its bucket is done.  A steady round that repeats
(the same Ready objects, reduced in the same buckets: a training step) is
written from the text of the first such round, kept with a gap for each time,
whose gaps are filled with array operations instead of per-event Python.
Either way the output is event for event the general path's.  When the queue
is full the record is dropped and counted; the file gets a
``TIMELINE_DROPPED`` instant with the count and the log says how many.  The
disabled cost on the engine's path is one attribute check per round and per
bucket.  One writer thread serves every recording of the process, and
stopping a recording writes the rest of its queue from the calling thread,
so starting and stopping one costs no thread start or join.

The file is valid JSON after every write: the writer appends each batch of
events before a closing ``]`` it rewrites, so a reader sees a complete array
after ``stop_timeline()``, a normal exit or SIGINT/SIGTERM (whose handlers
drain the queue first, then hand the signal to whatever handler was there).
A SIGKILL in the middle of a write can leave the last line cut off; every
event is on its own line, so :func:`load` (which ``hora timeline`` uses)
reads everything up to the last complete event, and Chrome itself accepts an
array without its ``]``.

With a size cap (``HORA_TIMELINE_MAX_MB``) the writer stops recording when the
file reaches it, closing it with a ``TIMELINE_STOPPED`` instant, or with
``HORA_TIMELINE_ROTATE=1`` moves the full file to ``<name>.1.json``,
``<name>.2.json``... and starts a fresh one under the original name; either
way it logs what it did.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import operator
import os
import re
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hora.core.ops import CollectiveType
from hora.errors import ConfigError

log = logging.getLogger(__name__)

MiB = 1024 * 1024

#: Records the engine puts on the queue (the first element of each tuple).
_CYCLE, _NEGOTIATION, _READY_AT_ONCE, _BUCKETS, _SINGLE = range(5)

#: Control requests that never appear in a timeline.
_HIDDEN = frozenset({CollectiveType.JOIN, CollectiveType.ADD_PROCESS_SET, CollectiveType.REMOVE_PROCESS_SET})

#: The backend activity's suffix per collective (Horovod's spellings: MPI_BCAST, not MPI_BROADCAST).
_ACTIVITY = {
    CollectiveType.ALLREDUCE: "ALLREDUCE",
    CollectiveType.ALLGATHER: "ALLGATHER",
    CollectiveType.BROADCAST: "BCAST",
    CollectiveType.ALLTOALL: "ALLTOALL",
    CollectiveType.REDUCESCATTER: "REDUCESCATTER",
    CollectiveType.BARRIER: "BARRIER",
}

QUEUE = "QUEUE"
_PID, _SUBMITTED = "\x01", "\x02"  # where _negotiation_pieces cuts a template (no event text holds them)
_UNLABELLED = ("", "UNKNOWN")
MEMCPY_IN = "MEMCPY_IN_FUSION_BUFFER"
MEMCPY_OUT = "MEMCPY_OUT_FUSION_BUFFER"


#: What a recording learns of a tensor once and every later recording reuses, so that a timeline
#: started at run time (``hvd.start_timeline``) does not pay for it again on its first step: a name's
#: display name and collective (replaced when the name is announced with another kind), and a cached
#: signature's closing ``args`` (keyed by ``id``, checked by identity).  Both are bounded: they are
#: cleared when they grow past the limits below.
_LABELS: dict[str, tuple[str, str]] = {}
_CLOSING_ARGS: dict[int, tuple[Any, str]] = {}
_MAX_LABELS = 1 << 16

#: Where a steady round's text takes its times (see :class:`_RoundText`): a tensor's submission
#: (``_SUBMITTED``), the round that counted the other ranks, the round's end, and its bucket's start,
#: packed, reduced and done times.  No event text holds these characters.
_SEEN, _END, _T0, _T1, _T2, _T3 = "\x03", "\x04", "\x05", "\x06", "\x07", "\x08"
_TIME_KINDS = {c: i for i, c in enumerate((_SUBMITTED, _SEEN, _END, _T0, _T1, _T2, _T3))}
_TIME_GAP = re.compile(f"([{''.join(_TIME_KINDS)}])")
#: Steady rounds' texts, by (tensors, id of the first Ready, rank); shared by every recording.
_ROUND_TEXTS: dict[tuple[int, int, int], list[_RoundText]] = {}
_MAX_ROUND_TEXTS = 64
_ROUND_TEXTS_LOCK = threading.Lock()  # a text's gaps are filled in place: one writer at a time
_FILE_SERIALS = itertools.count(1)  # tells one file's pids from another's
_LAST_STEADY: list[tuple] = [()]  # the Ready objects of the last steady round without a kept text


def rank_path(path: str | os.PathLike, rank: int) -> str:
    """Where ``rank`` writes its timeline: ``path`` itself for rank 0, ``<stem>.rank<r><suffix>`` beside it else."""
    p = Path(path)
    if rank == 0:
        return str(p)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def display_name(kind: CollectiveType, name: str) -> str:
    """A tensor's name in the trace, Horovod's way: ``allreduce.<name>`` unless the name already says so."""
    prefix = kind.label + "."
    return name if name.startswith(prefix) else prefix + name


def _steady_text(pieces: tuple, pid: str, submitted: str, chunks: list[str], args: str) -> str:
    """One tensor's whole collective in the steady state: its negotiation pieces (see
    ``Timeline._negotiation_pieces``) and its bucket's chunks (:func:`_activity_chunks`) joined at its pid,
    with its submission time, and the closing ``args``."""
    return "".join((pid.join(pieces[0]), submitted, pid.join(pieces[1]), submitted, pid.join(pieces[2]),
                    pid.join(chunks), pid, args, "}"))


def _activity_chunks(activity: str, fused: bool, t0: Any, t1: Any, t2: Any, t3: Any) -> list[str]:
    """A bucket's events after a tensor's ``QUEUE`` begins, cut at the pids: one join with a pid gives them.

    ``QUEUE`` ends at ``t0``; a fused bucket packs from ``t0`` to ``t1`` and unpacks from ``t2`` to
    ``t3``; the backend's activity runs from ``t1`` to ``t2``; the ``<OP>`` span ends at ``t3`` (its args
    follow the last piece).
    """
    events = ["", f'}},\n{{"ph": "E", "ts": {t0}, "pid": ']
    if fused:
        events += [f'}},\n{{"ph": "B", "name": "{MEMCPY_IN}", "ts": {t0}, "pid": ',
                   f'}},\n{{"ph": "E", "ts": {t1}, "pid": ']
    events += [f'}},\n{{"ph": "B", "name": "{activity}", "ts": {t1}, "pid": ',
               f'}},\n{{"ph": "E", "ts": {t2}, "pid": ']
    if fused:
        events += [f'}},\n{{"ph": "B", "name": "{MEMCPY_OUT}", "ts": {t2}, "pid": ',
                   f'}},\n{{"ph": "E", "ts": {t3}, "pid": ']
    events.append(f'}},\n{{"ph": "E", "ts": {t3}, "pid": ')
    return events


class _RoundText:
    """The whole text of a steady round, cut where its times go, kept across steps and recordings.

    A steady round is a ``_READY_AT_ONCE`` record of allreduces followed by the
    buckets that reduced exactly those tensors.  Its text is what the general
    path writes for it, tensor by tensor; from one such round to the next with
    the same Ready objects and buckets, only the times change.  The text is kept
    in one :class:`_Region` per layout of a tensor's events (fused or in place):
    as bytes with room for the digits of each time, for each number of digits
    the times have had, and as pieces with a gap for each time, where the gaps
    of one kind of time are evenly spaced, for a round whose times do not all
    have the same number of digits.  It is kept once the same round has been
    seen twice, so that rounds that never repeat (new names every step) do not
    pay for cutting it.
    """

    __slots__ = ("readies", "rankses", "buckets", "pids", "pid_lines", "regions", "file")

    def __init__(self, readies: tuple, rankses: tuple, buckets: list[tuple], pids: list[int],
                 pid_lines: list[str]) -> None:
        self.readies = readies  # the round's Ready objects, in the record's order (held: their ids are the key)
        self.rankses = rankses  # each tensor's process-set ranks
        self.buckets = buckets  # (backend, fused, names) of each bucket, in order
        self.pids = pids  # each tensor's pid in the file the text was cut for
        self.pid_lines = pid_lines  # the M events naming those pids, for a new file
        self.regions: list[_Region] = []  # one per layout of a tensor's events
        self.file = 0  # the file whose pids were last checked against ``pids``


#: "0000" ... "9999" as rows of ASCII digits: four digits of a time per lookup
_FOUR_DIGITS = np.frombuffer("".join(f"{i:04d}" for i in range(10000)).encode(), np.uint8).reshape(10000, 4)


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    """The ASCII digits of non-negative int64 ``values`` that all have ``width`` digits, one after another.

    Four digits per table lookup: three times faster than ``str`` of each value here.
    """
    groups = []
    for _ in range((width - 1) // 4):
        values, low = np.divmod(values, 10000)
        groups.append(_FOUR_DIGITS[low])
    groups.append(_FOUR_DIGITS[values])
    return np.concatenate(groups[::-1], axis=1)[:, -width:].ravel()


class _Region:
    """The part of a :class:`_RoundText` whose tensors' events have one layout: the same gaps in the same order.

    Args:
        pieces: the text, fixed pieces at even indexes and a gap (None) between each two.
        layout: the kind of time of each of a tensor's gaps (the ``_SUBMITTED`` ... ``_T3`` characters).
        order: each tensor's index in the round's record, in the text's order.
        in_bucket: each tensor's bucket (its index in the round).
        tensors: how many tensors the round has.
    """

    __slots__ = ("pieces", "gaps", "order", "in_bucket", "sources", "by_width")

    def __init__(self, pieces: list, layout: tuple[str, ...], order: list[int], in_bucket: list[int],
                 tensors: int) -> None:
        self.pieces = pieces
        self.order = order
        self.in_bucket = in_bucket
        stride = 2 * len(layout)
        kinds = [_TIME_KINDS[kind] for kind in layout]
        #: (the gaps of one kind of time as a slice of ``pieces``, that kind) for each of a tensor's gaps
        self.gaps = [(slice(1 + 2 * j, None, stride), kind) for j, kind in enumerate(kinds)]
        # the index of each gap's time in the round's vector of times (see Timeline._write_steady)
        index = [i if kind == 0 else tensors if kind <= 2 else tensors + 1 + 4 * b + kind - 3
                 for i, b in zip(order, in_bucket, strict=True) for kind in kinds]
        self.sources = np.asarray(index, dtype=np.intp)
        self.by_width: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def digits_template(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The text as bytes with room for ``width`` digits in each gap, where each digit goes, and where from.

        Returns the bytes (a writable array), the index in them of each gap's digits, and the index of
        each of those digits in the round's ``(times, width)`` array of digits, flattened.
        """
        kept = self.by_width.get(width)
        if kept is None:
            text, starts = bytearray(), []
            fixed = self.pieces[0::2]
            for k, piece in enumerate(fixed):
                text += piece.encode()
                if k + 1 < len(fixed):
                    starts.append(len(text))
                    text += b"0" * width
            digit = np.arange(width)
            kept = (np.frombuffer(bytes(text), np.uint8).copy(),
                    (np.asarray(starts)[:, None] + digit).ravel(),
                    (self.sources[:, None] * width + digit).ravel())
            self.by_width[width] = kept
        return kept


def _write_all(fd: int, buffers: list[bytes], offset: int) -> None:
    """Write ``buffers`` one after another at ``offset`` of ``fd``, in one system call when the OS allows."""
    if len(buffers) > 512 or not hasattr(os, "pwritev"):  # under every IOV_MAX; pwritev is not everywhere
        buffers = [b"".join(buffers)]
    written = os.pwritev(fd, buffers, offset) if len(buffers) > 1 else os.pwrite(fd, buffers[0], offset)
    total = sum(map(len, buffers))
    if written < total:  # a short write (a full disk raises instead): write the rest plainly
        rest = memoryview(b"".join(buffers))[written:]
        while rest:
            n = os.pwrite(fd, rest, offset + written)
            written += n
            rest = rest[n:]


def _remove_regular_file(path: str) -> None:
    """Unlink ``path`` if it is a regular file, so that opening it makes a new one.

    Truncating a written file on open costs ext4 about 0.8 ms (it starts writing the old data out
    first); unlinking it costs a tenth of that.  A symlink or special file is left to ``open``.
    """
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


class _WriterThread:
    """The one daemon thread that writes every open timeline's queue, every ``flush_interval_s``.

    It is started with the first timeline of a process (again in a forked child) and then sleeps
    until the next one, so that starting and stopping a recording costs no thread start or join:
    ``Timeline.close`` writes the rest of its queue from the calling thread.
    """

    _current: _WriterThread | None = None
    _lock = threading.RLock()  # re-entrant: close() may run from a signal handler that interrupted add()

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.timelines: set[Timeline] = set()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hora-timeline-writer", daemon=True)
        self.thread.start()

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
        due = None  # when the next write is due; None while no timeline is open
        while True:
            self.wake.wait(None if due is None else max(0.0, due - time.monotonic()))
            self.wake.clear()
            timelines = self.timelines
            interval = min((t._interval for t in timelines), default=None)
            now = time.monotonic()
            if interval is None:
                due = None
            elif due is None:  # the first timeline in a while: its first write is one interval away
                due = now + interval
            elif now >= due:
                for timeline in timelines:
                    timeline._write_queued()
                due = time.monotonic() + interval
            else:  # a timeline was added: one with a shorter interval is due sooner
                due = min(due, now + interval)


class Timeline:
    """One timeline recording: the engine's recorder and the file the writer thread writes.

    The engine calls :meth:`cycle`, :meth:`observe_round`, :meth:`buckets` and
    :meth:`single` from whichever thread runs its round (never two at once);
    they only append to a bounded queue, which the process's writer thread
    writes every ``flush_interval_s``.  :meth:`close` writes the rest of the
    queue and closes the array; it is safe to call twice and from a signal
    handler.

    Args:
        path: the file to write (created or truncated).
        rank: this process's rank (named in log messages).
        mark_cycles: record a ``CYCLE_START`` instant per engine round.
        max_bytes: stop (or rotate) when the file reaches this size; 0: no cap.
        rotate: at the cap, move the file aside and start a new one instead of stopping.
        queue_events: records the queue holds before new ones are dropped.
        flush_interval_s: how often the writer wakes to write what is queued.
        on_stop: called (from the writer thread) when the size cap stops the recording.

    Raises:
        ConfigError: the file cannot be created, naming the path.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        rank: int = 0,
        mark_cycles: bool = False,
        max_bytes: int = 0,
        rotate: bool = False,
        queue_events: int = 1 << 16,
        flush_interval_s: float = 0.05,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        if queue_events < 1:
            raise ConfigError(f"HORA_TIMELINE_QUEUE={queue_events} must be at least 1")
        self.path = str(path)
        self.rank = rank
        self.mark_cycles = mark_cycles
        self.max_bytes = max_bytes
        self.rotate = rotate
        self.capacity = queue_events
        self.dropped = 0  # records dropped because the queue was full (engine thread only)
        self.rotations = 0
        self._queue: collections.deque = collections.deque()
        self._interval = flush_interval_s
        self._on_stop = on_stop
        self._t0 = time.monotonic()
        self._epoch_us = int(time.time() * 1e6)
        # negotiation state, engine thread only: name -> [start, known ready ranks, last count, instants]
        self._negotiating: dict[str, list] = {}
        self._labels = _LABELS  # name -> (display name, OP), shared by every recording (see _LABELS)
        # writer state
        self._pids: dict[str, int] = {}
        self._open: dict[int, int] = {}  # pid -> spans open in the file
        self._written_drops = 0
        # name -> (op start, signature, deferred): the <OP> spans open in the file.  deferred is None, or
        # (submitted, seen, ranks, pieces) of a negotiation done in one round whose text is still to be
        # written, with the bucket (see _format_ready_at_once); its span is counted in _open once written
        self._ops_open: dict[str, tuple[float, Any, Any]] = {}
        self._quoted: dict[str, str] = {}  # instant name -> as JSON
        self._args_of = _CLOSING_ARGS  # id(signature) -> (signature, closing args), shared likewise
        # a steady round being written from its _RoundText: [text, record, starts, end, buckets so far]
        self._steady: list | None = None
        # a round written by the general path that may become a _RoundText: [record, names left, buckets]
        self._candidate: list | None = None
        self._file_serial = 0
        self._file = None
        self._body_end = 0
        self._events = 0
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
        q = self._queue
        if len(q) < self.capacity:
            q.append(record)
        else:
            self.dropped += 1

    def cycle(self, at: float) -> None:
        """A round started at ``at`` (``time.monotonic()``)."""
        self.put((_CYCLE, at))

    def observe_round(
        self,
        at: float,
        pending: Mapping[str, Any],
        cache: Any,
        totals: Sequence[int],
        header: int,
        announcements: Sequence[Mapping[str, bytes]] | None,
        members: Mapping[int, Sequence[int]],
        ready: Iterable[Any],
    ) -> None:
        """Record what one negotiation round showed: who became ready, what is ready everywhere.

        Args:
            at: when the round's negotiation finished (``time.monotonic()``).
            pending: this rank's pending requests by negotiated name.
            cache: the engine's :class:`~hora.core.negotiation.NameCache`.
            totals: the summed readiness vector.
            header: index of the first cached id's slot in ``totals``.
            announcements: per rank, the names announced this round (None without a second phase).
            members: process-set id -> its ranks.
            ready: the round's :class:`~hora.core.negotiation.Ready` list.
        """
        neg = self._negotiating
        if not neg and announcements is None and ready:
            at_once = self._ready_at_once(at, pending, totals[header:], members, ready)
            if at_once is not None:
                self.put((_READY_AT_ONCE, at, at_once))
                return
        labels = self._labels
        by_id = cache.by_id
        counts = totals[header:]
        if hasattr(counts, "nonzero"):
            nonzero = counts.nonzero()[0]
            pairs = zip(nonzero.tolist(), counts[nonzero].tolist(), strict=True)
        else:
            pairs = ((i, int(c)) for i, c in enumerate(counts) if c)
        known = len(by_id)
        seen = {by_id[i].name: c for i, c in pairs if i < known}  # name -> ranks ready, from the cached ids
        announced: dict[str, set[int]] = {}
        for r, ann in enumerate(announcements or ()):
            for name in ann:
                announced.setdefault(name, set()).add(r)
                self._label_from_signature(name, ann[name])  # new, or its signature changed: maybe its kind
        # names of this rank's that the counts do not show yet (announced this round): their negotiation
        # starts when they were submitted
        for name in pending.keys() - seen.keys() - neg.keys():
            req = pending[name]
            if req.kind not in _HIDDEN:
                self._label(name, req.kind)
                self._start(name, req.submitted_at)
        by_name = cache.by_name
        for name, count in seen.items():
            entry = by_name.get(name)
            if entry is None:
                continue
            if name not in labels and not self._label_from_entry(name, entry):
                continue
            ranks = members.get(entry.process_set, ())
            if not announced and count == len(ranks) and name not in neg and name in pending:
                # the steady state: one of this rank's requests, found ready on every rank in the first
                # round that counts it.  Kept compact; the writer expands it (see _instants).
                neg[name] = [pending[name].submitted_at, None, at, ranks]
                continue
            self._progress(name, at, count + len(announced.get(name, ())), announced.get(name, set()),
                           ranks, name in pending, pending)
        for name, ranks in announced.items():
            if name in seen or name not in labels:
                continue
            entry = by_name.get(name)
            pset = entry.process_set if entry is not None else 0
            self._progress(name, at, len(ranks), ranks, members.get(pset, ()), name in pending, pending)
        at_once = []  # the steady state, queued as one record for the round
        for r in ready:
            state = neg.pop(r.name, None)
            if state is None:
                continue
            if state[1] is None and r.error is None:
                at_once.append((r.name, state[0], state[2], state[3], r))
                continue
            instants = state[3] if state[1] is not None else self._instants(state[0], state[2], state[3])
            self.put((_NEGOTIATION, r.name, state[0], instants, at, r, None if r.error is None else str(r.error)))
        if at_once:
            self.put((_READY_AT_ONCE, at, at_once))

    def _ready_at_once(self, at: float, pending: Mapping[str, Any], counts: Any, members: Mapping[int, Sequence[int]],
                       ready: Sequence[Any]) -> list[tuple] | None:
        """The steady state in one pass: the items of the ``_READY_AT_ONCE`` record the general path would make.

        That is a round that counted nothing but the ``ready`` tensors, each of them on every rank of its
        process set, all of them this rank's own labelled requests without an error, with nothing
        negotiating before it and nothing announced.  None when the round is anything else.
        """
        counts = np.asarray(counts)
        # Without announcements every pending name is cached and counted, so as many counted names as
        # pending ones and ready ones means the three are the same names.
        if not len(ready) == len(pending) == np.count_nonzero(counts) or not self._labels.keys() >= pending.keys():
            return None
        if len(members) == 1:
            ranks = next(iter(members.values()))
            full = len(ranks) * len(ready)
        else:
            ranks = None
            full = sum(len(members.get(r.process_set, ())) for r in ready)
        # each count is at most its set's size, so equal sums mean every one is full (no joined rank's gap)
        if int(counts.sum()) != full or any([r.error is not None for r in ready]):
            return None
        try:
            if ranks is not None:
                return [(r.name, pending[r.name].submitted_at, at, ranks, r) for r in ready]
            return [(r.name, pending[r.name].submitted_at, at, members.get(r.process_set, ()), r) for r in ready]
        except KeyError:  # not the same names after all
            return None

    def _start(self, name: str, at: float) -> None:
        self._negotiating[name] = [at, set(), 0, []]

    def _progress(self, name: str, at: float, count: int, announced: set[int], ranks: Sequence[int],
                  mine: bool, pending: Mapping[str, Any]) -> None:
        if self.rank not in ranks:
            return  # another process set's collective: this rank never runs it
        state = self._negotiating.get(name)
        if state is None:
            state = [pending[name].submitted_at if mine else at, set(), 0, []]
            self._negotiating[name] = state
        elif state[1] is None:  # compact (ready everywhere at once) but not run yet: track it rank by rank
            start, _, seen_at, members = state
            state[:] = [start, set(members), len(members), self._instants(start, seen_at, members)]
        known: set[int] = state[1]
        instants: list = state[3]
        if mine and self.rank not in known:
            known.add(self.rank)
            instants.append((pending[name].submitted_at, str(self.rank)))
        for r in sorted(announced - known):
            known.add(r)
            instants.append((at, str(r)))
        if count <= state[2]:
            return
        state[2] = count
        unknown = [r for r in ranks if r not in known and (r != self.rank or mine)]
        if len(unknown) == count - len(known):
            for r in unknown:
                known.add(r)
                instants.append((at, str(r)))
        elif count > len(known):
            instants.append((at, f"ready {count}/{len(ranks)}"))

    def _instants(self, start: float, seen_at: float, ranks: Sequence[int]) -> list[tuple[float, str]]:
        """A compact negotiation's instants: this rank's at its submission, every other rank's at ``seen_at``."""
        me = self.rank
        return [(start, str(me))] + [(seen_at, str(r)) for r in ranks if r != me]

    def _label(self, name: str, kind: CollectiveType) -> None:
        """Remember ``name``'s display name and collective (again, when the same name now runs another kind)."""
        label = self._labels.get(name)
        if label is None or label[1] != kind.name:
            if len(self._labels) >= _MAX_LABELS:
                self._labels.clear()
            self._labels[name] = (display_name(kind, name), kind.name)

    def _label_from_signature(self, name: str, raw: bytes) -> bool:
        from hora.core.negotiation import Signature

        kind = Signature.decode(raw).kind
        if kind in _HIDDEN:
            return False
        self._label(name, kind)
        return True

    def _label_from_entry(self, name: str, entry: Any) -> bool:
        if entry.ready is not None:
            kind = entry.ready.first().kind
            if kind in _HIDDEN:
                return False
            self._label(name, kind)
            return True
        raw = next((s for s in entry.signatures if s is not None), None)
        return raw is not None and self._label_from_signature(name, raw)

    def buckets(self, done: list[tuple]) -> None:
        """A round's allreduce buckets, in the order they ran, as one record.

        Each is ``(backend, fused, names, start, packed, reduced, done)``: the tensors in it and when it
        started, was packed, reduced and unpacked.  One record a round rather than one a bucket
        (ResNet-50's gradients make 43) is less work for both the engine's thread and the writer's.
        """
        self.put((_BUCKETS, done))

    def single(self, backend: str, kind: CollectiveType, name: str, start: float, done: float) -> None:
        """One allgather, broadcast, alltoall or reducescatter: when its backend call started and ended."""
        self.put((_SINGLE, backend, kind, name, start, done))

    # ---------------------------------------------------------------- writer
    def _open_file(self) -> None:
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            _remove_regular_file(self.path)
            # unbuffered: every write is one os.pwritev at the body's end (see _append)
            self._file = open(self.path, "wb", buffering=0)  # noqa: SIM115 - the writer thread owns it until close()
        except OSError as e:
            raise ConfigError(f"cannot write the timeline to {self.path}: {e}; set HORA_TIMELINE "
                              "(--timeline-filename) to a writable path") from e
        head = [
            {"name": "process_name", "ph": "M", "pid": 0,
             "args": {"start_time_since_epoch_in_micros": self._epoch_us}},
            {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}},
        ]
        self._pids = {}
        self._open = {}
        self._file_serial = next(_FILE_SERIALS)
        self._body_end = 0
        self._events = 0
        _write_all(self._file.fileno(), [b"[\n"], 0)
        self._body_end = 2
        self._append([json.dumps(e) for e in head])

    def _append(self, lines: list) -> None:
        """Write event lines (str, or bytes from a steady round) before the closing bracket, leaving a valid array."""
        if not lines:
            return
        chunks: list[bytes] = [b",\n"] if self._events else []
        run: list[str] = []
        for line in lines:
            if isinstance(line, bytes):
                if run:
                    chunks += (",\n".join(run).encode(), b",\n")
                    run = []
                chunks += (line, b",\n")
            else:
                run.append(line)
        if run:
            chunks.append(",\n".join(run).encode())
        else:
            chunks.pop()  # the separator after the last bytes line
        body = sum(map(len, chunks))
        # the closing bracket goes after the body, over the last one: the file only grows
        _write_all(self._file.fileno(), [*chunks, b"\n]\n"], self._body_end)
        self._body_end += body
        self._events += len(lines)

    def _us(self, t: float) -> int:
        return int((t - self._t0) * 1e6)

    def _pid(self, name: str, lines: list[str]) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = len(self._pids) + 1
            self._pids[name] = pid
            lines += self._pid_lines(name, pid)
        return pid

    def _pid_lines(self, name: str, pid: int) -> list[str]:
        """The M events that name ``pid`` after ``name``'s tensor and sort it."""
        shown = json.dumps(self._labels.get(name, (name, ""))[0])
        return [f'{{"name": "process_name", "ph": "M", "pid": {pid}, "args": {{"name": {shown}}}}}',
                f'{{"name": "process_sort_index", "ph": "M", "pid": {pid}, "args": {{"sort_index": {pid}}}}}']

    def _begin(self, lines: list[str], pid: int, what: str, t: float) -> None:
        lines.append(f'{{"ph": "B", "name": "{what}", "ts": {self._us(t)}, "pid": {pid}}}')
        self._open[pid] = self._open.get(pid, 0) + 1

    def _end(self, lines: list[str], pid: int, t: float, args: str = "") -> None:
        if not self._open.get(pid):
            return  # its B went to an earlier file or was dropped
        self._open[pid] -= 1
        lines.append(f'{{"ph": "E", "ts": {self._us(t)}, "pid": {pid}{args}}}')

    def _format(self, rec: tuple, lines: list[str]) -> None:
        code = rec[0]
        if self._steady is not None:
            if code == _BUCKETS and self._steady_buckets(rec[1], lines):
                return
            self._materialize(lines)
        if code == _BUCKETS:
            for bucket in rec[1]:
                self._format_bucket(bucket, lines)
                if self._candidate is not None:
                    self._watch_candidate(bucket)
            return
        self._candidate = None
        if code == _CYCLE:
            lines.append(f'{{"ph": "i", "name": "CYCLE_START", "ts": {self._us(rec[1])}, "s": "g"}}')
        elif code == _READY_AT_ONCE:
            if not self._start_steady(rec, lines):
                candidate = self._candidate_of(rec)
                self._format_ready_at_once(rec, lines)
                self._candidate = candidate
        elif code == _NEGOTIATION:
            self._format_negotiation(rec, lines)
        elif code == _SINGLE:
            _, backend, kind, name, start, done = rec
            pid = self._pid(name, lines)
            op = self._write_deferred(name, lines)
            if op is not None:
                self._begin(lines, pid, QUEUE, op[0])
                self._end(lines, pid, start)
            self._begin(lines, pid, f"{backend.upper()}_{_ACTIVITY.get(kind, kind.name)}", start)
            self._end(lines, pid, done)
            self._close_op(lines, name, pid, done)

    def _format_ready_at_once(self, rec: tuple, lines: list[str]) -> None:
        """A round's negotiations that every rank completed in that one round: the writer's steady state.

        Their text (the ``NEGOTIATE_<OP>`` span, this rank's instant at its submission, the others' at
        the round that counted them, and the start of ``<OP>``) is deferred: the allreduce's bucket
        writes it together with its activities from one template per tensor (:meth:`_format_bucket`);
        anything else that comes first writes it on its own (:meth:`_write_deferred`).
        """
        _, at, items = rec
        pids, labels, ops_open = self._pids, self._labels, self._ops_open
        shared_by = None  # (kind, label, ranks, seen) of the last pieces: a round's tensors share them
        for name, start, seen_at, ranks, ready in items:
            sig = ready.first()
            kind = sig.kind
            if kind is CollectiveType.BARRIER or start > seen_at:
                self._format_negotiation((_NEGOTIATION, name, start, self._instants(start, seen_at, ranks), at,
                                          ready, None), lines)
                continue
            if name in ops_open:  # the last one never finished (its bucket failed): keep its text
                self._write_deferred(name, lines)
            if name not in pids:
                self._pid(name, lines)
            label = labels.get(name, _UNLABELLED)[1]
            if shared_by is None or (kind, label, ranks, seen_at) != shared_by:
                shared_by = (kind, label, ranks, seen_at)
                pieces = self._negotiation_pieces(name, kind, str(self._us(at)), str(self._us(seen_at)), ranks)
            ops_open[name] = (at, sig, (start, seen_at, ranks, pieces))

    def _negotiation_text(self, name: str, pid: int | str, kind: CollectiveType,
                          ranks: Sequence[int]) -> tuple[str, int]:
        """A one-round negotiation's events, with %s for their times, and how many other ranks it names."""
        label = "NEGOTIATE_" + self._labels.get(name, _UNLABELLED)[1]
        others = sorted(str(r) for r in ranks if r != self.rank)  # the order _format_negotiation sorts them in
        parts = [f'{{"ph": "B", "name": "{label}", "ts": %s, "pid": {pid}}}']
        for who in [str(self.rank), *others]:
            parts.append(f'{{"ph": "X", "name": {json.dumps(who)}, "ts": %s, "pid": {pid}, "dur": 0}}')
        parts.append(f'{{"ph": "E", "ts": %s, "pid": {pid}}}')
        parts.append(f'{{"ph": "B", "name": "{kind.name}", "ts": %s, "pid": {pid}}}')
        return ",\n".join(parts), len(others)

    def _write_deferred(self, name: str, lines: list[str]) -> Any:
        """Write ``name``'s deferred negotiation, if it has one, on its own; returns its entry in ``_ops_open``."""
        op = self._ops_open.get(name)
        if op is None or op[2] is None:
            return op
        pid = self._pids.get(name) or self._pid(name, lines)
        at, sig, (start, seen_at, ranks, _) = op
        text, others = self._negotiation_text(name, pid, sig.kind, ranks)
        submitted, seen, end = self._us(start), self._us(seen_at), self._us(at)
        lines.append(text % (submitted, submitted, *[seen] * others, end, end))
        self._open[pid] = self._open.get(pid, 0) + 1  # its <OP> span is open in the file now
        op = self._ops_open[name] = (op[0], op[1], None)
        return op

    def _format_negotiation(self, rec: tuple, lines: list[str]) -> None:
        """A whole negotiation (its span and per-rank instants) and the start of its collective, as one string."""
        _, name, start, instants, at, ready, error = rec
        us = self._us
        self._write_deferred(name, lines)  # an earlier one of this name that never finished
        pid = self._pid(name, lines)
        label = "NEGOTIATE_" + self._labels.get(name, _UNLABELLED)[1]
        parts = [f'{{"ph": "B", "name": "{label}", "ts": {us(start)}, "pid": {pid}}}']
        for ts, who in sorted(instants):
            shown = self._quoted.get(who)
            if shown is None:
                shown = self._quoted[who] = json.dumps(who)
            parts.append(f'{{"ph": "X", "name": {shown}, "ts": {us(ts)}, "pid": {pid}, "dur": 0}}')
        end = 0 if at is None else us(at)
        if at is None:  # still negotiating when the recording stopped: _close_spans ends it
            self._open[pid] = self._open.get(pid, 0) + 1
        elif error is not None:
            parts.append(f'{{"ph": "E", "ts": {end}, "pid": {pid}, "args": {{"error": {json.dumps(error)}}}}}')
        else:
            sig = ready.first()
            parts.append(f'{{"ph": "E", "ts": {end}, "pid": {pid}}}')
            parts.append(f'{{"ph": "B", "name": "{sig.kind.name}", "ts": {end}, "pid": {pid}}}')
            self._open[pid] = self._open.get(pid, 0) + 1
            self._ops_open[name] = (at, sig, None)
            if sig.kind == CollectiveType.BARRIER:
                lines.append(",\n".join(parts))
                self._close_op(lines, name, pid, at)
                return
        lines.append(",\n".join(parts))

    def _format_bucket(self, bucket: tuple, lines: list[str]) -> None:
        """A bucket's activities for each of its tensors: the writer's busiest path.

        Per tensor: ``QUEUE``, the fused bucket's ``MEMCPY_IN_FUSION_BUFFER`` / backend activity /
        ``MEMCPY_OUT_FUSION_BUFFER`` (or just the activity when it ran in place), then the end of its
        ``<OP>`` span with dtype and shape; before them, its negotiation when that was deferred.  The
        text is cut into pieces once per bucket and round, and each tensor's is a few joins.
        """
        backend, fused, names, start, packed, reduced, done = bucket
        us = self._us
        t0, t1, t2, t3 = us(start), us(packed), us(reduced), us(done)
        activity = f"{backend.upper()}_ALLREDUCE"
        middle = (t0, t0, t1, t1, t2, t2, t3, t3) if fused else (t0, t1, t2, t3)
        chunks = _activity_chunks(activity, fused, t0, t1, t2, t3)
        ops_open, open_, pids, args_of = self._ops_open, self._open, self._pids, self._args_of
        queued_at, queue_head = None, ""
        for name in dict.fromkeys(names):
            if name is None:
                continue
            op = ops_open.pop(name, None)
            if op is not None and op[2] is not None:
                # the steady state, the whole collective at once: its negotiation (the round's pieces, see
                # _format_ready_at_once), QUEUE, the activities and the end of <OP>, joined at its pid
                at, sig, (start, _, _, pieces) = op
                p, submitted = str(pids[name]), str(us(start))
                args = args_of.get(id(sig))
                if args is None or args[0] is not sig:
                    args = self._closing_args_of(sig)
                lines.append(_steady_text(pieces, p, submitted, chunks, args[1]))
                continue
            pid = pids.get(name) or self._pid(name, lines)
            if op is None or not open_.get(pid):  # its negotiation went to an earlier file, or was dropped
                if op is not None:
                    ops_open[name] = op
                self._bucket_unopened(lines, name, pid, op, activity, fused, middle, done)
                continue
            open_[pid] -= 1
            if op[0] != queued_at:
                queued_at = op[0]
                queue_head = f'{{"ph": "B", "name": "{QUEUE}", "ts": {us(queued_at)}, "pid": '
            p = str(pid)
            lines.append(queue_head + p.join(chunks) + p + self._closing_args(op[1]) + "}")

    def _negotiation_pieces(self, name: str, kind: CollectiveType, end: str, seen: str,
                            ranks: Sequence[int]) -> tuple:
        """A one-round negotiation's text and the start of QUEUE, cut where each tensor's pid and submission go.

        ``end`` and ``seen`` are the times (in the file's microseconds) of the round's end and of the
        round that counted the other ranks.  Returns three lists of pieces: joined with the pid, and with
        the submission time between them, they give everything up to the ``"pid": `` of the tensor's
        QUEUE event.  Every tensor negotiated in the same round shares them (see :meth:`_format_bucket`).
        """
        negotiation, others = self._negotiation_text(name, _PID, kind, ranks)
        text = (negotiation % (_SUBMITTED, _SUBMITTED, *[seen] * others, end, end)
                + f',\n{{"ph": "B", "name": "{QUEUE}", "ts": {end}, "pid": ')
        before, between, after = text.split(_SUBMITTED)
        return before.split(_PID), between.split(_PID), after.split(_PID)

    # ------------------------------------------------------ steady rounds
    def _start_steady(self, rec: tuple, lines: list[str]) -> bool:
        """Begin writing a ``_READY_AT_ONCE`` record from its round's kept text, if it has one that fits.

        It fits when the record holds the same Ready objects (hence the same names, kinds, dtypes and
        shapes), every tensor was counted in this round and submitted before it ended, the process sets
        are the same, no earlier collective of these names is still open here, and the pids are the
        text's (in a new file: given to them now, as the general path would).  The buckets then follow
        (:meth:`_steady_buckets`).
        """
        _, at, items = rec
        if not items:
            return False
        names, starts, seens, rankses, readies = zip(*items, strict=True)
        texts = _ROUND_TEXTS.get((len(items), id(readies[0]), self.rank))
        text = next((t for t in texts if t.readies == readies), None) if texts else None
        if (text is None or text.rankses != rankses or seens.count(at) != len(seens) or max(starts) > at
                or (self._ops_open and not self._ops_open.keys().isdisjoint(names))):
            return False
        if text.file != self._file_serial:
            pids = self._pids
            if [pids.get(name) for name in names] != text.pids:
                first = len(pids) + 1
                if text.pids != list(range(first, first + len(names))) or any(name in pids for name in names):
                    return False
                pids.update(zip(names, text.pids, strict=True))  # a new file: the pids the general path would give
                lines += text.pid_lines
            text.file = self._file_serial
        self._steady = [text, rec, starts, at, []]
        return True

    def _steady_buckets(self, batch: list[tuple], lines: list[str]) -> bool:
        """Take the steady round's next buckets if they are the ones its text expects; after the last, write it."""
        steady = self._steady
        text, got = steady[0], steady[4]
        k = len(got)
        if [bucket[:3] for bucket in batch] != text.buckets[k:k + len(batch)]:
            return False
        got += batch
        if len(got) == len(text.buckets):
            self._steady = None
            self._write_steady(text, steady, lines)
        return True

    def _write_steady(self, text: _RoundText, steady: list, lines: list) -> None:
        """Fill the round's text with its times and write it, with array operations rather than per-event Python.

        The times are one vector: each tensor's submission, the round's end, then each bucket's four
        times.  When they all have the same number of digits (a round rarely straddles a power of ten
        microseconds after the start), their digits go straight into the bytes of the text kept for
        that width; otherwise each kind of time fills its gaps of the text's pieces, a column at a time.
        """
        _, _, starts, at, buckets = steady
        if not _ROUND_TEXTS_LOCK.acquire(blocking=False):  # another recording is filling it
            self._write_general(steady, lines)
            return
        try:
            n = len(starts)
            values = np.array([*starts, at, *itertools.chain.from_iterable(bucket[3:] for bucket in buckets)])
            values -= self._t0
            values *= 1e6
            values = values.astype(np.int64)  # _us, for every time at once
            width = len(str(values.max()))
            if values.min() >= (10 ** (width - 1) if width > 1 else 0):  # every time has `width` digits
                digits = _digits(values, width)
                for region in text.regions:
                    buf, positions, sources = region.digits_template(width)
                    buf[positions] = digits[sources]
                    lines.append(buf.tobytes())
                return
            shown = list(map(str, values.tolist()))
            subs, end = shown[:n], shown[n]
            for region in text.regions:
                m = len(region.order)
                columns = ([subs[i] for i in region.order], [end] * m, [end] * m,
                           *([shown[n + 1 + 4 * b + k] for b in region.in_bucket] for k in range(4)))
                pieces = region.pieces
                for where, kind in region.gaps:
                    pieces[where] = columns[kind]
                lines.append("".join(pieces))
        finally:
            _ROUND_TEXTS_LOCK.release()

    def _materialize(self, lines: list[str]) -> None:
        """Hand a steady round that did not go as its text expects to the general path, as it stands."""
        steady, self._steady = self._steady, None
        if steady is not None:
            self._write_general(steady, lines)

    def _write_general(self, steady: list, lines: list[str]) -> None:
        """Write a steady round's record and the buckets taken so far by the general path."""
        self._format_ready_at_once(steady[1], lines)
        for bucket in steady[4]:
            self._format_bucket(bucket, lines)

    def _candidate_of(self, rec: tuple) -> list | None:
        """A ``_READY_AT_ONCE`` record that could make a steady round, to watch while its buckets are written."""
        _, at, items = rec
        names = {item[0] for item in items}
        if not items or len(names) != len(items) or not self._ops_open.keys().isdisjoint(names):
            return None
        for _, start, seen_at, _, ready in items:
            if ready.first().kind is not CollectiveType.ALLREDUCE or seen_at != at or start > at:
                return None
        return [rec, names, [], tuple(item[4] for item in items)]

    def _watch_candidate(self, bucket: tuple) -> None:
        """A bucket written by the general path: keep a text of the candidate round once its buckets cover it."""
        candidate = self._candidate
        names, left = bucket[2], candidate[1]
        if None in names or len(set(names)) != len(names) or not left.issuperset(names):
            self._candidate = None
            return
        left.difference_update(names)
        candidate[2].append(bucket)
        if not left:
            self._candidate = None
            readies = candidate[3]
            seen = _LAST_STEADY[0]  # the same objects (not merely equal ones): the second time this round is seen
            if len(seen) == len(readies) and all(map(operator.is_, seen, readies)):
                self._keep_round_text(candidate[0], candidate[2])
            _LAST_STEADY[0] = readies

    def _keep_round_text(self, rec: tuple, buckets: list[tuple]) -> None:
        """Cut the text the general path wrote for a steady round into a :class:`_RoundText`, for the next one."""
        _, _, items = rec
        names, _, _, rankses, readies = zip(*items, strict=True)
        pids = self._pids
        if any(name not in pids for name in names):
            return
        index = {name: i for i, name in enumerate(names)}
        layouts: dict[tuple[str, ...], tuple[list, list[int], list[int]]] = {}
        for b, (backend, fused, bucket_names, *_) in enumerate(buckets):
            chunks = _activity_chunks(f"{backend.upper()}_ALLREDUCE", fused, _T0, _T1, _T2, _T3)
            for name in bucket_names:
                i = index[name]
                sig = readies[i].first()
                p = str(pids[name])
                pieces = self._negotiation_pieces(name, sig.kind, _END, _SEEN, rankses[i])
                cut = _TIME_GAP.split(_steady_text(pieces, p, _SUBMITTED, chunks, self._closing_args(sig)))
                fixed, layout = cut[0::2], tuple(cut[1::2])
                region_pieces, order, in_bucket = layouts.setdefault(layout, ([], [], []))
                if region_pieces:
                    region_pieces[-1] += ",\n" + fixed[0]
                else:
                    region_pieces.append(fixed[0])
                for piece in fixed[1:]:
                    region_pieces += (None, piece)
                order.append(i)
                in_bucket.append(b)
        text = _RoundText(readies, rankses, [b[:3] for b in buckets], [pids[name] for name in names],
                          [line for name in names for line in self._pid_lines(name, pids[name])])
        for layout, (region_pieces, order, in_bucket) in layouts.items():
            text.regions.append(_Region(region_pieces, layout, order, in_bucket, len(names)))
        text.file = self._file_serial
        key = (len(items), id(readies[0]), self.rank)
        with _ROUND_TEXTS_LOCK:
            if len(_ROUND_TEXTS) >= _MAX_ROUND_TEXTS:
                _ROUND_TEXTS.clear()
            kept = [t for t in _ROUND_TEXTS.get(key, ()) if t.readies != readies]
            _ROUND_TEXTS[key] = [*kept, text]

    def _bucket_unopened(self, lines: list[str], name: str, pid: int, op: Any, activity: str, fused: bool,
                         middle: tuple[int, ...], done: float) -> None:
        """A bucket's tensor whose ``<OP>`` span is not open in this file: its activities, and no closing event."""
        events = [("B", QUEUE), ("E", None)]
        if fused:
            events += [("B", MEMCPY_IN), ("E", None), ("B", activity), ("E", None), ("B", MEMCPY_OUT), ("E", None)]
        else:
            events += [("B", activity), ("E", None)]
        queued = self._us(op[0]) if op is not None else middle[0]
        lines.append(",\n".join(f'{{"ph": "B", "name": "{what}", "ts": {ts}, "pid": {pid}}}' if ph == "B" else
                                 f'{{"ph": "E", "ts": {ts}, "pid": {pid}}}'
                                 for (ph, what), ts in zip(events, (queued, *middle[:-1]), strict=True)))
        self._close_op(lines, name, pid, done)

    def _closing_args(self, sig: Any) -> str:
        """The ``args`` of an ``<OP>`` span's closing event: the dtype and shape of ``sig``, cached per signature."""
        cached = self._args_of.get(id(sig))
        if cached is None or cached[0] is not sig:  # steady state: the same cached signature every step
            cached = self._closing_args_of(sig)
        return cached[1]

    def _closing_args_of(self, sig: Any) -> tuple[Any, str]:
        """Format and cache ``(sig, args)`` for :meth:`_closing_args`."""
        tensors = sig.tensors
        if len(tensors) == 1:
            dtype, shape = tensors[0][0], str(list(tensors[0][1]))
        else:
            dtype, shape = ",".join(t[0] for t in tensors), str([list(t[1]) for t in tensors])
        cached = (sig, f', "args": {{"dtype": {json.dumps(dtype)}, "shape": {json.dumps(shape)}}}')
        if len(self._args_of) > 4096:
            self._args_of.clear()
        self._args_of[id(sig)] = cached
        return cached

    def _close_op(self, lines: list[str], name: str, pid: int, at: float) -> None:
        self._write_deferred(name, lines)
        op = self._ops_open.pop(name, None)
        if op is None:
            return
        self._end(lines, pid, at, self._closing_args(op[1]))

    def _write_queued(self) -> None:
        """Write what is queued (the writer thread's periodic call); any error stops this recording only."""
        try:
            self._drain()
        except Exception as e:  # noqa: BLE001 - the writer thread serves every recording: it must go on
            log.error("timeline: writing %s failed (%s: %s); the recording stops here", self.path,
                      type(e).__name__, e)
            self._stop_recording()

    def _drain(self) -> None:
        with self._write_lock:
            self._drain_locked()

    def _drain_locked(self) -> None:
        if self._file is None:
            self._queue.clear()
            return
        q = self._queue
        lines: list[str] = []
        while q:
            rec = q.popleft()
            if not self._stopped:
                self._format(rec, lines)
        if self._stopped:
            return
        dropped = self.dropped
        if dropped != self._written_drops:
            if self._written_drops == 0:
                log.warning("timeline: the queue of %d records was full; dropping records (raise "
                            "HORA_TIMELINE_QUEUE, or mark fewer cycles)", self.capacity)
            lines.append(f'{{"ph": "i", "name": "TIMELINE_DROPPED", "ts": {self._us(time.monotonic())}, '
                         f'"s": "g", "args": {{"records": {dropped - self._written_drops}}}}}')
            self._written_drops = dropped
        self._append(lines)
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
        self._file.close()
        self.rotations += 1
        p = Path(self.path)
        moved = p.with_name(f"{p.stem}.{self.rotations}{p.suffix}")
        os.replace(p, moved)
        log.warning("timeline: %s reached HORA_TIMELINE_MAX_MB=%g; moved it to %s and started a new file",
                    self.path, mb, moved)
        self._open_file()

    def _close_spans(self, at: float) -> None:
        """End every span still open, so the file nests cleanly when it is closed."""
        lines: list[str] = []
        self._materialize(lines)
        self._candidate = None
        for name in [name for name, op in self._ops_open.items() if op[2] is not None]:
            self._write_deferred(name, lines)
        for pid, n in list(self._open.items()):
            for _ in range(n):
                self._end(lines, pid, at)
        self._append(lines)

    def _stop_recording(self) -> None:
        self._stopped = True
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        if self._on_stop is not None:
            self._on_stop()

    # ----------------------------------------------------------------- close
    @property
    def active(self) -> bool:
        """True while the recording runs (not closed, not stopped by the cap or an error)."""
        return not self._closed.is_set() and not self._stopped

    def _flush_negotiations(self) -> None:
        """Queue the negotiations still open (a stalled rank), which are otherwise written when they end."""
        for _ in range(10):  # the engine's thread may be changing the table meanwhile
            try:
                open_now = [(name, st[0], list(st[3]) if st[1] is not None else self._instants(st[0], st[2], st[3]))
                            for name, st in list(self._negotiating.items())]
                break
            except RuntimeError:
                continue
        else:
            return
        for name, start, instants in open_now:
            self.put((_NEGOTIATION, name, start, instants, None, None, None))

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued and close the array, from the calling thread (idempotent).

        Waits at most ``timeout`` seconds for a write the writer thread has under way.
        """
        if self._closed.is_set():
            return
        self._flush_negotiations()
        self._closed.set()
        self._writer.remove(self)  # not get(): in a forked child that would start a thread to remove it
        if not self._write_lock.acquire(timeout=timeout):
            log.error("timeline: %s is still being written after %.0f s; leaving it as it is", self.path, timeout)
            return
        try:
            if self._file is not None and not self._stopped:
                try:
                    self._drain_locked()
                    self._close_spans(time.monotonic())
                    self._file.close()
                except OSError as e:
                    log.error("timeline: closing %s failed: %s", self.path, e)
                self._file = None
        finally:
            self._write_lock.release()
        if self.dropped:
            log.warning("timeline: %d records were dropped because the writer fell behind (see the "
                        "TIMELINE_DROPPED instants in %s)", self.dropped, self.path)
        log.info("timeline: rank %d closed %s", self.rank, self.path)


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

    Handlers can only be installed from the main thread; elsewhere this does
    nothing (the file is still valid up to its last write).  The handlers are
    put back by :func:`unwatch_signals` once no timeline is open, unless
    someone installed their own in between.
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
            try:
                if signal.getsignal(sig) is _on_signal:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        _previous.clear()


# ------------------------------------------------------------------ reading
def load(path: str | os.PathLike) -> list[dict]:
    """Read a timeline file, tolerating a missing ``]`` or a cut-off last line (a killed writer).

    Returns:
        The events up to the last complete one.

    Raises:
        ConfigError: the file is not a timeline at all (no opening ``[``).
    """
    text = Path(path).read_text(errors="replace")
    try:
        events = json.loads(text)
        if isinstance(events, list):
            return events
    except json.JSONDecodeError:
        pass
    stripped = text.lstrip()
    if not stripped.startswith("["):
        raise ConfigError(f"{path} is not a timeline (a JSON array of trace events)")
    events = []
    for line in stripped[1:].splitlines():
        line = line.strip().rstrip(",")
        if not line or line == "]":
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the cut-off end of a killed writer
    return events


# ------------------------------------------------------------ engine control
def start(engine: Any, path: str | os.PathLike, mark_cycles: bool = False) -> Timeline | None:
    """Start recording ``engine`` into ``path`` (rank 0 only, unless ``HORA_TIMELINE_ALL_RANKS`` is set).

    What the engine recorded before goes on to close in its own file; the new
    file starts with the next round.  Starting the file already being written
    changes nothing.  Every rank may call this (as Horovod's
    ``hvd.start_timeline`` is called); the ranks that do not write return None.

    Raises:
        ConfigError: the file cannot be created.
    """
    config = engine.config
    if engine.rank != 0 and not config.timeline_all_ranks:
        return None
    target = rank_path(path, engine.rank)
    current = engine.timeline
    if current is not None and current.path == target and current.active:
        current.mark_cycles = mark_cycles
        return current

    def detach() -> None:
        if engine.timeline is tl:
            engine.set_timeline(None)

    tl = Timeline(
        target, rank=engine.rank, mark_cycles=mark_cycles, max_bytes=int(config.timeline_max_mb * MiB),
        rotate=config.timeline_rotate, queue_events=config.timeline_queue, on_stop=detach,
    )
    previous = engine.set_timeline(tl)
    if previous is not None:
        previous.close()
        unwatch_signals(previous)
    watch_signals(tl)
    return tl


def stop(engine: Any) -> None:
    """Stop recording ``engine``: write what is queued and close the file as a complete JSON array."""
    previous = engine.set_timeline(None)
    if previous is not None:
        previous.close()
        unwatch_signals(previous)
