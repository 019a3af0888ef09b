"""The parameter server's wire format: authenticated multipart ZeroMQ messages.

A message is the multipart frame list ``[header, payload..., mac]``:

* ``header``: a msgpack map.  ``c`` is the command (:class:`Cmd`), ``s`` and
  ``d`` the sender's and the addressee's node ids, ``f`` describes the payload
  frames as ``[dtype, shape]`` pairs; the other fields depend on the command
  (:data:`SCHEMA`).
* ``payload``: one raw frame per array, C order, native little-endian.  They
  are sent without copying (numpy buffers) and received into
  ``numpy.frombuffer`` views of the ZeroMQ frames.  Between co-located peers
  a push, an init or a pull reply may instead name a range of a shared-memory
  segment in its header (``m``) and carry no payload frame; see
  :mod:`hora.kvstore.ps.shm`.
* ``mac``: HMAC-SHA256, keyed by the job secret, over a domain tag, the
  header, and the SHA-256 digest of every payload frame.  Hashing each frame
  on its own lets large frames be hashed in parallel (frames above
  :data:`CHUNK` are hashed as a two-level tree of chunk digests) and lets a
  server reuse the digest of a stored value for every worker that pulls it.

Nothing is pickled.  :func:`decode` checks the MAC before it parses anything,
then the header's types, the frame count and each frame's size against its
dtype and shape; whatever fails raises :class:`WireError`, which the roles log
(rate-limited) and drop without changing any state.
"""

from __future__ import annotations

import concurrent.futures
import enum
import hashlib
import hmac
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

MAC_BYTES = 32
CHUNK = 4 * 1024 * 1024  # frames larger than this are hashed as a tree of CHUNK-sized pieces
MAX_HEADER = 16 * 1024 * 1024
MAX_FRAMES = 1 << 16  # frames of one message, header and MAC included (a message carries at most MAX_FRAMES - 2 arrays)
MAX_NDIM = 32
_TAG = b"hora-ps/1\0"
_INT64 = (-(1 << 63), (1 << 63) - 1)

DTYPES = {name: np.dtype(name) for name in (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64",
)}


class WireError(Exception):
    """A frame list is not a valid message (forged, truncated or malformed).  Never leaves a role."""


class Cmd(enum.IntEnum):
    """Message commands.  Node ids: ``H`` is the scheduler, ``s<i>`` a server, ``w<rank>`` a worker."""

    REGISTER = 1        # node -> scheduler: join the job
    WELCOME = 2         # scheduler -> node: your id, the servers, the job's shape
    HEARTBEAT = 3       # both ways: still alive
    BARRIER = 4         # worker -> scheduler
    BARRIER_DONE = 5    # scheduler -> worker (e: why it failed, or "")
    GOODBYE = 6         # worker -> scheduler: this worker is done
    BYE = 7             # scheduler -> worker: goodbye acknowledged
    NODE_LOST = 8       # scheduler -> all: a node died; the job is dead
    WORKER_LEFT = 9     # scheduler -> servers and workers: a worker closed its store
    STOP = 10           # scheduler -> servers: the job is over
    # 11 was REJECT (an unsigned "your MAC did not verify"); a wrong secret now fails the ZeroMQ handshake
    INIT = 20           # worker -> server: a part of a key's (shard's) first value
    PUSH = 21           # worker -> server: a part of push ``seq`` of a gradient, at element ``off`` of ``n``
    PULL = 22           # worker -> server: elements [off, off + len) once push ``after`` is applied
    SET_OPTIMIZER = 23  # worker -> server: optimizer spec
    SET_COMPRESSION = 24
    GET_STATES = 25     # worker -> server: every key's optimizer state
    SET_STATES = 26
    SHM_HELLO = 27      # worker -> server: may we share memory? (host identity, a probe segment and its nonce)
    RELEASE = 28        # worker -> server: done reading the shared-memory replies to pulls ``r`` (request ids)
    REPLY = 30          # server -> worker: answer to request ``i`` (e: error text, or "")
    ROW_PUSH = 31       # worker -> server: push ``seq`` of a row_sparse gradient: row ids and their rows (width ``w``)
    ROW_PULL = 32       # worker -> server: the rows with these ids, once push ``after`` is applied


# Field types: "int", "str", "bool", "dict", "dict?" (dict or None), "list"; a leading "~" makes the field
# optional (absent, or of that type).
_REQ = {"i": "int", "a": "int"}  # request id, and the sender's lowest unanswered request id
SCHEMA: dict[Cmd, dict[str, str]] = {
    Cmd.REGISTER: {"i": "int", "role": "str", "host": "str", "pid": "int", "addr": "str", "rank": "int",
                   "mode": "str"},
    Cmd.WELCOME: {"id": "str", "rank": "int", "servers": "list", "nodes": "dict", "num_workers": "int",
                  "num_servers": "int", "sync": "bool"},
    Cmd.HEARTBEAT: {},
    Cmd.BARRIER: {"i": "int", "seq": "int"},
    Cmd.BARRIER_DONE: {"i": "int", "e": "str"},
    Cmd.GOODBYE: {"i": "int"},
    Cmd.BYE: {"i": "int"},
    Cmd.NODE_LOST: {"node": "str", "detail": "str"},
    Cmd.WORKER_LEFT: {"rank": "int", "node": "str"},
    Cmd.STOP: {},
    Cmd.INIT: {**_REQ, "k": "str", "off": "int", "n": "int", "m": "~list"},
    Cmd.PUSH: {**_REQ, "k": "str", "seq": "int", "off": "int", "n": "int", "z": "int", "m": "~list"},
    Cmd.PULL: {**_REQ, "k": "str", "after": "int", "off": "int", "len": "int", "n": "int", "m": "~bool"},
    Cmd.SET_OPTIMIZER: {**_REQ, "spec": "dict"},
    Cmd.SET_COMPRESSION: {**_REQ, "spec": "dict?"},
    Cmd.GET_STATES: {**_REQ},
    Cmd.SET_STATES: {**_REQ, "names": "list"},
    Cmd.SHM_HELLO: {**_REQ, "who": "str", "probe": "str", "nonce": "str"},
    Cmd.RELEASE: {"r": "list"},
    Cmd.REPLY: {"i": "int", "e": "str", "m": "~list"},
    Cmd.ROW_PUSH: {**_REQ, "k": "str", "seq": "int", "n": "int", "w": "int"},
    Cmd.ROW_PULL: {**_REQ, "k": "str", "after": "int", "n": "int", "w": "int"},
}
#: Number of payload arrays a command carries (None: any number).  A message whose header names a
#: shared-memory range (``m``) carries none.
ARRAYS: dict[Cmd, int | None] = {cmd: 0 for cmd in Cmd}
ARRAYS.update({Cmd.INIT: 1, Cmd.PUSH: 1, Cmd.SET_STATES: None, Cmd.REPLY: None, Cmd.ROW_PUSH: 2, Cmd.ROW_PULL: 1})


class Message:
    """A decoded, authenticated message: its command, header fields and payload arrays."""

    __slots__ = ("cmd", "header", "arrays")

    def __init__(self, cmd: Cmd, header: dict[str, Any], arrays: list[np.ndarray]) -> None:
        self.cmd = cmd
        self.header = header
        self.arrays = arrays

    def __getitem__(self, name: str) -> Any:
        return self.header[name]

    def __repr__(self) -> str:
        fields = {k: v for k, v in self.header.items() if k not in ("f", "spec")}
        return f"Message({self.cmd.name}, {fields}, arrays={[a.shape for a in self.arrays]})"


# ------------------------------------------------------------------------------------- hashing
_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _pool(name: str) -> concurrent.futures.ThreadPoolExecutor:
    with _pool_lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = concurrent.futures.ThreadPoolExecutor(
                max_workers=min(8, os.cpu_count() or 2), thread_name_prefix=f"hora-ps-{name}")
        return pool


def _hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    return _pool("hash")


def decode_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads on which roles verify large messages, several at a time (separate from the hashing
    threads a single large frame fans out to, so the two never wait on each other)."""
    return _pool("decode")


def bytes_view(buf: Any) -> memoryview:
    """A flat byte view of a contiguous buffer (numpy arrays of any shape, zero-size included), no copy."""
    if isinstance(buf, np.ndarray):
        return memoryview(buf.reshape(-1).view(np.uint8))
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _sha(data: Any) -> bytes:
    return hashlib.sha256(data).digest()  # hashlib releases the GIL on large buffers


def payload_digest(buf: Any) -> bytes:
    """SHA-256 digest of one payload frame; frames above :data:`CHUNK` hash as a tree, in parallel."""
    view = bytes_view(buf)
    n = view.nbytes
    if n <= CHUNK:
        return _sha(view)
    chunks = [view[i:i + CHUNK] for i in range(0, n, CHUNK)]
    return _sha(b"".join(_hash_pool().map(_sha, chunks)))


def _mac(key: bytes, header: bytes, digests: Sequence[bytes]) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    h.update(_TAG)
    h.update(len(header).to_bytes(8, "little"))
    h.update(header)
    h.update(len(digests).to_bytes(8, "little"))
    for d in digests:
        h.update(d)
    return h.digest()


# ------------------------------------------------------------------------------------ encoding
def array_frame(a: np.ndarray) -> np.ndarray:
    """``a`` as a payload frame: C-contiguous, native byte order, a dtype the wire carries.

    Raises:
        ValueError: the dtype is not one of :data:`DTYPES`.
    """
    if a.dtype.name not in DTYPES or a.dtype.byteorder == ">":
        raise ValueError(f"arrays of dtype {a.dtype} cannot be sent; supported: {', '.join(DTYPES)}")
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)  # (ascontiguousarray makes 0-d arrays 1-d)


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray], key: bytes,
           digests: Sequence[bytes | None] | None = None) -> list[Any]:
    """The frame list of a message (arrays are referenced, not copied).

    ``digests`` may hold precomputed :func:`payload_digest` values (None where
    unknown), so a stored array is hashed once however many times it is sent.

    Raises:
        ValueError: an array's dtype cannot travel, or there are more than ``MAX_FRAMES - 2`` arrays.
    """
    if len(arrays) > MAX_FRAMES - 2:
        raise ValueError(f"a message carries at most {MAX_FRAMES - 2} arrays, not {len(arrays)} (receivers drop "
                         "longer messages unread)")
    frames = [array_frame(a) for a in arrays]
    header = dict(header)
    header["f"] = [[a.dtype.name, list(a.shape)] for a in frames]
    packed = msgpack.packb(header, use_bin_type=True)
    dig = [digests[i] if digests is not None and digests[i] is not None else payload_digest(f)
           for i, f in enumerate(frames)]
    return [packed, *frames, _mac(key, packed, dig)]


# ------------------------------------------------------------------------------------ decoding
def _frame_buffer(frame: Any) -> memoryview:
    return bytes_view(frame.buffer if hasattr(frame, "buffer") else frame)


def _check_type(cmd: Cmd, name: str, value: Any, kind: str) -> None:
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and _INT64[0] <= v <= _INT64[1],
        "str": lambda v: isinstance(v, str) and len(v) <= 65536,
        "bool": lambda v: isinstance(v, bool),
        "dict": lambda v: isinstance(v, dict),
        "dict?": lambda v: v is None or isinstance(v, dict),
        "list": lambda v: isinstance(v, list),
    }[kind](value)
    if not ok:
        raise WireError(f"{cmd.name}: field {name!r} should be {kind}, got {type(value).__name__}")


def _arrays(cmd: Cmd, descs: Any, bufs: list[memoryview], shared: bool) -> list[np.ndarray]:
    if not isinstance(descs, list) or len(descs) != len(bufs):
        raise WireError(f"{cmd.name}: header describes {len(descs) if isinstance(descs, list) else '?'} "
                        f"arrays but {len(bufs)} payload frames came")
    want = 0 if shared else ARRAYS[cmd]
    if want is not None and len(bufs) != want:
        raise WireError(f"{cmd.name}: carries {len(bufs)} arrays, expected {want}")
    out = []
    for i, (desc, buf) in enumerate(zip(descs, bufs, strict=True)):
        if not (isinstance(desc, list) and len(desc) == 2 and isinstance(desc[0], str)
                and isinstance(desc[1], list) and len(desc[1]) <= MAX_NDIM
                and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < (1 << 62) for s in desc[1])):
            raise WireError(f"{cmd.name}: array {i} has a malformed description {desc!r:.100}")
        dtype = DTYPES.get(desc[0])
        if dtype is None:
            raise WireError(f"{cmd.name}: array {i} has unsupported dtype {desc[0]!r:.40}")
        shape = tuple(desc[1])
        if math.prod(shape) * dtype.itemsize != buf.nbytes:
            raise WireError(f"{cmd.name}: array {i} is {buf.nbytes} bytes, but {dtype.name}{list(shape)} "
                            f"needs {math.prod(shape) * dtype.itemsize}")
        out.append(np.frombuffer(buf, dtype=dtype).reshape(shape))
    return out


def decode(frames: Sequence[Any], key: bytes) -> Message:
    """Authenticate and parse a received frame list (``zmq.Frame`` objects or bytes).

    Raises:
        WireError: the message is forged, truncated or malformed.
    """
    if not 2 <= len(frames) <= MAX_FRAMES:
        raise WireError(f"{len(frames)} frames: a message has a header, payload frames and a MAC")
    header_buf = _frame_buffer(frames[0])
    mac = bytes(_frame_buffer(frames[-1]))
    if len(mac) != MAC_BYTES:
        raise WireError(f"MAC frame is {len(mac)} bytes, not {MAC_BYTES}")
    if header_buf.nbytes > MAX_HEADER:
        raise WireError(f"header of {header_buf.nbytes} bytes exceeds {MAX_HEADER}")
    header_bytes = bytes(header_buf)
    bufs = [_frame_buffer(f) for f in frames[1:-1]]
    if not hmac.compare_digest(_mac(key, header_bytes, [payload_digest(b) for b in bufs]), mac):
        raise WireError("bad HMAC (forged or corrupted message, or a different job secret)")
    try:
        header = msgpack.unpackb(header_bytes, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"header is not msgpack: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise WireError(f"header is a {type(header).__name__}, not a map")
    try:
        cmd = Cmd(header.get("c"))
    except (ValueError, TypeError):
        raise WireError(f"unknown command {header.get('c')!r:.40}") from None
    for name in ("s", "d"):
        _check_type(cmd, name, header.get(name), "str")
    for name, kind in SCHEMA[cmd].items():
        if kind.startswith("~"):
            if header.get(name) is not None:
                _check_type(cmd, name, header[name], kind[1:])
            continue
        if name not in header:
            raise WireError(f"{cmd.name}: missing field {name!r}")
        _check_type(cmd, name, header[name], kind)
    shared = cmd in (Cmd.INIT, Cmd.PUSH, Cmd.REPLY) and header.get("m") is not None
    return Message(cmd, header, _arrays(cmd, header.get("f"), bufs, shared))
