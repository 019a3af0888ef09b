"""The process-wide runtime behind ``hvd.init()``: lifecycle, topology, process sets.

Framework bindings share this module, so ``hora.torch`` and a future
``hora.keras`` in the same process see one engine.  The state lives in one
:class:`Runtime` object that ``shutdown()`` discards, so ``init()`` ->
``shutdown()`` -> ``init()`` starts from scratch every time.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from hora.config import EngineConfig
from hora.core.engine import Engine
from hora.core.ops import CollectiveType
from hora.core.process_sets import normalize_ranks
from hora.core.request import Handle, Request
from hora.errors import ConfigError, DuplicateNameError, NotInitializedError

log = logging.getLogger(__name__)


class ProcessSet:
    """A subset of ranks that runs collectives among themselves (Horovod's ``ProcessSet``).

    Create one with a list of global ranks and register it with
    :func:`add_process_set` (or pass it to ``init(process_sets=...)``).
    """

    def __init__(self, ranks: Sequence[int] | Any) -> None:
        if hasattr(ranks, "Get_group"):  # an mpi4py communicator
            ranks = _ranks_of_comm(ranks)
        self.ranks: list[int] | None = sorted(int(r) for r in ranks) if ranks is not None else None
        self.process_set_id: int | None = None

    def _require_registered(self) -> None:
        if self.process_set_id is None:
            raise ConfigError(f"process set {self.ranks} is not registered: call hvd.add_process_set() first")

    def size(self) -> int | None:
        """Number of ranks in the set (None before registration, as in Horovod)."""
        return None if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank inside the set, or None if it is not a member."""
        if self.ranks is None:
            return None
        me = current().engine.rank
        return self.ranks.index(me) if me in self.ranks else None

    def included(self) -> bool | None:
        """True when this process belongs to the set."""
        if self.ranks is None:
            return None
        return current().engine.rank in self.ranks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and (self.process_set_id, self.ranks) == (
            other.process_set_id, other.ranks)

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks or ())))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


def _ranks_of_comm(comm: Any) -> list[int]:
    from mpi4py import MPI

    world = MPI.COMM_WORLD.Get_group()
    mine = comm.Get_group()
    return list(MPI.Group.Translate_ranks(mine, list(range(mine.Get_size())), world))


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
global_process_set.ranks = None  # filled at init()


class Runtime:
    """One initialised hora: the engine, the registered process sets, and the names in use."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.process_sets: dict[int, ProcessSet] = {0: global_process_set}
        self._names: dict[tuple[str, int], itertools.count] = {}
        # (kind, request key) -> the handle last submitted under that name, until the program has seen it
        # finish; request key -> the last handle of any kind, while in flight.  Weak references, so a
        # handle the program dropped frees its name.
        self._unseen: dict[tuple[CollectiveType, str], weakref.ref[Handle]] = {}
        self._in_flight: dict[str, weakref.ref[Handle]] = {}
        self._unseen_lock = threading.Lock()

    def auto_name(self, kind: str, process_set_id: int = 0) -> str:
        """Horovod-style generated name.  Counted per process set, because only
        the members of a set submit its collectives, and per kind, so that an
        op one rank runs alone (an allgather that fails while another rank is
        in join()) does not shift the names of every later op."""
        counter = self._names.setdefault((kind, process_set_id), itertools.count())
        return f"{kind}.noname.{next(counter)}"

    def claim_name(self, request: Request, handle: Handle) -> None:
        """Record that ``handle`` now holds the user-given name of ``request``.

        Two rules, as in Horovod: a name may not be reused by the same kind of
        collective until the program has waited for (or polled done) the one
        that last used it, whether or not that one has finished, so the
        outcome never depends on timing; and no two collectives of any kind
        may be in flight under one name, since ranks negotiate by name.

        Raises:
            DuplicateNameError: either rule is broken; the message says how to fix it.
        """
        key = request.key
        with self._unseen_lock:
            ref = self._unseen.get((request.kind, key))
            earlier = ref() if ref is not None else None
            if earlier is not None and not earlier.observed:
                kind = request.kind.label
                raise DuplicateNameError(
                    f"{kind} named {request.name!r} was submitted while an earlier {kind} with that name has not "
                    "been synchronized (waited for) yet; use a different name, or synchronize() the first handle "
                    "before reusing it")
            ref = self._in_flight.get(key)
            other = ref() if ref is not None else None
            if other is not None and not other.done():
                kind = request.kind.label
                raise DuplicateNameError(
                    f"{kind} named {request.name!r} was submitted while another collective with that name is "
                    "still in flight; names must be unique among the collectives in flight, whatever their kind")
            self._unseen[(request.kind, key)] = self._in_flight[key] = weakref.ref(handle)
            if len(self._unseen) > 4096:  # forget names whose handles are gone, seen or finished
                self._unseen = {k: r for k, r in self._unseen.items() if (h := r()) is not None and not h.observed}
                self._in_flight = {k: r for k, r in self._in_flight.items() if (h := r()) is not None and not h.done()}


_lock = threading.RLock()
_runtime: Runtime | None = None


def init(
    comm: Any = None,
    process_sets: Sequence[ProcessSet] | str | None = None,
    config: EngineConfig | None = None,
) -> None:
    """Start hora in this process (idempotent while running).

    Args:
        comm: accepted for Horovod compatibility: an mpi4py communicator or a
            list of ranks.  Only ``None`` or the full world is supported.
        process_sets: process sets to register right away, or ``"dynamic"``.
        config: engine knobs; defaults come from the environment.
    """
    global _runtime
    with _lock:
        if _runtime is not None and _runtime.engine.running:
            return
        if comm is not None and not (isinstance(comm, list) and not comm):
            ranks = _ranks_of_comm(comm) if hasattr(comm, "Get_group") else list(comm)
            from hora.core.startup import start_engine as _start

            engine = _start(config)
            if sorted(ranks) != list(range(engine.size)):
                engine.shutdown()
                raise ConfigError("init(comm=...) with a sub-communicator is not supported; use process sets")
        else:
            from hora.core.startup import start_engine as _start

            engine = _start(config)
        _runtime = Runtime(engine)
        global_process_set.ranks = list(range(engine.size))
        if isinstance(process_sets, Sequence) and not isinstance(process_sets, str):
            for ps in process_sets:
                add_process_set(ps)


def shutdown() -> None:
    """Stop the engine on every rank.  Safe to call twice or before init()."""
    global _runtime
    with _lock:
        rt, _runtime = _runtime, None
        if rt is None:
            return
        for ps in rt.process_sets.values():
            if ps is not global_process_set:
                ps.process_set_id = None
        rt.engine.shutdown()


def is_initialized() -> bool:
    return _runtime is not None and _runtime.engine.running


def current() -> Runtime:
    """The running runtime.

    Raises:
        NotInitializedError: ``init()`` has not been called (or shutdown()
            has), in words a user can act on.
    """
    rt = _runtime
    if rt is None:
        raise NotInitializedError("hora has not been initialized; call hvd.init() first")
    return rt


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every rank (a collective: all ranks must call it in the same order)."""
    rt = current()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ConfigError(f"{ps} is already registered")
    ranks = normalize_ranks(ps.ranks or [], rt.engine.size)
    request = Request(rt.auto_name("process_set.add"), CollectiveType.ADD_PROCESS_SET, [], payload=ranks)
    ps.process_set_id = rt.engine.submit(request).wait()
    ps.ranks = list(ranks)
    rt.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregister a process set on every rank; returns False if it was not registered."""
    rt = current()
    if process_set.process_set_id in (None, 0):
        return False
    request = Request(rt.auto_name("process_set.remove"), CollectiveType.REMOVE_PROCESS_SET, [],
                      root=process_set.process_set_id)
    removed = rt.engine.submit(request).wait()
    rt.process_sets.pop(process_set.process_set_id, None)
    process_set.process_set_id = None
    return bool(removed)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a timeline into ``file_path`` from now on (Horovod's ``hvd.start_timeline``).

    Call it on every rank; rank 0 writes (every rank with
    ``HORA_TIMELINE_ALL_RANKS=1``, each beside rank 0's file).  A recording
    already running is closed first, as a complete JSON file.  See
    :mod:`hora.core.timeline` for the format.

    Raises:
        NotInitializedError: before ``init()`` (a ``ValueError``, as in Horovod).
        ConfigError: the file cannot be created.
    """
    from hora.core import timeline

    timeline.start(current().engine, file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline recording and close its file as valid JSON (Horovod's ``hvd.stop_timeline``)."""
    from hora.core import timeline

    timeline.stop(current().engine)


def mpi_built() -> bool:
    """True when mpi4py is importable (hora needs no compile step); MPI is not initialised."""
    from hora.core.backends.mpi import mpi_available

    return mpi_available()


def _atexit() -> None:
    try:
        shutdown()
    except Exception as e:  # pragma: no cover - interpreter teardown
        log.debug("shutdown at exit: %s", e)


atexit.register(_atexit)
