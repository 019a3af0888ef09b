"""A server's keys: one small state machine per key, run on a thread pool.

Each key has an inbox; the server's event loop appends operations to it and a
pool thread drains it, so the operations of one key run one at a time while
different keys progress in parallel (NumPy releases the GIL for the sums and
updates that dominate the work).

Values travel in parts of at most :data:`~hora.kvstore.ps.placement.PART_BYTES`
(a push or pull of a big shard is several messages), so the server never
holds more than a few parts per worker beyond its keys.  Every push names the
worker's push number for the key (``seq``) and its element range; a pull
names the last push of the same worker (``after``) that it must see.  This
makes the order in which messages arrive (or are resent) irrelevant.

Per key the server keeps the stored value once and one merge buffer (reused
from round to round, so a steady job allocates nothing):

* **push, sync**: parts of a worker's current push are added into the merge
  buffer; a part of its next push waits for the next round.  When every
  worker's push is complete the updater runs on ``(merged, stored)``, or
  without an updater the merged sum *becomes* the stored value.
* **push, async**: a push is applied through the updater once all its parts
  arrived.  MXNet's server aborts on an async push without an updater
  ("Updater needs to be set for async mode"); hora answers with an error
  telling the worker to call ``set_optimizer``.
* **pull**: answered once the push it follows is applied, with a view of the
  stored value: no copy.  An in-place update that would race with a reply
  still being sent works on a fresh copy instead (copy-on-write).

Between co-located peers (:mod:`hora.kvstore.ps.shm`) a push's array is a
read-only view of the worker's segment: it is summed in place of a received
frame, in chunks whose pages are then unmapped again, and copied only when it
must wait for a later round (the worker reuses its segment once answered).
The server's values and merge buffers then live in its own segments, and a
pull is answered with a reference to the value's range; a token counts the
pull as a reader of the buffer until the worker releases it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import zmq

from hora.kvstore.arrays import math_pool as _math
from hora.kvstore.ps.wire import Cmd

if TYPE_CHECKING:
    from hora.kvstore.ps.shm import Segment

log = logging.getLogger(__name__)

_PULLS = (Cmd.PULL, Cmd.ROW_PULL)


class Op:
    """One request for a key, as the event loop hands it to the key's state machine.

    ``seq`` is the push number (PUSH) or the push a pull must follow (PULL);
    ``off``/``length`` the element range; ``n`` the shard size the sender expects.

    ``held`` is the request's bytes counted in the server's backlog; ``src`` is
    ``(segment, byte offset)`` when ``array`` is a view of a worker's
    shared-memory segment; ``shm`` marks a pull that may be answered through
    shared memory.  ``ids`` and ``width`` are the row ids and row width of a
    ``ROW_PUSH`` (whose ``array`` holds the rows) or a ``ROW_PULL``.
    """

    __slots__ = ("cmd", "worker", "rid", "route", "key", "array", "seq", "off", "length", "n", "z", "held", "src",
                 "shm", "ids", "width")

    def __init__(self, cmd: Cmd, worker: int, rid: int, route: bytes, key: str, array: np.ndarray | None = None,
                 seq: int = 0, off: int = 0, length: int = 0, n: int = 0, z: int = -1, held: int = 0,
                 src: tuple[Segment, int] | None = None, shm: bool = False, ids: np.ndarray | None = None,
                 width: int = 0) -> None:
        self.cmd, self.worker, self.rid, self.route, self.key, self.array = cmd, worker, rid, route, key, array
        self.seq, self.off, self.length, self.n, self.z = seq, off, length, n, z
        self.held, self.src, self.shm, self.ids, self.width = held, src, shm, ids, width

    def drop_pages(self) -> None:
        """Unmap the pages of a shared-memory array this op read (nothing for a received frame)."""
        if self.src is not None and self.array is not None:
            self.src[0].drop_pages(self.src[1], self.array.nbytes)

    def detach(self) -> None:
        """Own a private copy of a shared-memory array, so the worker may reuse its segment."""
        if self.src is not None and self.array is not None:
            array = self.array.copy()
            self.drop_pages()
            self.array, self.src = array, None


class SendToken:
    """Set by the event loop once a reply that references a stored array is handed to ZeroMQ."""

    __slots__ = ("tracker", "sent")

    def __init__(self) -> None:
        self.tracker: Any = None
        self.sent = False

    def busy(self) -> bool:
        return not self.sent or (self.tracker is not None and not self.tracker.done)


class ShmToken:
    """A pull answered through shared memory: the worker reads the buffer until it releases the pull."""

    __slots__ = ("worker", "segment", "released")

    def __init__(self, worker: int, segment: Segment) -> None:
        self.worker, self.segment = worker, segment
        self.released = False

    def busy(self) -> bool:
        return not self.released


Token = SendToken | ShmToken


def settle(tokens: list[Token], timeout: float) -> bool:
    """Wait (at most ``timeout`` seconds) until ZeroMQ is done with every reply in ``tokens``, and every
    worker with the shared-memory replies among them.

    ZeroMQ reports a sent message late (through pyzmq's garbage-collector
    thread), so a buffer whose replies went out a while ago can look busy;
    waiting a moment for that beats copying or allocating a whole buffer.
    """
    deadline = time.monotonic() + timeout
    for t in tokens:
        if isinstance(t, SendToken):
            while not t.sent:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.0005)
            if t.tracker is not None and not t.tracker.done:
                try:
                    t.tracker.wait(max(0.0, deadline - time.monotonic()))
                except zmq.NotDone:
                    return False
        else:
            while t.busy():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.0005)
    return True


class KeyState:
    """What the server knows about one key (its shard on this server)."""

    __slots__ = ("name", "value", "spare", "spare_tokens", "digests", "tokens", "error", "expected", "got", "merge",
                 "rows", "width", "deferred",
                 "assembling", "applied", "finished", "init_buf", "init_got", "inbox", "running", "lock")

    def __init__(self, name: str) -> None:
        self.name = name
        self.inbox: collections.deque[Op | Callable[[], None]] = collections.deque()
        self.running = False
        self.lock = threading.Lock()
        self.value: np.ndarray | None = None
        self.init_buf: np.ndarray | None = None
        self.init_got = 0
        self.reset()

    def reset(self) -> None:
        """Forget everything but the value (a new INIT starts the key's rounds afresh)."""
        self.spare: np.ndarray | None = None  # a free buffer of the value's size, for the next merge
        self.spare_tokens: list[Token] = []  # replies that may still read ``spare``
        self.digests: dict[tuple[int, int], bytes] = {}  # payload digests of value ranges already sent
        self.tokens: list[Token] = []
        self.error = ""  # why the last round's update failed; pulls report it
        self.expected: dict[int, int] = {}  # sync: the push number of each worker in this round (default 1)
        self.got: dict[int, int] = {}  # sync: elements of each worker's current push merged so far
        self.merge: np.ndarray | None = None
        self.rows: list[tuple[np.ndarray, np.ndarray]] = []  # sync: this round's pushed (ids, rows), unmerged
        self.width = 0  # row width of this round's row pushes
        self.deferred: list[Op] = []  # parts of later pushes, and pulls that wait for a push
        self.assembling: dict[tuple[int, int], list] = {}  # async: (worker, seq) -> [buffer, elements]
        self.applied: dict[int, int] = {}  # async: every push of the worker up to this number is applied
        self.finished: dict[int, set[int]] = {}  # async: applied pushes above ``applied``

    def busy(self) -> bool:
        """True while a reply that reads the value may still be in ZeroMQ's hands."""
        return any(t.busy() for t in self.tokens)


_CHUNK_BYTES = 8 * 1024 * 1024  # larger sums are cut into pieces this big, summed on several cores


def _combine(target: np.ndarray, grad: np.ndarray, op: Op, add: bool) -> None:
    """``target += grad`` (or ``target[:] = grad``), in pieces on several cores when large (NumPy releases
    the GIL).  A worker's shared-memory pages are unmapped as each piece is consumed, so that reading a push
    does not grow this process's resident set by the push's size."""
    shared = op.src if op.src is not None and grad is op.array else None
    itemsize = grad.dtype.itemsize
    step = max(1, _CHUNK_BYTES // itemsize)

    def piece(lo: int) -> None:
        hi = min(grad.size, lo + step)
        t, g = target[lo:hi], grad[lo:hi]
        if add:
            np.add(t, g, out=t)
        else:
            np.copyto(t, g)
        if shared is not None:
            shared[0].drop_pages(shared[1] + lo * itemsize, (hi - lo) * itemsize)

    if grad.size <= step:
        piece(0)
    else:
        for future in [_math().submit(piece, lo) for lo in range(0, grad.size, step)]:
            future.result()


class KeyHost(Protocol):
    """What the key state machines need from the server that owns them (:class:`hora.kvstore.ps.server.Server`
    implements it): the job's shape and updater, replies, buffers, and the backlog it bounds."""

    sync: bool  # dist_sync (True) or dist_async
    num_workers: int
    departed: set[int]  # ranks of workers that closed their store
    updater: Any  # the server-side optimizer, or None
    decompressor: Any  # gradient decompression, or None

    def reply(self, op: Op, *, error: str = "", arrays: Sequence[np.ndarray] = (),
              digests: Sequence[bytes | None] | None = None, token: SendToken | None = None,
              extra: dict[str, Any] | None = None) -> None:
        """Answer ``op`` (from any thread)."""

    def release(self, nbytes: int) -> None:
        """Done with ``nbytes`` of request data counted in the backlog."""

    def keep(self, array: np.ndarray) -> np.ndarray:
        """A received array the key may keep as its value."""

    def new_array(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A zeroed buffer for a value or a merge."""

    def copy_array(self, array: np.ndarray) -> np.ndarray:
        """A copy of a value, placed as :meth:`new_array` would place it."""

    def answer_shared(self, k: KeyState, op: Op) -> bool:
        """Answer a pull through shared memory; False when it must go through the socket."""

    def digest(self, array: np.ndarray) -> bytes:
        """The payload digest of a stored array."""

    def worker_name(self, rank: int) -> str:
        """How errors name worker ``rank``."""


class Keys:
    """The key table of one server and the pool that runs its state machines."""

    def __init__(self, server: KeyHost, threads: int) -> None:
        self.server = server
        self.table: dict[str, KeyState] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hora-ps-key")
        self.updater_lock = threading.Lock()

    def submit(self, name: str, op: Op | Callable[[], None]) -> None:
        """Queue an operation (or a callable) on a key; only the event loop calls this."""
        k = self.table.get(name)
        if k is None:
            k = self.table[name] = KeyState(name)
        with k.lock:
            k.inbox.append(op)
            if k.running:
                return
            k.running = True
        self.pool.submit(self._drain, k)

    def each(self, fn: Callable[[KeyState], None]) -> None:
        """Queue ``fn(key)`` on every key, in order with the key's other operations."""
        for name, k in list(self.table.items()):
            self.submit(name, lambda k=k: fn(k))

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _drain(self, k: KeyState) -> None:
        while True:
            with k.lock:
                if not k.inbox:
                    k.running = False
                    return
                op = k.inbox.popleft()
            try:
                if isinstance(op, Op):
                    self._handle(k, op)
                else:
                    op()
            except Exception as e:  # a bug must not take the key down silently
                log.exception("server: operation on key %r failed", k.name)
                if isinstance(op, Op):
                    self.server.reply(op, error=f"server error on key {k.name!r}: {type(e).__name__}: {e}")
            finally:
                if isinstance(op, Op):
                    op.drop_pages()
                    self.server.release(op.held)  # merged, or parked for a later round
                    op.held = 0

    # --- operations ---------------------------------------------------------------------------------
    def _handle(self, k: KeyState, op: Op) -> None:
        server = self.server
        if op.cmd is Cmd.INIT:
            self._init(k, op)
            return
        value = k.value
        if value is None:
            server.reply(op, error=f"key {op.key!r} was not initialised: call init() on every worker first")
            return
        if op.cmd in (Cmd.ROW_PUSH, Cmd.ROW_PULL):
            self._rows(k, op)
            return
        length = op.length if op.cmd is Cmd.PULL else (op.z if op.z >= 0 else op.array.size)
        if op.n != value.size or op.off < 0 or length < 0 or op.off + length > value.size:
            server.reply(op, error=f"key {op.key!r}: elements [{op.off}, {op.off + length}) of a {op.n}-element "
                                   f"shard do not fit the {value.size} elements this server holds (was the key "
                                   "initialised with another shape?)")
            return
        if op.cmd is Cmd.PULL:
            if server.sync and k.error:
                server.reply(op, error=k.error)
            elif self._pull_ready(k, op):
                self._answer_pull(k, op)
            elif server.sync and not self._round_can_complete(k):
                server.reply(op, error=self._departed_error(k))
            else:
                k.deferred.append(op)
        elif server.sync:
            self._push_sync(k, op, length)
        else:
            self._push_async(k, op, length)

    def _init(self, k: KeyState, op: Op) -> None:
        part = op.array
        if op.off < 0 or op.off + part.size > op.n:
            self.server.reply(op, error=f"init of key {op.key!r}: elements [{op.off}, {op.off + part.size}) "
                                        f"exceed its {op.n}")
            return
        if op.off == 0 and part.size == op.n:
            value = self.server.keep(part)
        else:
            if k.init_buf is None or k.init_buf.size != op.n or k.init_buf.dtype != part.dtype:
                k.init_buf, k.init_got = self.server.new_array(op.n, part.dtype), 0
            k.init_buf[op.off:op.off + part.size] = part
            k.init_got += part.size
            if k.init_got < op.n:
                self.server.reply(op)
                return
            value, k.init_buf = k.init_buf, None
        for pending in k.deferred:
            if pending.cmd in _PULLS:
                self.server.reply(pending, error=f"key {op.key!r} was initialised again while this pull waited")
        k.value = value
        k.reset()
        self.server.reply(op)

    def _pull_ready(self, k: KeyState, op: Op) -> bool:
        if self.server.sync:
            return op.seq < k.expected.get(op.worker, 1)
        return op.seq <= k.applied.get(op.worker, 0)

    def _push_sync(self, k: KeyState, op: Op, length: int) -> None:
        server, w = self.server, op.worker
        expected = k.expected.get(w, 1)
        if op.seq != expected:
            if op.seq > expected:
                op.detach()
                k.deferred.append(op)
            server.reply(op)  # a part of an older (already merged) or a later push: the data is safe with us
            return
        grad = self._gradient(k, op, length)
        if grad is None:
            return
        n = k.value.size  # type: ignore[union-attr]
        first = k.merge is None and op.off == 0 and length == n  # a whole push opening the round: copied in
        if k.merge is None:
            k.merge = self._buffer(k, zero=not first)
        _combine(k.merge[op.off:op.off + length], grad, op, add=not first)
        k.got[w] = k.got.get(w, 0) + length
        server.reply(op)
        if all(k.got.get(r, -1) >= n for r in range(server.num_workers)):
            self._finish_round(k)
        else:
            self.check_departed(k)

    def _push_async(self, k: KeyState, op: Op, length: int) -> None:
        server, w = self.server, op.worker
        if server.updater is None:
            server.reply(op, error="dist_async applies every push through the optimizer on the servers: call "
                                   "kv.set_optimizer(...) before pushing (MXNet's server aborts here)")
            return
        grad = self._gradient(k, op, length)
        if grad is None:
            return
        n = k.value.size  # type: ignore[union-attr]
        if length < n:  # one part of a bigger push: gather the push, apply it once complete
            slot = k.assembling.get((w, op.seq))
            if slot is None:
                slot = k.assembling[(w, op.seq)] = [np.empty(n, k.value.dtype), 0]  # type: ignore[union-attr]
            slot[0][op.off:op.off + length] = grad
            slot[1] += length
            if slot[1] < n:
                server.reply(op)
                return
            del k.assembling[(w, op.seq)]
            grad = slot[0]
        server.reply(op, error=self._apply(k, grad, merged=False))
        self._applied(k, op)

    def _applied(self, k: KeyState, op: Op) -> None:
        """async: push ``op.seq`` of its worker is applied; answer the pulls that waited for it."""
        done = k.finished.setdefault(op.worker, set())
        done.add(op.seq)
        applied = k.applied.get(op.worker, 0)
        while applied + 1 in done:
            applied += 1
            done.discard(applied)
        k.applied[op.worker] = applied
        self._retry_deferred(k)

    # --- row_sparse keys (hora.kvstore.ps.rows) ------------------------------------------------------
    def _rows(self, k: KeyState, op: Op) -> None:
        """A ROW_PUSH or ROW_PULL: checked against the stored value, then merged, applied or answered."""
        server, value, ids, w = self.server, k.value, op.ids, op.width
        why = ""
        if op.n != value.size or w <= 0 or value.size % w:  # type: ignore[union-attr]
            why = (f"rows of width {w} of a {op.n}-element shard do not fit the {value.size} elements this server "
                   "holds (was the key initialised with another shape?)")  # type: ignore[union-attr]
        elif ids.dtype != np.int64 or (ids.size and (ids.min() < 0 or ids.max() >= value.size // w)):  # type: ignore
            why = f"row ids must be int64 in [0, {value.size // w})"  # type: ignore[union-attr]
        elif op.cmd is Cmd.ROW_PUSH and (op.array.size != ids.size * w or op.array.dtype != value.dtype):  # type: ignore
            why = (f"{ids.size} rows of width {w} need {ids.size * w} {value.dtype} values, got "  # type: ignore
                   f"{op.array.size} {op.array.dtype}")  # type: ignore[union-attr]
        if why:
            server.reply(op, error=f"key {op.key!r}: {why}")
            return
        if op.cmd is Cmd.ROW_PULL:
            if server.sync and k.error:
                server.reply(op, error=k.error)
            elif self._pull_ready(k, op):
                server.reply(op, arrays=(np.take(value.reshape(-1, w), ids, axis=0).reshape(-1),))  # type: ignore
            elif server.sync and not self._round_can_complete(k):
                server.reply(op, error=self._departed_error(k))
            else:
                k.deferred.append(op)
            return
        from hora.kvstore.ps.rows import apply_rows

        if server.sync:
            expected = k.expected.get(op.worker, 1)
            if op.seq != expected:
                if op.seq > expected:
                    k.deferred.append(op)
                server.reply(op)
                return
            if k.rows and k.width != w:
                server.reply(op, error=f"key {op.key!r}: rows of width {w} pushed in a round of width {k.width}")
                return
            k.rows.append((ids, op.array))  # type: ignore[arg-type]
            k.width = w
            k.got[op.worker] = value.size  # type: ignore[union-attr]
            server.reply(op)
            if all(k.got.get(r, -1) >= value.size for r in range(server.num_workers)):  # type: ignore[union-attr]
                self._finish_round(k)
            else:
                self.check_departed(k)
            return
        if server.updater is None:
            server.reply(op, error="dist_async applies every push through the optimizer on the servers: call "
                                   "kv.set_optimizer(...) before pushing (MXNet's server aborts here)")
            return
        from hora.kvstore.ps.rows import merge_rows

        merged_ids, merged = merge_rows([(ids, op.array)], w, value.dtype)  # type: ignore[list-item,union-attr]
        server.reply(op, error=self._apply_rows(k, merged_ids, merged, w, apply_rows))
        self._applied(k, op)

    def _apply_rows(self, k: KeyState, ids: np.ndarray, rows: np.ndarray, width: int, apply: Any) -> str:
        """Update the stored value's rows through the updater (copy-on-write as :meth:`_apply`)."""
        if k.busy() and not settle(k.tokens, 0.2):
            k.value = self.server.copy_array(k.value)  # type: ignore[arg-type]
        with self.updater_lock:
            k.tokens, k.digests = [], {}
            try:
                apply(self.server.updater, k.name, ids, rows, k.value, width)
            except Exception as e:
                log.warning("server: the optimizer failed on rows of key %r: %s", k.name, e)
                return f"the server optimizer failed on key {k.name!r}: {type(e).__name__}: {e}"
        return ""

    def _merged_rows(self, k: KeyState) -> str:
        """sync: end a round whose pushes were rows: merge them, then apply (or store them, no optimizer)."""
        from hora.kvstore.ps.rows import apply_rows, merge_rows

        value, width = k.value, k.width
        parts, k.rows = k.rows, []
        ids, rows = merge_rows(parts, width, value.dtype)  # type: ignore[union-attr]
        if k.merge is not None or self.server.updater is None:
            # dense pushes in the same round, or no optimizer: the rows join a dense merge
            merged = k.merge if k.merge is not None else self._buffer(k)
            k.merge = None
            merged.reshape(-1, width)[ids] += rows
            return self._apply(k, merged, merged=True)
        return self._apply_rows(k, ids, rows, width, apply_rows)

    def _gradient(self, k: KeyState, op: Op, length: int) -> np.ndarray | None:
        """The pushed part as an array like the stored value (decompressed), or None after an error reply."""
        server, value, part = self.server, k.value, op.array
        if op.z >= 0:
            decoder = server.decompressor
            if decoder is None:
                server.reply(op, error="a compressed push arrived, but no gradient compression was set on the "
                                       "servers")
                return None
            if value.dtype != np.float32:  # type: ignore[union-attr]
                server.reply(op, error=f"key {op.key!r}: compressed push for a {value.dtype} key; compression "
                                       "applies to float32 keys")  # type: ignore[union-attr]
                return None
            try:
                return decoder.decompress(part, length)
            except Exception as e:
                server.reply(op, error=f"key {op.key!r}: cannot decompress the push: {e}")
                return None
        if part.dtype != value.dtype:  # type: ignore[union-attr]
            server.reply(op, error=f"key {op.key!r}: pushed {part.dtype} values but the key holds "
                                   f"{value.dtype}")  # type: ignore[union-attr]
            return None
        return part

    def _buffer(self, k: KeyState, zero: bool = True) -> np.ndarray:
        """A merge buffer (zeroed unless the caller overwrites it): last round's spare when there is one and
        its readers are done (no allocation, no page faults)."""
        value = k.value
        spare, k.spare = k.spare, None
        if (spare is not None and spare.size == value.size and spare.dtype == value.dtype  # type: ignore[union-attr]
                and settle(k.spare_tokens, 1.0)):
            if zero:
                spare.fill(0)
            return spare
        return self.server.new_array(value.size, value.dtype)  # type: ignore[union-attr]

    def _apply(self, k: KeyState, grad: np.ndarray, merged: bool) -> str:
        """Update the stored value with ``grad`` through the updater, or (sync, no updater) make the merged
        ``grad`` the stored value.  Returns an error message, or "" on success."""
        updater = self.server.updater
        if updater is None:
            old, k.value = k.value, grad
            k.spare, k.spare_tokens = old, k.tokens  # replies may still read it: the next merge waits for them
            k.tokens, k.digests = [], {}
            return ""
        if k.busy() and not settle(k.tokens, 0.2):  # a reply still reads the value: update a copy
            k.value = self.server.copy_array(k.value)  # type: ignore[arg-type]
        with self.updater_lock:
            k.tokens, k.digests = [], {}
            try:
                updater(k.name, grad, k.value)
            except Exception as e:
                log.warning("server: the optimizer failed on key %r: %s", k.name, e)
                return f"the server optimizer failed on key {k.name!r}: {type(e).__name__}: {e}"
            finally:
                if merged:
                    k.spare, k.spare_tokens = grad, []
        return ""

    def _finish_round(self, k: KeyState) -> None:
        if k.rows:
            k.error = self._merged_rows(k)
        else:
            merged, k.merge = k.merge, None
            k.error = self._apply(k, merged, merged=True)  # type: ignore[arg-type]
        k.got = {}
        for r in range(self.server.num_workers):
            k.expected[r] = k.expected.get(r, 1) + 1
        self._retry_deferred(k)

    def _retry_deferred(self, k: KeyState) -> None:
        deferred, k.deferred = k.deferred, []
        for op in deferred:
            self._handle(k, op)

    def _answer_pull(self, k: KeyState, op: Op) -> None:
        if op.shm and self.server.answer_shared(k, op):
            return
        view = k.value[op.off:op.off + op.length]  # type: ignore[index]
        digest = k.digests.get((op.off, op.length))
        if digest is None:
            digest = k.digests[(op.off, op.length)] = self.server.digest(view)
        token = SendToken()
        k.tokens = [t for t in k.tokens if t.busy()]
        k.tokens.append(token)
        self.server.reply(op, arrays=(view,), digests=(digest,), token=token)

    # --- departed workers ---------------------------------------------------------------------------
    def _missing(self, k: KeyState) -> list[int]:
        n = k.value.size if k.value is not None else 0
        return sorted(w for w in self.server.departed if k.got.get(w, -1) < n)

    def _round_can_complete(self, k: KeyState) -> bool:
        return not self._missing(k)

    def _departed_error(self, k: KeyState) -> str:
        names = ", ".join(self.server.worker_name(w) for w in self._missing(k))
        return (f"key {k.name!r}: this dist_sync round cannot complete because {names} left the job (closed its "
                "KVStore) without pushing to it")

    def check_departed(self, k: KeyState) -> None:
        """Fail the waiting pulls of a round that a departed worker can no longer complete."""
        if not self.server.sync or k.value is None or self._round_can_complete(k):
            return
        error = self._departed_error(k)
        for op in k.deferred:
            if op.cmd in _PULLS:
                self.server.reply(op, error=error)
        k.deferred = [op for op in k.deferred if op.cmd not in _PULLS]
