"""The worker's side of the parameter-server protocol: requests, replies, resends, liveness.

One background thread owns the ZeroMQ sockets (a DEALER to the scheduler and
one to each server).  Callers sign their requests in their own thread (the
hashing of large arrays runs there, in parallel with the network) and queue
them; the thread sends them, matches replies to requests by id, resends
requests that stay unanswered (after ``HORA_PS_RESEND_TIMEOUT_MS``, doubling
each time, plus time for the bytes to travel), heartbeats the scheduler, and
fails every pending and later request with a clear error when a node is lost.

With a co-located server that passed the shared-memory handshake
(:mod:`hora.kvstore.ps.shm`), large pushes are written into segments of this
worker (at most two per key and server, each reused once its push was
answered), and pull replies name a range of a server segment, which the
caller copies out and then releases (the network thread batches the
``RELEASE`` messages).
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from hora.config import PSConfig
from hora.errors import ConfigError, HoraError, PeerLostError, PSError
from hora.kvstore.ps import secure, shm, wire
from hora.kvstore.ps.link import SCHEDULER_ID, SchedulerLink, lost_error
from hora.kvstore.ps.net import DropLog, Receiver, Wakeup, job_key, make_socket, send
from hora.kvstore.ps.wire import Cmd, Message, WireError

log = logging.getLogger(__name__)

SCHEDULER = -1  # ``dst`` of requests to the scheduler; servers are 0..S-1
_BYTES_PER_S = 10e6  # resend allowance for a large request's time on the wire: a 100 Mbit/s link
_INLINE_BYTES = 64 * 1024  # smaller replies are verified on the network thread itself
_PUSH_BUFFERS = 2  # shared-memory push segments per key and server: one in flight while the next is filled
_TURN_FRAMES = 1 << 16  # frames read from one server per loop turn


class Pending:
    """An unanswered request; :meth:`wait` returns the reply or raises the error."""

    __slots__ = ("rid", "dst", "frames", "nbytes", "event", "reply", "error", "deadline", "attempts", "callbacks")

    _callback_lock = threading.Lock()  # orders add_done_callback against _settle

    def __init__(self, rid: int, dst: int) -> None:
        self.rid, self.dst = rid, dst
        self.frames: list | None = None
        self.nbytes = 0
        self.event = threading.Event()
        self.reply: Message | None = None
        self.error: HoraError | None = None
        self.deadline = float("inf")
        self.attempts = 0
        self.callbacks: list[Callable[[Pending], None]] | None = None

    def done(self) -> bool:
        return self.event.is_set()

    def add_done_callback(self, fn: Callable[[Pending], None]) -> None:
        """Call ``fn(self)`` once the request is answered or failed: at once (in this thread) when it already
        is, else in the thread that settles it (the network thread, or a reply-verifying one), which must
        not block: ``fn`` may only copy, release and signal."""
        with Pending._callback_lock:
            if not self.event.is_set():
                if self.callbacks is None:
                    self.callbacks = []
                self.callbacks.append(fn)
                return
        fn(self)

    def _settle(self, reply: Message | None, error: HoraError | None) -> None:
        """Record the outcome, wake waiters and run the callbacks (once; later calls do nothing)."""
        with Pending._callback_lock:
            if self.event.is_set():
                return
            self.reply, self.error = reply, error
            self.event.set()
            callbacks, self.callbacks = self.callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # a callback's bug must not take the network thread down
                log.exception("a callback of request %d failed", self.rid)

    def wait(self) -> Message:
        """Block until answered; raises the server's error or the job's failure."""
        self.event.wait()
        if self.error is not None:
            raise copy.copy(self.error)
        return self.reply  # type: ignore[return-value]


class PushBuffer:
    """A shared-memory segment this worker pushes a key's shard through; busy until the push is answered."""

    __slots__ = ("segment", "array", "pending", "reserved")

    def __init__(self, segment: shm.Segment, array: np.ndarray) -> None:
        self.segment, self.array = segment, array
        self.pending: Pending | None = None
        self.reserved = True

    def free(self) -> bool:
        return not self.reserved and (self.pending is None or self.pending.done())

    def ref(self) -> list[Any]:
        """The header's ``m`` field naming the whole buffer."""
        return shm.make_ref(self.segment, 0, self.array.size, self.array.dtype)

    def hold(self, pending: Pending | None) -> None:
        """Mark the buffer busy until ``pending`` is answered (None: it was not sent after all)."""
        self.pending, self.reserved = pending, False


class Client:
    """A worker's connection to the job.  :attr:`rank`, :attr:`num_workers` and the server count
    are known once the constructor returns (it blocks until every role has joined)."""

    def __init__(self, config: PSConfig, mode: str) -> None:
        config.require_job()
        self.config = config
        self.key = job_key(config)
        self.ctx = zmq.Context()
        self._started = False
        try:
            self.link = SchedulerLink(self.ctx, config, self.key, "worker", rank_hint=config.worker_rank
                                      if config.worker_rank is not None else -1, mode=mode)
            welcome = self.link.register()
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.id: str = welcome["id"]
        self.rank: int = welcome["rank"]
        self.num_workers: int = welcome["num_workers"]
        self.sync: bool = welcome["sync"]
        self.server_addrs: list[str] = [str(a) for a in welcome["servers"]]
        self.nodes: dict[str, str] = {str(k): str(v) for k, v in welcome["nodes"].items()}
        self.servers = []
        creds = secure.credentials(self.key, config.encrypt)
        for addr in self.server_addrs:
            # Replies answer this worker's own requests, from servers that proved the job's credentials:
            # their number is bounded by the requests in flight, so the queue is not.
            sock = make_socket(self.ctx, zmq.DEALER, identity=self.id.encode(),
                               max_bytes=max(config.max_frame_bytes, wire.MAX_HEADER) + 64)
            secure.secure_connect(sock, creds, addr)
            self.servers.append(sock)
        self._lock = threading.Lock()
        self._next_id = 1
        self._pending: dict[int, Pending] = {}  # insertion order == id order, so the first is the lowest
        self._outq: collections.deque[Pending] = collections.deque()
        self._wake = Wakeup()
        self._fatal: HoraError | None = None
        self._scheduler_lost = False
        self._stop = False
        self._closed = False
        self.drops = DropLog(f"worker {self.rank}")
        self._receivers = [Receiver(sock, wire.MAX_FRAMES, self.drops, f"server {j}")
                           for j, sock in enumerate(self.servers)]
        self.shm_token = shm.job_token(self.key, self.link.endpoint)
        self.shm_ok = [False] * len(self.servers)  # per server: shares memory with this worker
        self.mapped = shm.Mappings(self.shm_token)  # the servers' value segments
        self._push_buffers: dict[tuple[int, str], list[PushBuffer]] = {}
        self._shm_push_off = False  # set when a segment could not be created
        self._releases: dict[int, list[int]] = {}  # server -> ids of pulls whose shared-memory replies were read
        #: bytes this worker sent to and received from the servers' sockets (frames, resends included)
        self.traffic = {"sent": 0, "received": 0}
        self._thread = threading.Thread(target=self._loop, name=f"hora-ps-worker-{self.rank}", daemon=True)
        self._thread.start()
        self._started = True
        if config.shm and shm.available():
            self._shm_handshake()

    @property
    def num_servers(self) -> int:
        return len(self.servers)

    # --- shared memory ------------------------------------------------------------------------------
    def _shm_handshake(self) -> None:
        """Ask every server whether it shares memory with this worker; see :mod:`hora.kvstore.ps.shm`."""
        shm.reap()  # segments of earlier jobs on this host whose processes were all killed
        try:
            probe, nonce = shm.make_probe(self.shm_token)
        except OSError as e:
            log.info("worker %d: no shared memory (%s); every payload goes through the socket", self.rank, e)
            return
        try:
            fields = {"who": shm.identity(), "probe": probe.name, "nonce": nonce.hex()}
            pending = [self.request(j, Cmd.SHM_HELLO, fields) for j in range(self.num_servers)]
            for j, p in enumerate(pending):
                try:
                    h = p.wait().header
                except HoraError as e:
                    log.debug("worker %d: shared-memory handshake with server %d failed: %s", self.rank, j, e)
                    continue
                if h.get("ok") is not True:
                    log.debug("worker %d: server %d keeps the socket path: %s", self.rank, j, h.get("why"))
                    continue
                try:
                    shm.check_probe(self.shm_token, h.get("probe"), h.get("nonce"))
                    self.shm_ok[j] = True
                except shm.ShmError as e:
                    log.debug("worker %d: server %d keeps the socket path: %s", self.rank, j, e)
                finally:
                    shm.remove(self.shm_token, h.get("probe"))
        finally:
            probe.unlink()
            probe.close()
        if any(self.shm_ok):
            shm.raise_fd_limit()
            log.debug("worker %d shares memory with servers %s", self.rank,
                      [j for j, ok in enumerate(self.shm_ok) if ok])

    def shm_usable(self, dst: int, nbytes: int) -> bool:
        """Whether ``nbytes`` to or from server ``dst`` should travel through shared memory."""
        return self.shm_ok[dst] and nbytes >= self.config.shm_min_bytes

    def push_buffer(self, dst: int, key: str, count: int, dtype: np.dtype) -> PushBuffer | None:
        """A free shared-memory buffer for ``count`` elements of ``key`` to server ``dst``, reserved for the
        caller (who fills it, sends the request and calls :meth:`PushBuffer.hold`); None when this push
        must go through the socket (no shared memory with that server, too small, or both buffers busy)."""
        dtype = np.dtype(dtype)
        if self._shm_push_off or not self.shm_usable(dst, count * dtype.itemsize):
            return None
        with self._lock:
            pool = self._push_buffers.setdefault((dst, key), [])
            stale = [b for b in pool if b.array.size != count or b.array.dtype != dtype]
            if stale:  # the key was initialised again with another shape
                pool[:] = [b for b in pool if b not in stale]
            for b in pool:
                if b.free():
                    b.reserved = True
                    return b
            if len(pool) >= _PUSH_BUFFERS:
                return None
        for b in stale:
            b.segment.unlink()
            b.segment.close()
        try:
            seg = shm.Segment.create(self.shm_token, count * dtype.itemsize)
        except OSError as e:
            log.warning("worker %d: cannot create a shared-memory segment of %d bytes (%s); from now on this worker "
                        "pushes through the socket (is /dev/shm full or small?)", self.rank, count * dtype.itemsize, e)
            self._shm_push_off = True
            return None
        buf = PushBuffer(seg, seg.array(dtype, count))
        with self._lock:
            self._push_buffers[(dst, key)].append(buf)
        return buf

    def shared_view(self, dst: int, key: str, msg: Message, dtype: np.dtype, count: int) -> np.ndarray:
        """The values a shared-memory pull reply of server ``dst`` names (read-only; release the reply
        with :meth:`release` once copied out).

        Raises:
            shm.ShmError: the reference is bad, or its dtype or size is not what was asked for.
        """
        view, _, _, _ = self.mapped.view((dst, key), msg.header.get("m"))
        if view.dtype != dtype or view.size != count:
            raise shm.ShmError(f"the reply names {view.dtype}[{view.size}], expected {dtype}[{count}]")
        return view

    def release(self, dst: int, msg: Message) -> None:
        """Tell server ``dst`` (soon, batched) that this worker is done reading a shared-memory reply."""
        with self._lock:
            self._releases.setdefault(dst, []).append(msg["i"])
        self._wake.set()

    def _send_releases(self) -> None:
        with self._lock:
            releases, self._releases = self._releases, {}
        for dst, rids in releases.items():
            for i in range(0, len(rids), 1024):
                header = {"c": int(Cmd.RELEASE), "s": self.id, "d": f"s{dst}", "r": rids[i:i + 1024]}
                send(self.servers[dst], wire.encode(header, (), self.key))

    def node_name(self, node_id: str) -> str:
        return self.nodes.get(node_id, node_id)

    # --- requests (any thread) ----------------------------------------------------------------------
    def request(self, dst: int, cmd: Cmd, fields: dict[str, Any], arrays: Sequence[np.ndarray] = (),
                force: bool = False) -> Pending:
        """Sign and queue a request to server ``dst`` (or :data:`SCHEDULER`).

        Raises:
            HoraError: the job already failed, or the store is closed.
            ConfigError: an array is larger than ``HORA_PS_MAX_FRAME_BYTES``.
            PSError: more arrays than one message carries.
        """
        if len(arrays) > wire.MAX_FRAMES - 2:
            raise PSError(f"{cmd.name}: {len(arrays)} arrays in one message; a message carries at most "
                          f"{wire.MAX_FRAMES - 2} (a server drops longer ones unread)")
        too_big = [a.nbytes for a in arrays if a.nbytes > self.config.max_frame_bytes]
        if too_big:
            raise ConfigError(f"{cmd.name}: an array of {max(too_big)} bytes exceeds HORA_PS_MAX_FRAME_BYTES="
                              f"{self.config.max_frame_bytes}, the largest frame a server accepts; raise it on "
                              "every role")
        with self._lock:
            if not force:
                self.check()
            rid = self._next_id
            self._next_id += 1
            p = self._pending[rid] = Pending(rid, dst)
            lowest = next(iter(self._pending))
        header = {"c": int(cmd), "s": self.id, "d": SCHEDULER_ID if dst == SCHEDULER else f"s{dst}", "i": rid,
                  "a": lowest, **fields}
        p.frames = wire.encode(header, arrays, self.key)
        p.nbytes = sum(a.nbytes for a in arrays)
        self._outq.append(p)
        self._wake.set()
        return p

    def call(self, dst: int, cmd: Cmd, fields: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> Message:
        """:meth:`request` and wait for the reply."""
        return self.request(dst, cmd, fields, arrays).wait()

    def check(self) -> None:
        """Raise the job's failure, if any (also after :meth:`close`)."""
        if self._fatal is not None:
            raise copy.copy(self._fatal)
        if self._closed:
            raise PSError("this KVStore is closed")

    def close(self, goodbye_timeout: float = 5.0) -> None:
        """Say goodbye to the scheduler (so the job can end cleanly) and stop the network thread.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._started and self._thread.is_alive() and not self._scheduler_lost:
            p = self.request(SCHEDULER, Cmd.GOODBYE, {}, force=True)
            p.event.wait(min(goodbye_timeout, self.config.timeout_s))
        self._stop = True
        self._wake.set()
        if self._started:
            self._thread.join(10)
        if self._thread.is_alive():
            self.ctx.destroy(linger=0)
        else:
            self.ctx.term()
        self._wake.close()
        with self._lock:
            buffers = [b for pool in self._push_buffers.values() for b in pool]
            self._push_buffers.clear()
        for b in buffers:
            b.segment.unlink()
        self.mapped.close()
        shm.cleanup(self.shm_token)

    # --- the network thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.link.sock, zmq.POLLIN)
        for sock in self.servers:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        resend = self.config.resend_timeout_ms / 1000
        tick_ms = max(1, int(min(self.config.heartbeat_s / 2, resend / 2 if resend else 1.0) * 1000))
        try:
            while not self._stop:
                events = dict(poller.poll(tick_ms))
                if self.link.sock in events:
                    for msg in self.link.incoming():
                        self._on_scheduler(msg)
                for j, sock in enumerate(self.servers):
                    if sock in events:
                        for frames in self._receivers[j].messages(_TURN_FRAMES):
                            self._on_server(j, frames)
                self._wake.clear()
                now = time.monotonic()
                if self._releases:
                    self._send_releases()
                while self._outq:
                    p = self._outq.popleft()
                    if self._pending.get(p.rid) is p:
                        self._send(p, now)
                if not self._scheduler_lost:
                    try:
                        self.link.tick(now)
                    except PeerLostError as e:
                        self._scheduler_lost = True
                        self._fail(e)
                if resend:
                    for p in [p for p in list(self._pending.values()) if now >= p.deadline]:
                        p.attempts += 1
                        log.debug("worker %d: resending request %d (attempt %d)", self.rank, p.rid, p.attempts)
                        self._send(p, now)
        except Exception as e:  # a bug here must surface in the caller, not as a hang
            log.exception("worker %d: the parameter-server network thread failed", self.rank)
            self._fail(PSError(f"the parameter-server network thread of worker {self.rank} failed: {e}"))
        finally:
            self._fail(PSError("this KVStore is closed"))
            for sock in (self.link.sock, *self.servers):
                sock.close(linger=0 if self._fatal is not None and self._scheduler_lost else 1000)

    def _send(self, p: Pending, now: float) -> None:
        sock = self.link.sock if p.dst == SCHEDULER else self.servers[p.dst]
        send(sock, p.frames)  # type: ignore[arg-type]
        if p.dst != SCHEDULER:
            self.traffic["sent"] += sum(f.nbytes if hasattr(f, "nbytes") else len(f) for f in p.frames)  # type: ignore
        resend = self.config.resend_timeout_ms / 1000
        if resend:
            p.deadline = now + resend * (2 ** min(p.attempts, 10)) + p.nbytes / _BYTES_PER_S

    def _resolve(self, rid: int, reply: Message | None, error: HoraError | None) -> None:
        with self._lock:
            p = self._pending.pop(rid, None)
        if p is None:
            return  # a duplicate answer to a resent request
        p._settle(reply, error)

    def _fail(self, error: HoraError) -> None:
        with self._lock:
            if self._fatal is None:
                self._fatal = error
            pending = list(self._pending.values())
            self._pending.clear()
        for p in pending:
            p._settle(None, self._fatal)

    def _on_scheduler(self, msg: Message) -> None:
        if msg.cmd in (Cmd.BARRIER_DONE, Cmd.BYE):
            error = msg.header.get("e", "")
            self._resolve(msg["i"], msg, PSError(error) if error else None)
        elif msg.cmd is Cmd.NODE_LOST:
            self._fail(lost_error(msg))
        elif msg.cmd is Cmd.WORKER_LEFT:
            log.info("worker %d: %s left the job", self.rank, msg["node"])

    def _on_server(self, j: int, frames: list) -> None:
        size = sum(len(f) for f in frames)
        self.traffic["received"] += size
        if size < _INLINE_BYTES:
            self._reply(j, frames)
        else:  # verify large replies in parallel; replies are matched by id, so their order does not matter
            wire.decode_pool().submit(self._reply, j, frames)

    def _reply(self, j: int, frames: list) -> None:
        try:
            msg = wire.decode(frames, self.key)
            if msg.cmd is not Cmd.REPLY or msg["s"] != f"s{j}" or msg["d"] != self.id:
                raise WireError(f"{msg.cmd.name} from {msg['s']!r} to {msg['d']!r} on the socket of server {j}")
        except WireError as e:
            self.drops.drop(e, f"server {j}")
            return
        except Exception as e:  # a bug: fail the job rather than leave a caller waiting
            log.exception("worker %d: decoding a reply failed", self.rank)
            self._fail(PSError(f"worker {self.rank} could not decode a reply of server {j}: {e}"))
            return
        error = msg["e"]
        self._resolve(msg["i"], msg, PSError(f"{self.node_name(f's{j}')}: {error}") if error else None)
