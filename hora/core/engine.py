"""The collective engine: a background thread that negotiates and executes.

Callers submit :class:`~hora.core.request.Request` objects and get a
:class:`~hora.core.request.Handle` back at once.  The engine's thread works
in rounds (see :mod:`hora.core.negotiation`): it runs a round as soon as it
has work, so a synchronous collective pays no cycle-time floor; after a round
in which nothing was ready everywhere it waits ``cycle_time_ms`` (or for new
work) before trying again; with nothing to do it checks in with the other
ranks only every ``idle_tick_s``, which keeps stall reports and shutdown
working without burning CPU.

The engine is an object, not module state: ``init()`` -> ``shutdown()`` ->
``init()`` builds a fresh one, which elastic training relies on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from hora.config import EngineConfig
from hora.core.backends.base import Backend
from hora.core.executor import Executor
from hora.core.hooks import RoundRecorder, Tuner
from hora.core.negotiation import (
    HEADER,
    SLOT_JOINED,
    SLOT_PHASE2,
    SLOT_SHUTDOWN,
    NameCache,
    Ready,
    resolve,
)
from hora.core.ops import CollectiveType
from hora.core.process_sets import ProcessSetState
from hora.core.request import Handle, Request
from hora.core.stall import Abandon, StallMonitor, ages
from hora.core.topology import Topology
from hora.errors import (
    BackendError,
    ConfigError,
    HoraError,
    InternalError,
    ShutdownError,
)

log = logging.getLogger(__name__)

_CALLER_SPIN_S = 0.002

_CONTROL = (CollectiveType.JOIN, CollectiveType.ADD_PROCESS_SET, CollectiveType.REMOVE_PROCESS_SET)


class Engine:
    """Negotiates and executes collectives for one process.

    A caller driving its own synchronous collective spins up to
    ``CALLER_SPIN_S`` waiting for the other ranks, since it has nothing else
    to do; the engine thread spins briefly and then sleeps (see
    :func:`~hora.core.backends.base.wait_with_backoff`).

    Args:
        topology: this process's place in the job.
        config: engine knobs.
        controller: the CPU backend used for negotiation and CPU tensors.
        data_backends: extra backends by device type (``{"cuda": nccl}``).
    """

    CALLER_SPIN_S = _CALLER_SPIN_S

    def __init__(
        self,
        topology: Topology,
        config: EngineConfig,
        controller: Backend,
        data_backends: Mapping[str, Backend] | None = None,
    ) -> None:
        self.topology = topology
        self.config = config
        self.controller = controller
        self.rank = controller.rank
        self.size = controller.size
        self._backends: dict[str, Backend] = {"cpu": controller, **(data_backends or {})}
        self.process_sets: dict[int, ProcessSetState] = {0: ProcessSetState(0, tuple(range(self.size)))}
        self._next_pset_id = 1
        self._cache = NameCache(config.cache_capacity)
        self._executor = Executor(
            self.rank, self._backend_for, self.process_sets, config.fusion_threshold_bytes,
            config.direct_threshold_bytes,
        )
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._pending: dict[str, Request] = {}
        self._join_handle: Handle | None = None
        self._joined_ranks: set[int] = set()
        self._shutdown_requested = False
        self._failure: HoraError | None = None
        self._stopped = threading.Event()
        self._round_cv = threading.Condition()
        self._round_busy = False
        self._kicked = False
        self._last_round_at = time.monotonic()
        self._last_progress = True
        self._stalls = StallMonitor(config, self.rank)
        self.idle_tick_s = 0.5
        cores_per_rank = (os.cpu_count() or 1) // max(1, topology.local_size)
        self.overlap = config.overlap if config.overlap is not None else (
            cores_per_rank >= 2 or "cuda" in self._backends)
        self.rounds = 0
        #: the :class:`~hora.core.timeline.Timeline` recording this rank, or None (see :meth:`set_timeline`)
        self.timeline: RoundRecorder | None = None
        if config.timeline_filename:
            from hora.core import timeline

            timeline.start(self, config.timeline_filename, config.timeline_mark_cycles)
        #: rank 0's :class:`~hora.core.autotune.Autotuner` with ``HORA_AUTOTUNE=1``; the others follow it
        self.autotune: Tuner | None = None
        if config.autotune and self.rank == 0:
            from hora.core import autotune

            self.autotune = autotune.for_engine(config, self.overlap)
        self._thread = threading.Thread(target=self._main, name=f"hora-engine-{self.rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API
    def submit(self, request: Request, wake: bool = True) -> Handle:
        """Queue a request; returns its handle immediately.

        ``wake=False`` is for a caller about to wait on the handle: its own
        thread will run the round, so the engine thread is left asleep.  It
        is also left asleep when ``overlap`` is off: the request then runs
        when someone waits for it (or polls it).

        Names must be unique among the requests in flight; bindings
        guarantee that through :func:`hora.core.collectives.submit`.

        Raises:
            ShutdownError: the engine has stopped (locally, on another rank,
                or after a failure), naming the cause.
        """
        with self._cv:
            if self._failure is not None:
                raise self._failure
            if self._stopped.is_set() or self._shutdown_requested:
                raise ShutdownError(
                    "hora has been shut down: a rank called shutdown() or exited, or an earlier error "
                    "stopped the engine. Call hora init() again before submitting collectives."
                )
            self._incoming.append(request)
            if wake and self.overlap:
                self._cv.notify()
        request.handle.driver = self.wait_for
        return request.handle

    def kick(self) -> None:
        """Have the engine thread run rounds for what is queued (``poll()`` calls this)."""
        with self._cv:
            self._kicked = True
            self._cv.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine on every rank; pending requests fail with ShutdownError.

        The other ranks join the final round within their idle tick.  If they
        never do (a dead peer), the engine is abandoned after ``timeout``.
        """
        with self._cv:
            self._shutdown_requested = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("hora engine did not stop within %.0f s (another rank may be gone); abandoning it",
                            timeout)
        if self.timeline is not None:
            from hora.core import timeline

            timeline.stop(self)
        if self.autotune is not None:
            self.autotune.close()
        self._teardown_backends()

    def set_timeline(self, timeline: RoundRecorder | None) -> RoundRecorder | None:
        """Record into ``timeline`` from the next round on (None: stop recording); returns the previous one.

        :func:`hora.core.timeline.start` and ``stop`` call this; they open and close the files.
        """
        previous, self.timeline = self.timeline, timeline
        self._executor.timeline = timeline
        return previous

    def retune(self, **knobs: Any) -> None:
        """Change engine knobs from this round on: ``fusion_threshold_bytes``, ``cycle_time_ms``,
        ``direct_threshold_bytes``, ``overlap``.

        Every rank must change them in the same round, because the fusion
        decisions of a round must agree; :mod:`hora.core.autotune` does so
        through the negotiation round.  Cached allreduce plans are dropped.
        """
        if "overlap" in knobs:
            self.overlap = bool(knobs.pop("overlap"))
        self.config = dataclasses.replace(self.config, **knobs)
        self._executor.set_thresholds(self.config.fusion_threshold_bytes, self.config.direct_threshold_bytes)
        for entry in self._cache.by_id:
            if entry.ready is not None:
                entry.ready.plan = None

    @property
    def running(self) -> bool:
        return not self._stopped.is_set()

    # ------------------------------------------------------------- the loop
    def _main(self) -> None:
        while not self._stopped.is_set():
            tick = self._wait_for_work()
            if self._stopped.is_set():
                break
            if not self._take_round(block=False):
                continue  # a waiting caller is driving rounds; it notifies us if work remains
            try:
                self._absorb()
                if self._pending or self._join_handle or self._shutdown_requested or tick:
                    self._guarded_round()
            finally:
                self._release_round()

    def wait_for(self, handle: Handle) -> None:
        """Drive rounds on the calling thread until ``handle`` completes.

        A synchronous collective is mostly latency: running its round here,
        instead of waking the engine thread and being woken back, saves two
        thread hand-offs.  If the engine thread is mid-round, wait for it.
        """
        cycle = self.config.cycle_time_ms / 1000.0
        while not handle.done() and not self._stopped.is_set():
            if not self._take_round(block=False):
                with self._round_cv:
                    while self._round_busy and not handle.done():
                        self._round_cv.wait(0.1)
                continue
            try:
                if handle.done():
                    break
                self._absorb()
                self._guarded_round(spin_s=self.CALLER_SPIN_S)
                progressed = self._last_progress
            finally:
                self._release_round()
            if not progressed and not handle.done():
                handle.wait_event(cycle)

    def _take_round(self, block: bool) -> bool:
        with self._round_cv:
            while self._round_busy:
                if not block:
                    return False
                self._round_cv.wait()
            self._round_busy = True
            return True

    def _release_round(self) -> None:
        with self._round_cv:
            self._round_busy = False
            self._round_cv.notify_all()
        if self._pending or self._incoming or self._join_handle:
            with self._cv:
                self._cv.notify()

    def _absorb(self) -> None:
        with self._cv:
            for req in self._incoming:
                if req.kind == CollectiveType.JOIN:
                    self._join_handle = req.handle
                else:
                    self._pending[req.key] = req
            self._incoming.clear()

    def _guarded_round(self, spin_s: float = 200e-6) -> bool:
        """Run one round; any failure stops the engine and fails every pending request."""
        try:
            if self._round(spin_s):
                return True
        except Abandon as e:
            self._fail_everything(e.error)
        except HoraError as e:
            log.error("hora engine stopped on rank %d: %s", self.rank, e)
            self._fail_everything(e)
        except Exception as e:  # a backend failure: the job's state is unknown
            if self._failure is not None or self._stopped.is_set():
                return False  # already failed and reported; this is the fallout
            err = InternalError(
                f"hora engine failed on rank {self.rank}: {type(e).__name__}: {e}. This usually means another "
                "rank exited or crashed; look for the first error in the other ranks' output")
            err.__cause__ = e
            e.__traceback__ = None  # its frames hold the failed collective's work, which keeps connections open
            log.error("%s", err)
            self._fail_everything(err)
        self._stopped.set()
        with self._cv:
            self._cv.notify_all()
        if self._failure is not None:
            # Close this rank's connections now: a peer blocked on us must fail at once, not at gloo's timeout.
            self._teardown_backends(from_round=True)
        return False

    def _wait_for_work(self) -> bool:
        """Sleep until a round is worth running; True when woken by the idle tick.

        While a caller drives rounds (``_round_busy``) this thread stays
        asleep: waking it would only steal the CPU from the ranks' own work.
        """
        with self._cv:
            while True:
                if self._shutdown_requested or self._stopped.is_set():
                    return False
                busy = self._round_busy
                # Without overlap, queued work waits for whoever waits on it (or polls it).
                eager = self.overlap or self._kicked
                has_work = bool(self._pending or self._join_handle)
                if not busy and eager and (self._incoming or (has_work and self._last_progress)):
                    self._kicked = False
                    return False
                if has_work and eager:
                    deadline = self._last_round_at + self.config.cycle_time_ms / 1000.0
                else:
                    deadline = self._last_round_at + self.idle_tick_s
                remaining = deadline - time.monotonic()
                if remaining <= 0 and not busy:
                    self._kicked = False
                    return True  # a tick: keep stall detection and shutdown moving
                self._cv.wait(max(remaining, 0.001) if not busy else self.idle_tick_s)

    def _round(self, spin_s: float = 200e-6) -> bool:
        """One negotiation round and the execution of what became ready.

        Returns False once the engine should stop.
        """
        self.rounds += 1
        self._last_round_at = time.monotonic()
        tl = self.timeline
        if tl is not None and tl.mark_cycles:
            tl.cycle(self._last_round_at)
        cache, rank = self._cache, self.rank
        vector = np.zeros(HEADER + len(cache), np.int64)
        announce: dict[str, bytes] = {}
        signatures: dict[str, bytes] = {}
        for name, req in self._pending.items():
            sig = req.signature_bytes()
            signatures[name] = sig
            slot = cache.lookup(name, sig, rank)
            if slot is None:
                announce[name] = sig
            else:
                vector[HEADER + slot] = 1
        joined = self._join_handle is not None
        if joined:
            for entry in cache.by_id:
                if rank in self.process_sets.get(entry.process_set, ()):
                    vector[HEADER + entry.id] = 1
            vector[SLOT_JOINED] = 1
        diagnose = self._stalls.due(self._last_round_at, [r.submitted_at for r in self._pending.values()])
        tuned = self.autotune.proposal() if self.autotune is not None else None
        if announce or joined or diagnose or tuned:
            vector[SLOT_PHASE2] = 1
        if self._shutdown_requested:
            vector[SLOT_SHUTDOWN] = 1

        totals = self.controller.negotiate(vector, self._poll_wait, spin_s)

        if totals[SLOT_SHUTDOWN] > 0:
            who = "this rank" if self._shutdown_requested else "another rank"
            self._fail_everything(ShutdownError(
                f"hora was shut down by {who} while this collective was pending; every rank must submit "
                "the same collectives before shutdown()"))
            return False

        announcements = None
        newly_joined: set[int] = set()
        if totals[SLOT_PHASE2] > 0:
            message = {"a": announce, "j": joined}
            if diagnose:
                message["p"] = ages(self._pending, time.monotonic())
            if tuned:
                message["t"] = tuned
            infos = [msgpack.unpackb(b) for b in self.controller.allgather_bytes(msgpack.packb(message))]
            if "t" in infos[0]:  # rank 0's autotune decision: every rank switches in this round
                self.retune(**infos[0]["t"])
                if self.autotune is not None:
                    self.autotune.applied()
            announcements = [info["a"] for info in infos]
            newly_joined = {r for r, info in enumerate(infos) if info["j"]} - self._joined_ranks
            self._joined_ranks |= newly_joined
            if any("p" in info for info in infos):
                self._stalls.report([info.get("p") for info in infos], self._joined_ranks, self._members_of)
        elif not joined:
            self._joined_ranks.clear()

        members = {pid: ps.ranks for pid, ps in self.process_sets.items()}
        ready = self._only_cached_ready(totals, signatures, members) if announcements is None else None
        if ready is None:
            ready = resolve(cache, totals, announcements, self._joined_ranks, members, self.size)
        self._last_progress = bool(ready)
        if tl is not None:
            tl.observe_round(time.monotonic(), self._pending, cache, totals, HEADER, announcements, members, ready)
        self._execute(ready)
        if self.autotune is not None:
            self.autotune.after_round(ready)

        if totals[SLOT_JOINED] == self.size:
            last = max(newly_joined or self._joined_ranks or {self.rank})
            self._joined_ranks.clear()
            handle, self._join_handle = self._join_handle, None
            if handle is not None:
                handle.set_result(last)
            self._last_progress = True
        return True

    def _only_cached_ready(self, totals: np.ndarray, signatures: dict[str, bytes],
                           members: dict[int, Sequence[int]]) -> list[Ready] | None:
        """The steady state of a synchronous loop, without :func:`resolve`.

        One request pending here, already validated under a cached id, ready
        on every member and nothing else marked anywhere: its cached Ready is
        the whole answer (exactly what ``resolve`` would return).  None
        otherwise.
        """
        if len(signatures) != 1 or totals[SLOT_JOINED] or self._joined_ranks:
            return None
        entry = self._cache.by_name.get(next(iter(signatures)))
        if entry is None or entry.ready is None:
            return None
        counts = totals[HEADER:]
        if counts[entry.id] != len(members.get(entry.process_set, ())) or np.count_nonzero(counts) != 1:
            return None
        return [entry.ready]

    def _execute(self, ready: Sequence[Ready]) -> None:
        items: list[tuple[Ready, Request | None]] = []
        for r in ready:
            request = self._pending.pop(r.name, None)
            if r.error is not None:
                if request is not None:
                    request.handle.set_error(r.error)
                continue
            if self.rank not in self.process_sets[r.process_set].ranks:
                continue
            kind = r.first().kind
            if kind in (CollectiveType.ADD_PROCESS_SET, CollectiveType.REMOVE_PROCESS_SET):
                self._run_control(kind, r, request)
                continue
            items.append((r, request))
        if items:
            try:
                self._executor.run(items)
            except HoraError as e:
                for _, request in items:
                    if request is not None and not request.handle.done():
                        request.handle.set_error(e)
                if not isinstance(e, (ConfigError, ValueError, NotImplementedError)):
                    raise

    # ----------------------------------------------------- process sets
    def _run_control(self, kind: CollectiveType, ready: Ready, request: Request | None) -> None:
        sig = ready.first()
        if kind == CollectiveType.ADD_PROCESS_SET:
            ranks = tuple(sig.tensors[0][1])  # the ranks travel as the "shape" of the request
            existing = next((p for p in self.process_sets.values() if p.ranks == ranks), None)
            if existing is not None:
                error = ValueError(f"a process set with ranks {list(ranks)} is already registered "
                                   f"(id {existing.id})")
                if request is not None:
                    request.handle.set_error(ConfigError(str(error)))
                return
            pset = ProcessSetState(self._next_pset_id, ranks)
            self._next_pset_id += 1
            for backend in self._backends.values():
                pset.groups[backend.name] = backend.new_group(ranks, pset.id)
            self.process_sets[pset.id] = pset
            if request is not None:
                request.handle.set_result(pset.id)
        else:
            pid = sig.root
            pset = self.process_sets.pop(pid, None)
            if pset is not None:
                for backend in self._backends.values():
                    backend.free_group(pset.groups.get(backend.name))
            if request is not None:
                request.handle.set_result(pset is not None)

    # ------------------------------------------------------------ stalls
    def _members_of(self, name: str) -> Sequence[int]:
        """The ranks of a pending request's process set (by its cached entry when this rank has none)."""
        req = self._pending.get(name)
        pid = req.process_set_id if req is not None else 0
        entry = self._cache.by_name.get(name)
        if entry is not None:
            pid = entry.process_set
        pset = self.process_sets.get(pid)
        return pset.ranks if pset else range(self.size)

    def _poll_wait(self, waited: float) -> None:
        """Called while a negotiation round waits for other ranks."""
        self._stalls.while_waiting(waited, list(self._pending), self._shutdown_requested)

    # ---------------------------------------------------------- teardown
    def _fail_everything(self, error: HoraError) -> None:
        with self._cv:
            if not isinstance(error, ShutdownError):
                self._failure = error
            pending = list(self._pending.values()) + list(self._incoming)
            self._pending.clear()
            self._incoming.clear()
            join, self._join_handle = self._join_handle, None
        for req in pending:
            if not req.handle.done():
                req.handle.set_error(error)
        if join is not None:
            join.set_error(error)
        self._stopped.set()

    def _teardown_backends(self, from_round: bool = False) -> None:
        if self._thread.is_alive() and not from_round:
            return  # the thread may still be inside the backend
        for pset in list(self.process_sets.values())[1:]:
            for backend in self._backends.values():
                backend.free_group(pset.groups.get(backend.name))
        for backend in self._backends.values():
            try:
                backend.shutdown()
            except BackendError as e:
                log.debug("backend shutdown: %s", e)
        self._backends.clear()

    def _backend_for(self, device: str) -> Backend:
        backend = self._backends.get(device)
        if backend is None:
            raise ConfigError(
                f"no hora backend handles {device} tensors in this job "
                f"(available: {sorted(self._backends)}); move the tensor to the CPU or enable NCCL"
            )
        return backend


