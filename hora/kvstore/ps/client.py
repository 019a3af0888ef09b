"""The worker's side of the parameter-server protocol: requests, replies, resends, liveness.

One background thread owns the ZeroMQ sockets (a DEALER to the scheduler and
one to each server).  Callers sign their requests in their own thread (the
hashing of large arrays runs there, in parallel with the network) and queue
them; the thread sends them, matches replies to requests by id, resends
requests that stay unanswered (after ``HORA_PS_RESEND_TIMEOUT_MS``, doubling
each time, plus time for the bytes to travel), heartbeats the scheduler, and
fails every pending and later request with a clear error when a node is lost.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from hora.config import PSConfig
from hora.errors import HoraError, PeerLostError, PSError
from hora.kvstore.ps import wire
from hora.kvstore.ps.link import SCHEDULER_ID, SchedulerLink, lost_error
from hora.kvstore.ps.net import DropLog, Wakeup, job_key, make_socket, send
from hora.kvstore.ps.wire import Cmd, Message, WireError

log = logging.getLogger(__name__)

SCHEDULER = -1  # ``dst`` of requests to the scheduler; servers are 0..S-1
_BYTES_PER_S = 100e6  # resend allowance for the time a large request spends on the wire
_INLINE_BYTES = 64 * 1024  # smaller replies are verified on the network thread itself


class Pending:
    """An unanswered request; :meth:`wait` returns the reply or raises the error."""

    __slots__ = ("rid", "dst", "frames", "nbytes", "event", "reply", "error", "deadline", "attempts")

    def __init__(self, rid: int, dst: int) -> None:
        self.rid, self.dst = rid, dst
        self.frames: list | None = None
        self.nbytes = 0
        self.event = threading.Event()
        self.reply: Message | None = None
        self.error: HoraError | None = None
        self.deadline = float("inf")
        self.attempts = 0

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self) -> Message:
        """Block until answered; raises the server's error or the job's failure."""
        self.event.wait()
        if self.error is not None:
            raise copy.copy(self.error)
        return self.reply  # type: ignore[return-value]


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
        for addr in self.server_addrs:
            sock = make_socket(self.ctx, zmq.DEALER, identity=self.id.encode())
            sock.connect(addr)
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
        self._thread = threading.Thread(target=self._loop, name=f"hora-ps-worker-{self.rank}", daemon=True)
        self._thread.start()
        self._started = True

    @property
    def num_servers(self) -> int:
        return len(self.servers)

    def node_name(self, node_id: str) -> str:
        return self.nodes.get(node_id, node_id)

    # --- requests (any thread) ----------------------------------------------------------------------
    def request(self, dst: int, cmd: Cmd, fields: dict[str, Any], arrays: Sequence[np.ndarray] = (),
                force: bool = False) -> Pending:
        """Sign and queue a request to server ``dst`` (or :data:`SCHEDULER`).

        Raises:
            HoraError: the job already failed, or the store is closed.
        """
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
                    while self.link.sock.poll(0):
                        msg = self.link.receive(self.link.sock.recv_multipart(copy=False))
                        if msg is not None:
                            self._on_scheduler(msg)
                for j, sock in enumerate(self.servers):
                    if sock in events:
                        while sock.poll(0):
                            self._on_server(j, sock.recv_multipart(copy=False))
                self._wake.clear()
                now = time.monotonic()
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
        resend = self.config.resend_timeout_ms / 1000
        if resend:
            p.deadline = now + resend * (2 ** min(p.attempts, 10)) + p.nbytes / _BYTES_PER_S

    def _resolve(self, rid: int, reply: Message | None, error: HoraError | None) -> None:
        with self._lock:
            p = self._pending.pop(rid, None)
        if p is None:
            return  # a duplicate answer to a resent request
        p.reply, p.error = reply, error
        p.event.set()

    def _fail(self, error: HoraError) -> None:
        with self._lock:
            if self._fatal is None:
                self._fatal = error
            pending = list(self._pending.values())
            self._pending.clear()
        for p in pending:
            p.error = self._fatal
            p.event.set()

    def _on_scheduler(self, msg: Message) -> None:
        if msg.cmd in (Cmd.BARRIER_DONE, Cmd.BYE):
            error = msg.header.get("e", "")
            self._resolve(msg["i"], msg, PSError(error) if error else None)
        elif msg.cmd is Cmd.NODE_LOST:
            self._fail(lost_error(msg))
        elif msg.cmd is Cmd.WORKER_LEFT:
            log.info("worker %d: %s left the job", self.rank, msg["node"])

    def _on_server(self, j: int, frames: list) -> None:
        if sum(len(f) for f in frames) < _INLINE_BYTES:
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
