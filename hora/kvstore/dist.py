"""``dist_sync``, ``dist_device_sync`` and ``dist_async``: the KVStore on parameter servers.

A worker process joins the job when it creates the store (it blocks until
the scheduler has seen every role).  Servers and the scheduler are separate
processes (``hora run -np W -s S``, or ``python -m hora.kvstore.ps.node``
with the ``DMLC_*`` environment).  As in MXNet, a process whose ``DMLC_ROLE``
is ``server`` or ``scheduler`` that creates a dist store runs that role
instead and exits when the job ends.

Semantics (MXNet's, with the differences noted):

* ``init``: every worker calls it with the same keys; worker 0's values are
  stored, and every worker returns once they are on the servers.
* ``push`` returns as soon as the request is queued (the data is copied, so
  the caller may reuse its arrays); requests to many keys and servers are in
  flight together.  Several values for a key are summed first, on the host
  (``dist_sync``) or with torch on the values' device (``dist_device_sync``).
* ``pull`` blocks until the values are in ``out`` and always sees this
  worker's earlier pushes of the key: in ``dist_sync`` the result of the round
  they belong to, in ``dist_async`` a value they have been applied to.
* ``pushpull_async`` pushes, sends the pull and returns a ticket: its
  ``on_ready`` callback says when the values are here (without blocking
  anyone), its ``finish`` copies them out.  Framework bindings run it on
  their engines (``hora.mxnet``) so that communication overlaps compute.
* ``barrier`` first waits until this worker's pushes reached the servers.
* An error a server reports for a push is raised by the next ``pull`` of that
  key, ``barrier`` or push.  A lost node raises
  :class:`~hora.errors.PeerLostError` from every pending and later call.

Transport: with a server on the same host (and user), a shard of at least
``HORA_PS_SHM_MIN_BYTES`` travels through shared memory: a push is copied
(summed) once, into a segment the server reads, and a pull copies straight
out of the server's segment into ``out`` (:mod:`hora.kvstore.ps.shm`).
Otherwise it travels through the socket, in parts of ``HORA_PS_PART_BYTES``.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora.config import PSConfig
from hora.errors import ConfigError, PSError
from hora.kvstore.base import Array, Key, KVStore
from hora.kvstore.ps import states as ps_states
from hora.kvstore.ps.client import SCHEDULER, Client, Pending, PushBuffer
from hora.kvstore.ps.placement import Shard, parts, place
from hora.kvstore.ps.shm import ShmError
from hora.kvstore.ps.wire import DTYPES, Cmd

log = logging.getLogger(__name__)

_open: DistKVStore | None = None
_joined = False  # a worker process joins one job once


@dataclasses.dataclass(slots=True)
class _KeyInfo:
    shape: tuple[int, ...]
    dtype: np.dtype
    shards: list[Shard]

    @property
    def width(self) -> int:
        """Elements per row (the first dimension indexes the rows of a row_sparse key)."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) >= 2 else 1

    @property
    def numel(self) -> int:
        return self.shards[-1].hi if self.shards else 0


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _host(x: Array) -> np.ndarray:
    """A NumPy view of a CPU array or tensor, or a host copy of a device tensor."""
    if not _is_torch(x):
        return np.asarray(x)
    t = x.detach()
    if str(t.dtype).removeprefix("torch.") not in DTYPES:
        raise ConfigError(f"{t.dtype} values are not supported by the dist KVStore; use one of "
                          f"{', '.join(DTYPES)} (e.g. cast bfloat16 to float32)")
    return t.cpu().numpy()


def _dtype(x: Array) -> str:
    return str(x.dtype).removeprefix("torch.")


class DistKVStore(KVStore):
    """The parameter-server KVStore (create it with ``hora.kvstore.create('dist_sync')``)."""

    def __init__(self, kv_type: str, config: PSConfig | None = None) -> None:
        global _open, _joined
        super().__init__(kv_type)
        config = config or PSConfig.from_env()
        if config.role != "worker":
            from hora.kvstore.ps.node import run_role

            raise SystemExit(run_role(config))  # MXNet: a server/scheduler process never returns to the script
        if _open is not None:
            raise ConfigError(f"this process already has an open {_open.type!r} KVStore; a worker joins the "
                              "parameter-server job once: reuse that store")
        if _joined:
            raise PSError("this process already closed its dist KVStore, which ended its part in the job; a worker "
                          "joins the parameter-server job once")
        self._client = Client(config, kv_type)
        _open, _joined = self, True
        self._closed = False
        self._bound = config.bigarray_bound
        self._part_bytes = config.part_bytes
        self._keys: dict[str, _KeyInfo] = {}
        self._seq: dict[str, int] = {}  # number of this worker's last push of each key
        self._inflight: list[tuple[str, Pending]] = []
        self._lock = threading.Lock()  # pushes may come from several threads (e.g. autograd hooks)
        self._compressor: Any = None
        self._optimizer_set = False
        self._barrier_seq = 0
        self._spec: dict[str, Any] | None = None
        atexit.register(self.close)

    # --- identity ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._client.rank

    @property
    def num_workers(self) -> int:
        return self._client.num_workers

    @property
    def num_servers(self) -> int:
        """Number of servers in the job."""
        return self._client.num_servers

    @property
    def traffic(self) -> dict[str, int]:
        """Bytes this worker has sent to and received from the servers' sockets so far (shared-memory
        payloads excluded: they never touch a socket)."""
        return dict(self._client.traffic)

    # --- data -------------------------------------------------------------------------------------
    def _init(self, keys: list[str], values: list[Array]) -> None:
        client = self._client
        client.check()
        hosts = []
        for key, value in zip(keys, values, strict=True):
            host = _host(value)
            shape = tuple(int(s) for s in host.shape)
            width = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) >= 2 else 1
            # cut on row boundaries, so that a row_sparse push or pull of a row goes to one server
            self._keys[key] = _KeyInfo(shape, host.dtype, place(key, host.size, client.num_servers, self._bound,
                                                                max(width, 1)))
            hosts.append(host)
        with self._lock:
            for key in keys:
                self._seq[key] = 0  # the servers restart a key's push numbers at init
        if self.rank == 0:
            pending = []
            for key, host in zip(keys, hosts, strict=True):
                flat = np.ascontiguousarray(host).reshape(-1)
                for s in self._keys[key].shards:
                    buf = client.push_buffer(s.server, key, s.size, flat.dtype)
                    if buf is not None:
                        np.copyto(buf.array, flat[s.lo:s.hi])
                        pending.append(self._send_shared(buf, s.server, Cmd.INIT, {"k": key, "off": 0, "n": s.size}))
                        continue
                    for off, length in parts(s.size, flat.itemsize, self._part_bytes):
                        pending.append(client.request(s.server, Cmd.INIT, {"k": key, "off": off, "n": s.size},
                                                      (flat[s.lo + off:s.lo + off + length],)))
            for p in pending:
                p.wait()
        self._barrier()

    def _push(self, keys: list[str], values: list[list[Array]], priority: int) -> None:
        client = self._client
        client.check()
        self._raise_push_errors(None)
        if not client.sync and not self._optimizer_set:
            raise ConfigError("dist_async applies every push through the optimizer on the servers: call "
                              "kv.set_optimizer(...) first (MXNet's server aborts here)")
        for key, vals in zip(keys, values, strict=True):
            info = self._info(key)
            self._check_values(key, vals, info)
            with self._lock:
                seq = self._seq[key] = self._seq.get(key, 0) + 1
            compress = self._compressor is not None and info.dtype == np.float32
            flat: np.ndarray | None = None  # the summed values in a private array (the socket path sends it)
            source: np.ndarray | None = None  # the summed values, possibly the caller's own array
            for s in info.shards:
                buf = None if compress else client.push_buffer(s.server, key, s.size, info.dtype)
                if buf is not None:  # shared memory: sum straight into the segment the server reads
                    try:
                        if source is None:
                            source = _host(vals[0]).reshape(-1) if len(vals) == 1 else self._summed(key, vals, info)
                        np.copyto(buf.array, source[s.lo:s.hi])
                    except BaseException:
                        buf.hold(None)
                        raise
                    p = self._send_shared(buf, s.server, Cmd.PUSH, {"k": key, "seq": seq, "off": 0, "n": s.size,
                                                                    "z": -1})
                    with self._lock:
                        self._inflight.append((key, p))
                    continue
                if flat is None:
                    flat = self._summed(key, vals, info)  # a private copy: the caller may reuse its arrays
                for off, length in parts(s.size, flat.itemsize, self._part_bytes):
                    data, z = flat[s.lo + off:s.lo + off + length], -1
                    if compress:
                        data, z = self._compressor.compress(f"{key}@{s.server}:{off}", data), length
                    p = client.request(s.server, Cmd.PUSH, {"k": key, "seq": seq, "off": off, "n": s.size, "z": z},
                                       (data,))
                    with self._lock:
                        self._inflight.append((key, p))

    def _pull(self, keys: list[str], outs: list[list[Array]], priority: int) -> None:
        for key, key_outs in zip(keys, outs, strict=True):
            self._check_outs(key, key_outs)
        self._pull_start(keys).finish(outs)

    # --- row_sparse keys ------------------------------------------------------------------------------
    def push_rows(self, key: Key, row_ids: Array, rows: Array) -> None:
        """Push a row_sparse gradient of ``key``: only the rows ``row_ids`` (``rows[i]`` is row ``row_ids[i]``).

        Repeated ids are summed first.  Each server holding a part of the key
        gets the ids and rows of its part (an empty push where none fall in it,
        which still counts as this worker's push in a ``dist_sync`` round).  The
        servers merge the round's rows and apply them (see
        :mod:`hora.kvstore.ps.rows`).  Returns once the requests are queued.

        Raises:
            ConfigError: the key was not initialised as a matrix, ids are out of range, or rows do not fit.
        """
        from hora.kvstore.ps.rows import merge_rows

        client = self._client
        client.check()
        self._raise_push_errors(None)
        name = self._key(key)
        info = self._info(name)
        if not client.sync and not self._optimizer_set:
            raise ConfigError("dist_async applies every push through the optimizer on the servers: call "
                              "kv.set_optimizer(...) first (MXNet's server aborts here)")
        ids, width = self._row_ids(name, info, row_ids, "push"), info.width
        data = _host(rows)
        if data.dtype != info.dtype or data.size != ids.size * width:
            raise ConfigError(f"row push of key {name!r}: {ids.size} row ids need rows of {info.dtype.name}"
                              f"{[ids.size, *info.shape[1:]]}, got {data.dtype.name}{list(data.shape)}")
        # (merge_rows returns new arrays: the caller may reuse its own at once)
        ids, data = merge_rows([(ids, data.reshape(-1, width))], width, info.dtype)
        with self._lock:
            seq = self._seq[name] = self._seq.get(name, 0) + 1
        for s, lo, hi in self._row_parts(info, ids):
            p = client.request(s.server, Cmd.ROW_PUSH, {"k": name, "seq": seq, "n": s.size, "w": width},
                               (ids[lo:hi] - s.lo // width, data[lo:hi].reshape(-1)))
            with self._lock:
                self._inflight.append((name, p))

    def pull_rows(self, key: Key, row_ids: Array) -> tuple[np.ndarray, np.ndarray]:
        """The stored rows ``row_ids`` of ``key``, after this worker's pushes of it (MXNet's row_sparse_pull).

        Returns ``(ids, rows)``: the sorted unique ids (duplicates asked for
        once, as MXNet does) and an array of shape ``(len(ids), *shape[1:])``.
        Rows nobody pushed hold their initial value.  Only these rows travel.
        """
        client = self._client
        client.check()
        name = self._key(key)
        info = self._info(name)
        ids, width = np.unique(self._row_ids(name, info, row_ids, "pull")), info.width
        after = self._seq.get(name, 0)
        requests = [(lo, hi, client.request(s.server, Cmd.ROW_PULL, {"k": name, "after": after, "n": s.size,
                                                                       "w": width}, (ids[lo:hi] - s.lo // width,)))
                    for s, lo, hi in self._row_parts(info, ids) if hi > lo]
        out = np.empty((ids.size, width), info.dtype)
        for lo, hi, p in requests:
            msg = p.wait()
            value = msg.arrays[0] if msg.arrays else None
            self._check_pulled(name, value, info, (hi - lo) * width)
            out[lo:hi] = value.reshape(-1, width)  # type: ignore[union-attr]
        self._raise_push_errors({name})
        return ids, out.reshape((ids.size, *info.shape[1:]))

    def row_sparse_pull(self, key: Key, out: Array, row_ids: Array) -> None:
        """Fill ``out`` (the key's full shape) with the stored rows ``row_ids`` and zeros elsewhere, as a
        row_sparse ``out`` of MXNet's ``row_sparse_pull`` reads when made dense; only those rows travel."""
        ids, rows = self.pull_rows(key, row_ids)
        info = self._info(self._key(key))
        if tuple(int(d) for d in out.shape) != info.shape:
            raise ConfigError(f"row_sparse_pull of key {key!r}: out has shape {tuple(out.shape)} but the key holds "
                              f"{info.shape}")
        full = np.zeros(info.shape, info.dtype)
        full[ids] = rows
        _copy_into(out, full)

    def _row_ids(self, name: str, info: _KeyInfo, row_ids: Array, what: str) -> np.ndarray:
        if len(info.shape) < 2:
            raise ConfigError(f"row {what} of key {name!r}: rows need a key of 2 or more dimensions, it holds "
                              f"{info.shape}")
        ids = _host(row_ids).reshape(-1)
        if ids.dtype.kind not in "iu" and not (ids.size == 0 or np.all(ids == np.round(ids))):
            raise ConfigError(f"row {what} of key {name!r}: row ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= info.shape[0]):
            raise ConfigError(f"row {what} of key {name!r}: row ids must lie in [0, {info.shape[0]}), got "
                              f"[{ids.min()}, {ids.max()}]")
        return ids

    @staticmethod
    def _row_parts(info: _KeyInfo, ids: np.ndarray) -> list[tuple[Shard, int, int]]:
        """Per shard, the range of the sorted ``ids`` that fall in it (shards are cut on row boundaries)."""
        width = info.width
        return [(s, int(np.searchsorted(ids, s.lo // width)), int(np.searchsorted(ids, s.hi // width)))
                for s in info.shards]

    def pushpull_async(self, key: Key | Sequence[Key], value: Array | Sequence[Array],
                       priority: int = 0) -> PullTicket:
        """Push ``value`` and ask for the key's next value, without waiting: the returned ticket's
        :meth:`~PullTicket.finish` copies it into arrays of the key's size.

        The push behaves as :meth:`push` (the caller may reuse ``value`` once this returns);
        :meth:`PullTicket.on_ready` says when ``finish`` will no longer wait.  The servers' values wait
        for ``finish`` (or :meth:`PullTicket.cancel`), so call one of them exactly once.
        """
        keys, values = self._normalise(key, value, "value")
        self._push(keys, values, priority)
        return self._pull_start(keys)

    def check_arrays(self, key: Key, shape: Sequence[int], dtype: Any, what: str = "pushpull") -> str:
        """Check that arrays of ``shape`` and ``dtype`` fit ``key`` as initialised; returns the key's name.

        Raises:
            ConfigError: the key was not initialised, or the shape or dtype differs (the message says how).
        """
        name = self._key(key)
        info = self._info(name)
        size = int(np.prod(tuple(shape), dtype=np.int64))
        if np.dtype(dtype) != info.dtype or size != info.numel:
            raise ConfigError(f"{what} of key {name!r}: got {np.dtype(dtype).name}{list(shape)} but the key was "
                              f"initialised as {info.dtype.name}{list(info.shape)}")
        return name

    def _check_outs(self, key: str, key_outs: Sequence[Array]) -> None:
        info = self._info(key)
        for out in key_outs:
            if int(np.prod(out.shape)) != info.numel:
                raise ConfigError(f"pull of key {key!r}: out has shape {tuple(out.shape)} but the key holds "
                                  f"{info.shape}")

    def _pull_start(self, keys: list[str]) -> PullTicket:
        """Send the pull requests of ``keys`` (each after this worker's last push of it)."""
        client = self._client
        client.check()
        requests: list[_PullPart] = []
        try:
            for key in keys:
                info = self._info(key)
                after = self._seq.get(key, 0)
                for s in info.shards:
                    if client.shm_usable(s.server, s.size * info.dtype.itemsize):
                        p = client.request(s.server, Cmd.PULL, {"k": key, "after": after, "off": 0, "len": s.size,
                                                                "n": s.size, "m": True})
                        requests.append(_PullPart(key, s, 0, s.size, after, p))
                        continue
                    for off, length in parts(s.size, info.dtype.itemsize, self._part_bytes):
                        p = client.request(s.server, Cmd.PULL, {"k": key, "after": after, "off": off,
                                                                "len": length, "n": s.size})
                        requests.append(_PullPart(key, s, off, length, after, p))
        except BaseException:
            PullTicket(self, keys, requests).cancel()
            raise
        return PullTicket(self, keys, requests)

    # --- control ----------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every worker calls ``barrier`` (this worker's pushes reach the servers first)."""
        self._client.check()
        self._barrier()

    def set_optimizer(self, optimizer: Any) -> None:
        """Run ``optimizer`` on the servers: its spec (plain data) goes to every server.

        Every worker calls this; worker 0 sends, the others wait at a barrier.

        Raises:
            ConfigError: ``optimizer`` is not a hora optimizer, or its spec is invalid.
        """
        from hora.kvstore.optimizer import create_updater

        spec_of = getattr(optimizer, "spec", None)
        if not callable(spec_of):
            raise ConfigError(f"set_optimizer needs a hora.kvstore.optimizer.Optimizer (for example "
                              f"hora.kvstore.optimizer.SGD(...)), got {type(optimizer).__name__}")
        spec = spec_of()
        create_updater(spec)  # raises a clear ConfigError here rather than on the servers
        self._to_servers(Cmd.SET_OPTIMIZER, {"spec": spec})
        self._optimizer_set = True

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress pushes of float32 keys (e.g. ``{'type': '2bit', 'threshold': 0.5}``); servers decode them.

        Every worker calls this; worker 0 tells the servers, the others wait at a barrier.
        """
        from hora.kvstore.compression import create_compressor

        compressor = create_compressor(compression_params)
        self._to_servers(Cmd.SET_COMPRESSION, {"spec": compressor.spec() if compressor is not None else None})
        self._compressor = compressor

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Fetch every key's optimizer state from the servers and write it to ``fname`` (msgpack).

        MXNet cannot do this for a dist store; hora can.  ``dump_optimizer``
        also stores the optimizer's spec, which :meth:`load_optimizer_states`
        then sends to the servers.
        """
        self._client.check()
        self._flush()
        replies = [self._client.request(j, Cmd.GET_STATES, {}) for j in range(self.num_servers)]
        parts: dict[str, dict[int, dict[str, np.ndarray]]] = {}
        for j, p in enumerate(replies):
            msg = p.wait()
            for (key, name), array in zip(msg["names"], msg.arrays, strict=True):
                parts.setdefault(key, {}).setdefault(j, {})[name] = array
        out = {}
        for key, by_server in parts.items():
            info = self._keys.get(key)
            if info is None:
                log.warning("save_optimizer_states: the servers hold key %r, which this worker never initialised; "
                            "its states are not saved", key)
                continue
            out[key] = ps_states.join(info.shape, info.shards, by_server)
        ps_states.write(fname, out, self._spec if dump_optimizer else None)

    def load_optimizer_states(self, fname: str) -> None:
        """Send the states in ``fname`` (from :meth:`save_optimizer_states`) to the servers.

        The keys must be initialised first.  A file saved with
        ``dump_optimizer=True`` also replaces the servers' optimizer.
        """
        self._client.check()
        keys, spec = ps_states.read(fname)
        unknown = sorted(k for k in keys if k not in self._keys)
        if unknown:
            raise ConfigError(f"{fname!r} holds states of keys this store has not initialised: {unknown[:10]}; "
                              "call init() for every key before load_optimizer_states()")
        self._flush()
        if spec is not None:
            for p in [self._client.request(j, Cmd.SET_OPTIMIZER, {"spec": spec}) for j in range(self.num_servers)]:
                p.wait()
            self._optimizer_set = True
        per_server: dict[int, tuple[list, list]] = {j: ([], []) for j in range(self.num_servers)}
        for key, key_states in keys.items():
            info = self._keys[key]
            for server, pieces in ps_states.split(info.shape, info.shards, key_states).items():
                for name, array in pieces.items():
                    per_server[server][0].append([key, name])
                    per_server[server][1].append(array)
        pending = [self._client.request(j, Cmd.SET_STATES, {"names": names}, arrays)
                   for j, (names, arrays) in per_server.items() if names]
        for p in pending:
            p.wait()

    def close(self) -> None:
        """Wait for this worker's pushes, say goodbye to the scheduler, and release the sockets.  Idempotent."""
        global _open
        if self._closed:
            return
        self._closed = True
        try:
            self._flush()
        except Exception as e:  # the job may already be dead; closing must still work
            log.debug("close: pending pushes failed: %s", e)
        self._client.close()
        if _open is self:
            _open = None
        atexit.unregister(self.close)

    # --- helpers ----------------------------------------------------------------------------------
    def _to_servers(self, cmd: Cmd, fields: dict[str, Any]) -> None:
        self._client.check()
        if cmd is Cmd.SET_OPTIMIZER:
            self._spec = fields["spec"]
        if self.rank == 0:
            for p in [self._client.request(j, cmd, fields) for j in range(self.num_servers)]:
                p.wait()
        self._barrier()

    def _barrier(self) -> None:
        self._flush()
        self._barrier_seq += 1
        self._client.call(SCHEDULER, Cmd.BARRIER, {"seq": self._barrier_seq})

    def _flush(self) -> None:
        """Wait until every push of this worker was answered; raise the first error."""
        with self._lock:
            inflight = list(self._inflight)
        for _, p in inflight:
            p.event.wait()
        self._raise_push_errors(None)

    def _raise_push_errors(self, keys: set[str] | None) -> None:
        keep, error = [], None
        with self._lock:
            for key, p in self._inflight:
                if not p.done() or (keys is not None and key not in keys):
                    keep.append((key, p))
                elif p.error is not None and error is None:
                    error = p.error
            self._inflight = keep
        if error is not None:
            raise copy.copy(error)

    def _info(self, key: str) -> _KeyInfo:
        info = self._keys.get(key)
        if info is None:
            raise ConfigError(f"key {key!r} was not initialised: call init() for it on every worker first")
        return info

    def _send_shared(self, buf: PushBuffer, dst: int, cmd: Cmd, fields: dict[str, Any]) -> Pending:
        """Send an init or push whose values are in ``buf`` (a shared-memory segment), keeping it busy until
        the server answers."""
        try:
            p = self._client.request(dst, cmd, {**fields, "m": buf.ref()})
        except BaseException:
            buf.hold(None)
            raise
        buf.hold(p)
        return p

    def _release_unread(self, requests: list[_PullPart]) -> None:
        """A pull failed part-way: let the servers reuse the buffers of shared-memory answers, those here
        and those still to come."""
        client = self._client

        def release(p: Pending) -> None:
            if p.reply is not None and p.reply.header.get("m") is not None:
                client.release(p.dst, p.reply)

        for r in requests:
            r.pending.add_done_callback(release)

    def _pull_socket(self, key: str, s: Shard, after: int) -> np.ndarray:
        """A whole shard pulled through the socket (when its shared-memory reply could not be read)."""
        info = self._keys[key]
        out = np.empty(s.size, info.dtype)
        pending = [(off, length, self._client.request(s.server, Cmd.PULL, {"k": key, "after": after, "off": off,
                                                                           "len": length, "n": s.size}))
                   for off, length in parts(s.size, info.dtype.itemsize, self._part_bytes)]
        for off, length, p in pending:
            msg = p.wait()
            value = msg.arrays[0] if msg.arrays else None
            self._check_pulled(key, value, info, length)
            out[off:off + length] = value
        return out

    @staticmethod
    def _check_pulled(key: str, value: np.ndarray | None, info: _KeyInfo, length: int) -> None:
        if value is None or value.size != length or value.dtype != info.dtype:
            raise PSError(f"pull of key {key!r}: the server returned {None if value is None else value.dtype}"
                          f"[{None if value is None else value.size}], expected {info.dtype}[{length}]")

    @staticmethod
    def _check_values(key: str, values: Sequence[Array], info: _KeyInfo) -> None:
        for v in values:
            if _dtype(v) != info.dtype.name or int(np.prod(v.shape)) != info.numel:
                raise ConfigError(f"push of key {key!r}: got {_dtype(v)}{list(v.shape)} but the key was "
                                  f"initialised as {info.dtype.name}{list(info.shape)}")

    def _summed(self, key: str, values: Sequence[Array], info: _KeyInfo) -> np.ndarray:
        """The sum of a key's pushed values as a fresh flat host array (the caller may reuse its arrays)."""
        self._check_values(key, values, info)
        if self.type == "dist_device_sync" and len(values) > 1 and all(_is_torch(v) for v in values):
            acc = values[0].detach().clone()
            for v in values[1:]:
                acc += v.detach().to(acc.device)
            return _host(acc).reshape(-1)
        acc = np.array(_host(values[0]), copy=True).reshape(-1)
        for v in values[1:]:
            np.add(acc, _host(v).reshape(-1), out=acc)
        return acc

    @staticmethod
    def _write(out: Array, value: np.ndarray, start: int, info: _KeyInfo, staged: dict[int, np.ndarray]) -> None:
        """Copy a pulled range into ``out`` (directly when ``out`` is contiguous, else through a staging array)."""
        if start == 0 and value.size == info.numel:
            _copy_into(out, value.reshape(tuple(out.shape)))
            return
        contiguous = out.is_contiguous() if _is_torch(out) else out.flags.c_contiguous
        if contiguous:
            _copy_into(out.reshape(-1)[start:start + value.size], value)
        else:
            staged.setdefault(id(out), np.empty(info.numel, info.dtype))[start:start + value.size] = value


@dataclasses.dataclass(slots=True)
class _PullPart:
    key: str
    shard: Shard
    off: int
    length: int
    after: int
    pending: Pending


class PullTicket:
    """Pull requests in flight (from :meth:`DistKVStore.pushpull_async`, or inside a blocking pull)."""

    def __init__(self, store: DistKVStore, keys: list[str], requests: list[_PullPart]) -> None:
        self._store, self._keys, self._requests = store, keys, requests
        self._settled = False

    def on_ready(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once every reply is here or failed (at once when they all are), on the thread that
        settles the last one, which must not block: ``fn`` should only signal."""
        if not self._requests:
            fn()
            return
        left = [len(self._requests)]
        lock = threading.Lock()

        def one(_: Pending) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn()

        for r in self._requests:
            r.pending.add_done_callback(one)

    def finish(self, outs: Sequence[Array] | Sequence[Sequence[Array]]) -> None:
        """Wait for the values and copy them into ``outs`` (per key an array or a list of arrays), then let
        the servers reuse their buffers.  Raises the pull's error, or an error a server reported for an
        earlier push of these keys."""
        if self._settled:
            raise PSError("this pull was already finished or cancelled")
        store = self._store
        per_key = [list(o) if isinstance(o, (list, tuple)) else [o] for o in outs]
        if len(per_key) != len(self._keys):
            self.cancel()
            raise ConfigError(f"{len(self._keys)} keys were pulled but {len(per_key)} outs were given")
        by_key = dict(zip(self._keys, per_key, strict=True))
        try:
            for key, key_outs in by_key.items():
                store._check_outs(key, key_outs)
        except BaseException:
            self.cancel()
            raise
        self._settled = True
        client = store._client
        staged: dict[int, np.ndarray] = {}
        done = 0
        try:
            for r in self._requests:
                key, s, off, length = r.key, r.shard, r.off, r.length
                info = store._keys[key]
                key_outs = by_key[key]
                msg = r.pending.wait()
                done += 1
                if msg.header.get("m") is None:
                    value = msg.arrays[0] if msg.arrays else None
                    store._check_pulled(key, value, info, length)
                    for out in key_outs:
                        store._write(out, value, s.lo + off, info, staged)
                    continue
                try:  # the values wait in the server's shared memory: copy them out, then release them
                    try:
                        value = client.shared_view(s.server, key, msg, info.dtype, length)
                    except ShmError as e:
                        log.warning("pull of key %r: cannot read the server's shared memory (%s); pulling through "
                                    "the socket", key, e)
                        value = store._pull_socket(key, s, r.after)
                    for out in key_outs:
                        store._write(out, value, s.lo + off, info, staged)
                finally:
                    client.release(s.server, msg)
        except BaseException:
            store._release_unread(self._requests[done:])
            raise
        for key_outs in per_key:
            for out in key_outs:
                if id(out) in staged:
                    _copy_into(out, staged.pop(id(out)).reshape(tuple(out.shape)))
        store._raise_push_errors(set(self._keys))

    def cancel(self) -> None:
        """Give up on the values: the servers' buffers are released as their replies arrive."""
        if self._settled:
            return
        self._settled = True
        self._store._release_unread(self._requests)


def _copy_into(dst: Array, src: np.ndarray) -> None:
    if _is_torch(dst):
        import torch

        if dst.device.type == "cpu" and not dst.requires_grad and _dtype(dst) == src.dtype.name:
            np.copyto(dst.detach().numpy(), src)  # (src may be a read-only view of a server's shared memory)
            return
        if not src.flags.writeable:
            src = src.copy()  # torch warns about read-only arrays; a device copy needs a host copy anyway
        dst.copy_(torch.from_numpy(src))
    else:
        dst[...] = src
