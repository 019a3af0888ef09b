"""A parameter server: holds a shard of the keys and applies the workers' pushes.

The event loop (one thread) owns the sockets: it authenticates and checks
every message (:func:`~hora.kvstore.ps.wire.decode`), drops bad ones without
touching any state, de-duplicates requests, and hands key operations to the
per-key state machines of :mod:`hora.kvstore.ps.keys`, which run on a thread
pool and post their replies back through an outbox.

De-duplication: every worker numbers its requests and tells the server, in
each header, the lowest request id it still waits for (``a``).  The server
remembers the reply of every state-changing request (init, push, set_*) at or
above that mark, so a resent request is answered again but applied only once;
a request below the mark is stale (or replayed) and is dropped.  Pushes carry
their push number and pulls the number of the push they follow, so the order
in which requests arrive does not matter: large messages are verified on a
thread pool, several at a time, and handled as each verification ends.  At
most a few messages per worker are read ahead (``RCVHWM``, and a bound on the
verifications in flight), so unread pushes wait in the workers, not here.

Co-located workers that passed the shared-memory handshake (``SHM_HELLO``,
see :mod:`hora.kvstore.ps.shm`) push by naming a range of their own segment;
the server maps it (then removes its name), sums straight out of it and
answers.  Its values then live in segments of its own, and a pull that asks
for it is answered with a reference; the buffer counts the pull as a reader
until the worker releases it (``RELEASE`` names the pull's request id) once
it has copied the values out.
"""

from __future__ import annotations

import collections
import logging
import os
import resource
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from hora.config import PSConfig
from hora.errors import ConfigError, PSError
from hora.kvstore.ps import secure, shm, wire
from hora.kvstore.ps.keys import Keys, KeyState, Op, SendToken, ShmToken
from hora.kvstore.ps.link import SchedulerLink, lost_error
from hora.kvstore.ps.net import DropLog, Receiver, Wakeup, bind_address, job_key, make_socket, peer_address, send
from hora.kvstore.ps.wire import Cmd, Message, WireError

log = logging.getLogger(__name__)

_KEY_CMDS = (Cmd.INIT, Cmd.PUSH, Cmd.PULL, Cmd.ROW_PUSH, Cmd.ROW_PULL)
_INLINE_BYTES = 64 * 1024  # smaller requests are verified on the event loop itself
_BACKLOG_BYTES = 32 * 1024 * 1024  # stop reading requests while this much data waits to be verified or merged
_MUTATING = (Cmd.INIT, Cmd.PUSH, Cmd.ROW_PUSH, Cmd.SET_OPTIMIZER, Cmd.SET_COMPRESSION, Cmd.SET_STATES)
_WORKER_CMDS = (*_KEY_CMDS, Cmd.SET_OPTIMIZER, Cmd.SET_COMPRESSION, Cmd.GET_STATES, Cmd.SET_STATES, Cmd.SHM_HELLO,
                Cmd.RELEASE)
_MAX_RELEASE = 4096  # pull ids one RELEASE may name, and released ids remembered per worker
_TURN_MESSAGES = 64  # requests read per loop turn, so replies and heartbeats are not starved...
_TURN_FRAMES = 1 << 16  # ...nor by a message of many frames, which is read (or discarded) over several turns


class _Requests:
    """One worker's recent requests: the replies of state-changing ones, and the stale mark."""

    __slots__ = ("floor", "replies")

    def __init__(self) -> None:
        self.floor = 0
        self.replies: dict[int, list | None] = {}  # request id -> reply frames (None: not answered yet)

    def advance(self, floor: int) -> None:
        if floor > self.floor:
            self.floor = floor
            if len(self.replies) > 256:
                self.replies = {i: r for i, r in self.replies.items() if i >= floor}


class Server:
    """Runs the server role until the job ends; :meth:`run` returns the process exit code."""

    def __init__(self, config: PSConfig) -> None:
        config.require_job()
        self.config = config
        self.key = job_key(config)
        self.ctx = zmq.Context(io_threads=2)
        # Read at most a few messages ahead of each worker: unread pushes wait in the worker (its own copy)
        # instead of piling up here, so the server holds its keys, one merge buffer each, and little else.
        self.router = make_socket(self.ctx, zmq.ROUTER, rcvhwm=2,
                                  max_bytes=max(config.max_frame_bytes, wire.MAX_HEADER) + 64)
        creds = secure.credentials(self.key, config.encrypt)
        secure.secure_listener(self.router, creds)
        self.auth = secure.Authenticator(self.ctx, creds, "server", self.router)
        address = bind_address(config)
        try:
            port = self.router.bind_to_random_port(f"tcp://{address}")
        except zmq.ZMQError as e:
            self.auth.stop()
            self.ctx.destroy(linger=0)
            raise ConfigError(f"the server cannot bind an address on {address}: {e}") from e
        self.addr = f"tcp://{address}:{port}"
        self.link = SchedulerLink(self.ctx, config, self.key, "server", addr=self.addr,
                                  rank_hint=-1 if config.server_index is None else config.server_index)
        # shared memory with co-located workers (hora.kvstore.ps.shm)
        self.shm_token = shm.job_token(self.key, self.link.endpoint)
        self.shm_on = config.shm and shm.available()
        self.shm_peers: set[int] = set()  # workers that passed the handshake
        self.mapped = shm.Mappings(self.shm_token)  # the workers' push segments
        self.buffers = shm.Buffers(self.shm_token)  # values and merge buffers, when some worker shares memory
        self.shm_tokens: dict[tuple[int, int], list[ShmToken]] = {}  # (worker, pull id) -> its readers
        self.shm_released: dict[int, collections.OrderedDict[int, None]] = collections.defaultdict(
            collections.OrderedDict)  # worker -> recently released pull ids (a late resend is not answered)
        self._shm_lock = threading.Lock()
        self.shm_counts = {"pushes": 0, "pulls": 0}  # requests whose payload went through shared memory
        self._shm_alloc_failed = False
        if self.shm_on:
            shm.reap()  # segments of earlier jobs on this host whose processes were all killed
        self.id = ""
        self.sync = True
        self.num_workers = config.num_workers or 1
        self.nodes: dict[str, str] = {}
        self.updater: Any = None
        self.decompressor: Any = None
        self.departed: set[int] = set()
        self.requests: dict[int, _Requests] = collections.defaultdict(_Requests)
        self.decoded: collections.deque[tuple[bytes, list, tuple[Message, int] | WireError, int]] = (
            collections.deque())
        self.decoding = 0  # messages being verified on the decode pool
        self.backlog = 0  # bytes of requests read but not yet handled (in verification or queued on a key)
        self._backlog_lock = threading.Lock()
        self.outbox: collections.deque[tuple[bytes, list, SendToken | None, tuple[int, int] | None]] = (
            collections.deque())
        self.wake = Wakeup()
        self.drops = DropLog("server")
        self.receiver = Receiver(self.router, wire.MAX_FRAMES, self.drops)
        threads = config.server_threads or min(8, os.cpu_count() or 2)
        self.keys = Keys(self, threads)
        self.max_decoding = 4 * threads
        self._sent_replies = 0

    # --- lifecycle --------------------------------------------------------------------------------
    def run(self) -> int:
        """Join the job and serve it: 0 when the scheduler stops the job, 1 when it died."""
        try:
            welcome = self.link.register()
            self.id, self.sync = welcome["id"], welcome["sync"]
            self.num_workers = welcome["num_workers"]
            self.nodes = {str(k): str(v) for k, v in welcome["nodes"].items()}
            log.info("%s serving at %s (%s, %d workers)", self.name, self.addr,
                     "sync" if self.sync else "async", self.num_workers)
            return self._loop()
        except PSError as e:
            log.error("server at %s: %s", self.addr, e)
            return 1
        finally:
            if self.drops.total:
                log.info("%s: dropped %d bad messages in all", self.name, self.drops.total)
            if self.auth.refusals.total:
                log.info("%s: refused %d connections at the handshake in all", self.name, self.auth.refusals.total)
            log.info("%s: %d of %d workers shared memory; %d pushes and %d pulls went through it", self.name,
                     len(self.shm_peers), self.num_workers, self.shm_counts["pushes"], self.shm_counts["pulls"])
            self._log_memory()
            self.keys.shutdown()
            self.link.close()
            self.router.close(linger=1000)
            self.wake.close()
            self.ctx.term()
            self.buffers.close()
            self.mapped.close()
            shm.cleanup(self.shm_token)

    def _log_memory(self) -> None:
        stored = sum(k.value.nbytes for k in list(self.keys.table.values()) if k.value is not None)
        log.info("%s: peak RSS %d bytes for %d bytes of stored values", self.name, _peak_rss(), stored)

    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.link.sock, zmq.POLLIN)
        poller.register(self.wake.fd, zmq.POLLIN)
        beat_ms = max(1, int(self.config.heartbeat_s * 1000 / 2))
        while True:
            poller.modify(self.router, zmq.POLLIN if self._can_read() else 0)
            events = dict(poller.poll(beat_ms))
            if self.link.sock in events:
                for msg in self.link.incoming():
                    code = self._on_scheduler(msg)
                    if code is not None:
                        self._flush()
                        return code
            if self.router in events and self._can_read():
                for n, frames in enumerate(self.receiver.messages(_TURN_FRAMES), 1):
                    self._on_request(frames[0].bytes, frames[1:])
                    if n >= _TURN_MESSAGES or not self._can_read():
                        break
            self.wake.clear()
            while self.decoded:
                route, frames, result, nbytes = self.decoded.popleft()
                self.decoding -= 1
                self._accept(route, frames, result, nbytes)
            self._flush()
            try:
                self.link.tick(time.monotonic())
            except PSError as e:
                log.error("%s: %s; exiting", self.name, e)
                return 1

    def _can_read(self) -> bool:
        """Whether to read more requests: a bounded number in verification, a bounded backlog of bytes."""
        return self.decoding < self.max_decoding and self.backlog < _BACKLOG_BYTES

    def _admit(self, nbytes: int) -> None:
        with self._backlog_lock:
            self.backlog += nbytes

    def release(self, nbytes: int) -> None:
        """A key state machine is done with ``nbytes`` of request data (any thread)."""
        if nbytes:
            with self._backlog_lock:
                self.backlog -= nbytes
                wake = self.backlog < _BACKLOG_BYTES <= self.backlog + nbytes
            if wake:
                self.wake.set()

    def _on_scheduler(self, msg: Message) -> int | None:
        if msg.cmd is Cmd.STOP:
            log.debug("%s: the job is over; exiting", self.name)
            return 0
        if msg.cmd is Cmd.NODE_LOST:
            log.error("%s: %s; exiting", self.name, lost_error(msg))
            return 1
        if msg.cmd is Cmd.WORKER_LEFT:
            self.departed.add(msg["rank"])
            self.keys.each(self.keys.check_departed)
        return None

    # --- requests ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.nodes.get(self.id, f"server at {self.addr}")

    def worker_name(self, rank: int) -> str:
        return self.nodes.get(f"w{rank}", f"worker {rank}")

    def _on_request(self, route: bytes, frames: list) -> None:
        nbytes = sum(len(f) for f in frames[1:-1])
        self._admit(nbytes)
        if nbytes < _INLINE_BYTES:
            self._accept(route, frames, self._decode(route, frames), nbytes)
            return
        self.decoding += 1

        def done(future: Any) -> None:
            self.decoded.append((route, frames, future.result(), nbytes))
            self.wake.set()

        wire.decode_pool().submit(self._decode, route, frames).add_done_callback(done)

    def _decode(self, route: bytes, frames: list) -> tuple[Message, int] | WireError:
        """Authenticate and check a request (on any thread): the message and its worker, or why it is bad."""
        try:
            msg = wire.decode(frames, self.key)
            return msg, self._check_sender(route, msg)
        except WireError as e:
            return e
        except Exception as e:  # a bug: still answer the loop, which counts on every decode ending
            log.exception("%s: decoding a request failed", self.name)
            return WireError(f"internal error while decoding: {e}")

    def _accept(self, route: bytes, frames: list, result: tuple[Message, int] | WireError, nbytes: int) -> None:
        """Bookkeeping and dispatch of a verified request (event loop only).  The key state machine that
        takes a pushed array releases its ``nbytes`` of backlog; every other outcome releases them here."""
        if not self._dispatch(route, frames, result, nbytes):
            self.release(nbytes)

    def _dispatch(self, route: bytes, frames: list, result: tuple[Message, int] | WireError, nbytes: int) -> bool:
        """Handle a verified request; True when a key state machine took its array."""
        if isinstance(result, WireError):
            self.drops.drop(result, peer_address(frames[0]) if frames else "?")
            return False
        msg, worker = result
        if msg.cmd is Cmd.RELEASE:
            self._release(worker, msg["r"])
            return False
        rid = msg["i"]
        book = self.requests[worker]
        book.advance(msg["a"])
        if rid < book.floor:
            self.drops.drop(f"stale request {rid} from worker {worker} (below {book.floor})", "worker")
            return False
        if msg.cmd in _MUTATING:
            if rid in book.replies:  # resent: answer again once answered, never apply twice
                if book.replies[rid] is not None:
                    send(self.router, book.replies[rid], route)
                return False
            book.replies[rid] = None
        h = msg.header
        if msg.cmd in (Cmd.INIT, Cmd.PUSH):
            op = Op(msg.cmd, worker, rid, route, h["k"], msg.arrays[0] if msg.arrays else None, seq=h.get("seq", 0),
                    off=h["off"], n=h["n"], z=h.get("z", -1), held=nbytes)
            if h.get("m") is not None and not self._map_push(op, h["m"]):
                return False
            self.keys.submit(h["k"], op)
            return True
        if msg.cmd in (Cmd.ROW_PUSH, Cmd.ROW_PULL):  # row_sparse keys: ids (and rows), see hora.kvstore.ps.rows
            rows = msg.arrays[1] if msg.cmd is Cmd.ROW_PUSH else None
            self.keys.submit(h["k"], Op(msg.cmd, worker, rid, route, h["k"], rows, seq=h.get("seq", h.get("after", 0)),
                                        n=h["n"], held=nbytes if rows is not None else 0, ids=msg.arrays[0],
                                        width=h["w"]))
            return msg.cmd is Cmd.ROW_PUSH
        if msg.cmd is Cmd.PULL:
            self.keys.submit(h["k"], Op(Cmd.PULL, worker, rid, route, h["k"], seq=h["after"], off=h["off"],
                                        length=h["len"], n=h["n"], shm=h.get("m") is True))
            return False
        op = Op(msg.cmd, worker, rid, route, "")
        if msg.cmd is Cmd.SHM_HELLO:
            self._shm_hello(op, msg)
            return False
        if msg.cmd is Cmd.SET_OPTIMIZER:
            self._set_optimizer(op, msg["spec"])
        elif msg.cmd is Cmd.SET_COMPRESSION:
            self._set_compression(op, msg["spec"])
        elif msg.cmd is Cmd.GET_STATES:
            self.keys.pool.submit(self._guarded, op, self._get_states, op)
        else:
            self.keys.pool.submit(self._guarded, op, self._set_states, op, msg)
        return False

    def _guarded(self, op: Op, fn: Any, *args: Any) -> None:
        """Run a pool task; an unexpected failure becomes an error reply instead of vanishing."""
        try:
            fn(*args)
        except Exception as e:
            log.exception("%s: %s failed", self.name, op.cmd.name)
            self.reply(op, error=f"server error in {op.cmd.name}: {type(e).__name__}: {e}")

    def _check_sender(self, route: bytes, msg: Message) -> int:
        src = msg["s"]
        if msg.cmd not in _WORKER_CMDS:
            raise WireError(f"unexpected command {msg.cmd.name} from {src!r}")
        if msg["d"] != self.id or route != src.encode() or not src.startswith("w") or not src[1:].isdigit():
            raise WireError(f"{msg.cmd.name} from {src!r} (route {route!r:.20}) addressed to {msg['d']!r}")
        worker = int(src[1:])
        if worker >= self.num_workers:
            raise WireError(f"{msg.cmd.name} from unknown worker {worker}")
        if msg.cmd in _KEY_CMDS and msg.arrays and msg.arrays[0].ndim != 1:
            raise WireError(f"{msg.cmd.name}: key arrays travel flat, got shape {msg.arrays[0].shape}")
        return worker

    # --- shared memory ------------------------------------------------------------------------------
    def _shm_hello(self, op: Op, msg: Message) -> None:
        """The handshake: same host identity, and the worker's probe holds the nonce it announced; then
        our own probe (a fresh one, which the worker removes once it has checked it)."""
        why = ""
        if not self.shm_on:
            why = "shared memory is off on this server (HORA_PS_SHM=0, or no /dev/shm)"
        elif msg["who"] != shm.identity():
            why = "the worker is on another host, user or pid namespace"
        else:
            try:
                shm.check_probe(self.shm_token, msg["probe"], msg["nonce"])
                probe, nonce = shm.make_probe(self.shm_token)
            except (shm.ShmError, OSError) as e:
                why = f"the shared-memory probe failed: {e}"
        if why:
            log.debug("%s: %s keeps the socket path: %s", self.name, self.worker_name(op.worker), why)
            self.reply(op, extra={"ok": False, "why": why})
            return
        probe.close()
        if not self.shm_peers:
            shm.raise_fd_limit()
        self.shm_peers.add(op.worker)
        log.debug("%s: %s shares memory with this server", self.name, self.worker_name(op.worker))
        self.reply(op, extra={"ok": True, "probe": probe.name, "nonce": nonce.hex()})

    def _map_push(self, op: Op, ref: Any) -> bool:
        """Resolve the shared-memory range a push or init names into ``op.array``; a bad reference is
        refused (error reply, nothing changes)."""
        try:
            if op.worker not in self.shm_peers:
                raise shm.ShmError("this worker did not pass the shared-memory handshake")
            if op.array is not None:
                raise shm.ShmError("the message carries both a payload frame and a shared-memory range")
            array, seg, offset, _ = self.mapped.view((op.worker, op.key), ref)
        except shm.ShmError as e:
            log.debug("%s: refusing %s of %s: %s", self.name, op.cmd.name, self.worker_name(op.worker), e)
            self.reply(op, error=f"{op.cmd.name} of key {op.key!r} refused: {e}")
            return False
        seg.unlink()  # mapped: the name is no longer needed, and a crash can no longer leak the memory
        op.array, op.src = array, (seg, offset)
        self.shm_counts["pushes"] += 1
        return True

    def _release(self, worker: int, rids: list) -> None:
        """A worker finished reading the shared-memory replies to these pulls: every reply to each of them
        (a resent pull may have been answered twice; the worker read one answer and ignored the others)."""
        with self._shm_lock:
            released = self.shm_released[worker]
            for rid in rids[:_MAX_RELEASE]:
                if not isinstance(rid, int) or isinstance(rid, bool):
                    continue
                released[rid] = None
                for token in self.shm_tokens.pop((worker, rid), ()):
                    token.released = True
                    seg = token.segment
                    seg.seen_by.add(worker)
                    if self.shm_peers <= seg.seen_by:
                        seg.unlink()  # every co-located worker has mapped it
            while len(released) > _MAX_RELEASE:
                released.popitem(last=False)

    def keep(self, array: np.ndarray) -> np.ndarray:
        """A received array the server may keep and write as a key's value: the frame itself when
        possible, a copy in shared memory when some worker reads values that way, else a private copy."""
        if self.shm_peers:
            out = self.new_array(array.size, array.dtype)
            np.copyto(out, array)
            return out
        return array if array.flags.writeable and array.flags.aligned else array.copy()

    def new_array(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A zeroed buffer for a value or a merge: in shared memory when some worker shares memory."""
        shared = self._shared_array(count, dtype) if self.shm_peers else None
        return shared if shared is not None else np.zeros(count, dtype)

    def _shared_array(self, count: int, dtype: np.dtype) -> np.ndarray | None:
        try:
            return self.buffers.alloc(count, np.dtype(dtype))
        except OSError as e:
            if not self._shm_alloc_failed:
                self._shm_alloc_failed = True
                log.warning("%s: cannot allocate %d bytes of shared memory (%s); such values stay in private "
                            "memory and their pulls go through the socket (is /dev/shm full or small?)",
                            self.name, count * np.dtype(dtype).itemsize, e)
            return None

    def copy_array(self, array: np.ndarray) -> np.ndarray:
        """A copy of a value, where :meth:`new_array` would put it."""
        out = self.new_array(array.size, array.dtype)
        np.copyto(out, array)
        return out

    def answer_shared(self, k: KeyState, op: Op) -> bool:
        """Answer a pull with a reference into the value's segment (moving the value into shared memory
        first when it is not there yet); False when this pull must go through the socket."""
        if op.worker not in self.shm_peers or k.value is None:
            return False
        seg = self.buffers.segment_of(k.value)
        if seg is None:
            moved = None if self._shm_alloc_failed else self._shared_array(k.value.size, k.value.dtype)
            seg = self.buffers.segment_of(moved)
            if seg is None:
                return False
            np.copyto(moved, k.value)
            k.value, k.tokens = moved, []  # the old buffer keeps only its in-flight replies, which hold it
        value = k.value
        with self._shm_lock:
            if op.rid in self.shm_released[op.worker]:
                return True  # a resent pull whose answer the worker has read already: it expects nothing more
            token = ShmToken(op.worker, seg)
            self.shm_tokens.setdefault((op.worker, op.rid), []).append(token)
            self.shm_counts["pulls"] += 1
        k.tokens = [t for t in k.tokens if t.busy()]
        k.tokens.append(token)
        self.reply(op, extra={"m": shm.make_ref(seg, op.off * value.dtype.itemsize, op.length, value.dtype)})
        return True

    def _set_optimizer(self, op: Op, spec: dict[str, Any]) -> None:
        from hora.kvstore.optimizer import create_updater

        try:
            updater = create_updater(spec)
        except Exception as e:
            self.reply(op, error=f"bad optimizer spec: {e}")
            return
        with self.keys.updater_lock:
            self.updater = updater
        log.debug("%s: optimizer set: %s", self.name, spec.get("type"))
        self.reply(op)

    def _set_compression(self, op: Op, spec: dict[str, Any] | None) -> None:
        from hora.kvstore.compression import decompressor_from_spec

        try:
            self.decompressor = decompressor_from_spec(spec)
        except Exception as e:
            self.reply(op, error=f"bad gradient-compression spec: {e}")
            return
        self.reply(op)

    def _get_states(self, op: Op) -> None:
        if self.updater is None:
            self.reply(op, error="no optimizer is set on the servers: call set_optimizer() first")
            return
        names, arrays = [], []
        with self.keys.updater_lock:
            for name, k in sorted(self.keys.table.items()):
                if k.value is None:
                    continue
                for state, value in self.updater.key_states(name).items():
                    names.append([name, state])
                    arrays.append(np.asarray(value))
        self.reply(op, arrays=arrays, extra={"names": names})

    def _set_states(self, op: Op, msg: Message) -> None:
        names = msg["names"]
        if self.updater is None:
            self.reply(op, error="no optimizer is set on the servers: call set_optimizer() first")
            return
        if len(names) != len(msg.arrays) or not all(
                isinstance(n, list) and len(n) == 2 and all(isinstance(x, str) for x in n) for n in names):
            self.reply(op, error="malformed optimizer states: names do not match the arrays")
            return
        states: dict[str, dict[str, np.ndarray]] = {}
        for (key, state), array in zip(names, msg.arrays, strict=True):
            states.setdefault(key, {})[state] = array
        with self.keys.updater_lock:
            for key, arrays in states.items():
                self.updater.set_key_states(key, arrays)
        self.reply(op)

    # --- replies ----------------------------------------------------------------------------------
    def digest(self, array: np.ndarray) -> bytes:
        """Payload digest of a stored array (cached by the key until the value changes)."""
        return wire.payload_digest(array)

    def reply(self, op: Op, *, error: str = "", arrays: Sequence[np.ndarray] = (),
              digests: Sequence[bytes | None] | None = None, token: SendToken | None = None,
              extra: dict[str, Any] | None = None) -> None:
        """Answer a request (from any thread): signed here, sent by the event loop."""
        too_big = [a.nbytes for a in arrays if a.nbytes > self.config.max_frame_bytes]
        if too_big:
            arrays, digests = (), None
            error = (f"{op.cmd.name}: an array of {max(too_big)} bytes exceeds HORA_PS_MAX_FRAME_BYTES="
                     f"{self.config.max_frame_bytes}, the largest frame a worker accepts; raise it on every role")
        header = {"c": int(Cmd.REPLY), "s": self.id, "d": f"w{op.worker}", "i": op.rid, "e": error,
                  **(extra or {})}
        frames = wire.encode(header, arrays, self.key, digests)
        remember = (op.worker, op.rid) if op.cmd in _MUTATING else None
        self.outbox.append((op.route, frames, token, remember))
        self.wake.set()

    def _flush(self) -> None:
        drop_every = self.config.test_drop_reply_every
        while self.outbox:
            route, frames, token, remember = self.outbox.popleft()
            if remember is not None:
                book = self.requests[remember[0]]
                if remember[1] in book.replies:
                    book.replies[remember[1]] = frames
            self._sent_replies += 1
            if drop_every and self._sent_replies % drop_every == 0:
                log.debug("%s: dropping reply %d (HORA_PS_TEST_DROP_REPLY_EVERY)", self.name, self._sent_replies)
                if token is not None:
                    token.sent = True
                continue
            if token is not None and len(frames) == 3 and frames[1].nbytes >= zmq.COPY_THRESHOLD:
                frame = zmq.Frame(wire.bytes_view(frames[1]), copy=False, track=True)
                token.tracker = frame.tracker
                frames = [frames[0], frame, frames[2]]
            send(self.router, frames, route)
            if token is not None:
                token.sent = True


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM: unlike ru_maxrss it does not carry over the
    parent's peak across fork and exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_server(config: PSConfig) -> int:
    """Run a server until the job ends; returns its exit code."""
    return Server(config).run()

