"""Shared memory between co-located parameter-server peers: the payloads skip the socket.

When a worker and a server run on the same host as the same user, the bytes
of a large push or pull do not travel through ZeroMQ.  The worker writes its
push into a segment of its own in ``/dev/shm`` and sends only the header,
which names the segment, the byte offset, the element count and the dtype
(``"m": [name, offset, count, dtype]``); the server sums straight out of that
segment into its merge buffer and answers once it is done reading.  The
server keeps its values in segments too, and answers a pull with a header
naming the range; the worker copies the values out and then tells the server
it is done (``RELEASE``), so the server never rewrites a buffer someone is
reading.  Every header stays HMAC-SHA256-signed exactly as on the socket
path; only the payload bytes are not hashed.

Why that is safe.  The frames that cross the network are all authenticated,
as before: a header naming a segment is only acted on when its MAC verifies,
and the name must belong to this job (``hora-ps-<job>-<pid>-<random>``, the
job part derived from the secret), be a regular file owned by this user with
no group or other permissions, and hold the range named, or the request is
refused and nothing changes.  The segments are created ``0600``, so only
processes of the same user (and root) can open them; those processes share
the job's trust domain anyway, since they can read ``HORA_SECRET`` from the
job's environment.

Who uses it.  A worker and a server switch to shared memory only after a
handshake (``SHM_HELLO``): they must report the same host identity (host
name, boot id, pid namespace and user id) and each must open a probe segment
the other created and find the random nonce the other announced in its
signed message.  Anything else, another host included, keeps the socket
path; ``HORA_PS_SHM=0`` forces it everywhere.  Shards below
``HORA_PS_SHM_MIN_BYTES`` and compressed pushes use the socket too.

Cleanup.  Segment names (``hora-ps-<job>-<pid namespace>-<pid>-<random>``)
exist only while needed: a server unlinks a worker's push segment as soon as
it has mapped it, and its own value buffers once every co-located worker has
mapped them; the mapped memory then lives exactly as long as some process
maps it, so a crash cannot leak it.  What still has a name is removed when
its creator exits (normally, on a handled error, or a server on SIGTERM);
every role, when it exits, also removes the job's segments whose creator
process is gone (a killed peer's), and when it starts, those of any earlier
hora job on this host whose processes were all killed.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import sys
import threading
import weakref
from collections.abc import Hashable
from typing import Any

import numpy as np

from hora.kvstore.ps.wire import DTYPES

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "hora-ps-"
NONCE_BYTES = 16
_PAGE = mmap.PAGESIZE
_RAND_HEX = 16


class ShmError(Exception):
    """A shared-memory reference cannot be used (bad name, missing segment, range out of bounds).  Internal:
    the roles answer it with an error reply or fall back to the socket."""


def available() -> bool:
    """Whether this platform has a POSIX shared-memory directory hora can use (Linux)."""
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_PIDNS = _pid_namespace()


def identity() -> str:
    """Who and where this process is: host name, boot id, pid namespace and user id.

    Two processes can share segments only when these are equal (a shared
    ``/dev/shm`` across containers with separate pid namespaces would make the
    dead-creator cleanup unsound, so that case keeps the socket path).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}|{boot}|{_PIDNS}|{os.getuid()}"


def raise_fd_limit(want: int = 65536) -> None:
    """Raise this process's soft limit of open files toward the hard limit: every mapped segment holds a
    descriptor (Python's ``mmap`` keeps one), a few per large key.  hora's sockets use ``poll``, so the usual
    reason for a low soft limit (``select``) does not apply."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("raised the open-files limit from %d to %d for shared-memory segments", soft, target)
    except (ImportError, OSError, ValueError) as e:
        log.debug("cannot raise the open-files limit: %s", e)


def job_token(key: bytes, endpoint: str) -> str:
    """The job's part of segment names: derived from the job secret and the scheduler's address."""
    return hmac.new(key, b"hora-ps-shm\0" + endpoint.encode(), hashlib.sha256).hexdigest()[:12]


def _name_re(token: str | None) -> re.Pattern[str]:
    """Segment names of one job (any hora job with None) created in this pid namespace; group 1 is the
    creator's pid: ``hora-ps-<job>-<pid namespace>-<pid>-<random>``."""
    job = "[0-9a-f]{12}" if token is None else re.escape(token)
    return re.compile(rf"{PREFIX}{job}-{_PIDNS}-(\d{{1,10}})-[0-9a-f]{{{_RAND_HEX}}}")


# ----------------------------------------------------------------------------- names this process made
_created: dict[str, int] = {}  # name -> pid of the creator (a forked child must not remove its parent's)
_created_lock = threading.Lock()


def _forget_name(name: str) -> None:
    with _created_lock:
        _created.pop(name, None)


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    except OSError as e:
        log.debug("cannot remove shared-memory segment %s: %s", name, e)
    _forget_name(name)


def remove(token: str, name: Any) -> None:
    """Remove a segment name of this job (a peer's probe, once checked); other names are left alone."""
    if isinstance(name, str) and _name_re(token).fullmatch(name) is not None:
        _unlink(name)


def remove_created() -> None:
    """Remove every segment name this process created and has not removed yet."""
    pid = os.getpid()
    with _created_lock:
        names = [name for name, creator in _created.items() if creator == pid]
    for name in names:
        _unlink(name)


atexit.register(remove_created)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")  # a zombie's memory is gone; only its exit status waits
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(token: str | None = None) -> list[str]:
    """Remove segments of this user whose creator process is gone (a killed peer's), of one job or (None)
    of any hora job in this pid namespace; returns their names.

    Removing such a name is always safe: a process that mapped the segment
    keeps it, and one that had yet to open it belongs to a job whose creator
    died.
    """
    if not available():
        return []
    pattern = _name_re(token)
    gone = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            if os.lstat(os.path.join(SHM_DIR, name)).st_uid != os.getuid():
                continue
        except OSError:
            continue
        _unlink(name)
        gone.append(name)
    if gone:
        log.info("removed %d shared-memory segments left by exited hora processes", len(gone))
    return gone


def cleanup(token: str | None) -> None:
    """Exit-time cleanup: this process's named segments, then the orphans of the job (of any hora job when
    ``token`` is None)."""
    remove_created()
    reap(token)


# ------------------------------------------------------------------------------------------ segments
class Segment:
    """One mapped shared-memory file: created here (read-write) or opened from a peer (read-only)."""

    __slots__ = ("name", "size", "mm", "linked", "writable", "seen_by", "__weakref__")

    def __init__(self, name: str, mm: mmap.mmap, size: int, writable: bool, linked: bool) -> None:
        self.name, self.mm, self.size, self.writable, self.linked = name, mm, size, writable, linked
        self.seen_by: set[int] = set()  # server side: workers known to have mapped it

    @classmethod
    def create(cls, token: str, nbytes: int) -> Segment:
        """A new zero-filled segment of at least ``nbytes`` bytes, mode 0600, its memory reserved up front
        (so a full ``/dev/shm`` is an error here rather than a SIGBUS later).

        Raises:
            OSError: the segment cannot be created or reserved.
        """
        size = max(int(nbytes), 1)
        name = f"{PREFIX}{token}-{_PIDNS}-{os.getpid()}-{secrets.token_hex(_RAND_HEX // 2)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with _created_lock:
            _created[name] = os.getpid()
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(name)
            raise
        os.close(fd)
        return cls(name, mm, size, True, True)

    @classmethod
    def open(cls, token: str, name: Any) -> Segment:
        """Map a peer's segment read-only, after checking that it is one of this job's and safe to map.

        Raises:
            ShmError: the name is not this job's, or the file is missing, not a plain 0600 file of this
                user, or empty.
        """
        if not isinstance(name, str) or _name_re(token).fullmatch(name) is None:
            raise ShmError(f"{name!r:.80} is not a shared-memory segment of this job")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ShmError(f"cannot open shared-memory segment {name}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ShmError(f"shared-memory segment {name} is not a private file of this user "
                               f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid})")
            if st.st_size <= 0:
                raise ShmError(f"shared-memory segment {name} is empty")
            try:
                mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
            except OSError as e:
                raise ShmError(f"cannot map shared-memory segment {name}: {e}") from None
        finally:
            os.close(fd)
        return cls(name, mm, st.st_size, False, True)

    def array(self, dtype: np.dtype, count: int, offset: int = 0) -> np.ndarray:
        """A 1-D view of ``count`` elements at byte ``offset`` (read-only on a peer's segment).

        Raises:
            ShmError: the range does not fit the segment or is misaligned for the dtype.
        """
        nbytes = count * dtype.itemsize
        if count < 0 or offset < 0 or offset % dtype.itemsize or offset + nbytes > self.size:
            raise ShmError(f"{dtype.name}[{count}] at byte {offset} does not fit shared-memory segment "
                           f"{self.name} of {self.size} bytes")
        return np.frombuffer(self.mm, dtype=dtype, count=count, offset=offset)

    def drop_pages(self, offset: int, nbytes: int) -> None:
        """Unmap the pages of a range from this process (the data stays in the segment), so that memory
        read from a peer does not count in this process's resident set."""
        start = offset - offset % _PAGE
        end = min(self.size, offset + nbytes)
        if end > start:
            try:
                self.mm.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):
                pass

    def unlink(self) -> None:
        """Remove the name (mappings stay valid; the memory goes with the last one)."""
        if self.linked:
            self.linked = False
            _unlink(self.name)

    def close(self) -> None:
        """Unmap now when no array views remain (otherwise when the last one is collected)."""
        try:
            self.mm.close()
        except BufferError:
            pass


def make_probe(token: str) -> tuple[Segment, bytes]:
    """A small segment holding a fresh random nonce, for a peer to prove it can open this host's segments.

    Raises:
        OSError: the segment cannot be created.
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    seg = Segment.create(token, NONCE_BYTES)
    seg.mm[:NONCE_BYTES] = nonce
    return seg, nonce


def check_probe(token: str, name: Any, nonce_hex: Any) -> None:
    """Open a peer's probe segment and compare its nonce with the one the peer announced.

    Raises:
        ShmError: the probe cannot be opened or holds another nonce.
    """
    if not isinstance(nonce_hex, str) or len(nonce_hex) != 2 * NONCE_BYTES:
        raise ShmError("malformed probe nonce")
    seg = Segment.open(token, name)
    try:
        found = bytes(seg.mm[:NONCE_BYTES])
    finally:
        seg.close()
    if not hmac.compare_digest(found, bytes.fromhex(nonce_hex)):
        raise ShmError(f"probe segment {name} holds another nonce")


def parse_ref(ref: Any) -> tuple[str, int, int, np.dtype]:
    """``(name, byte offset, count, dtype)`` of a header's ``"m"`` field.

    Raises:
        ShmError: the field is malformed.
    """
    if not (isinstance(ref, list) and len(ref) == 4 and isinstance(ref[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 62) for v in ref[1:3])
            and isinstance(ref[3], str)):
        raise ShmError(f"malformed shared-memory reference {ref!r:.100}")
    dtype = DTYPES.get(ref[3])
    if dtype is None:
        raise ShmError(f"shared-memory reference with unsupported dtype {ref[3]!r:.40}")
    return ref[0], ref[1], ref[2], dtype


def make_ref(seg: Segment, offset: int, count: int, dtype: np.dtype) -> list[Any]:
    """The ``"m"`` header field naming ``count`` elements of ``seg`` at byte ``offset``."""
    return [seg.name, int(offset), int(count), dtype.name]


# ------------------------------------------------------------------------------------------ caches
class Mappings:
    """Peers' segments this process has mapped, by name, keeping the last ``keep`` names of each slot
    (a slot is, e.g., one key of one peer: its buffers are reused, so older names are dead)."""

    def __init__(self, token: str, keep: int = 2) -> None:
        self.token = token
        self.keep = keep
        self._by_name: dict[str, Segment] = {}
        self._slots: dict[Hashable, list[str]] = {}
        self._lock = threading.Lock()

    def get(self, slot: Hashable, name: Any) -> tuple[Segment, bool]:
        """The mapped segment ``name`` and whether it was mapped just now.

        Raises:
            ShmError: see :meth:`Segment.open`.
        """
        with self._lock:
            seg = self._by_name.get(name) if isinstance(name, str) else None
            if seg is not None:
                return seg, False
        seg = Segment.open(self.token, name)
        evicted = []
        with self._lock:
            if name in self._by_name:  # mapped meanwhile by another thread
                evicted.append(seg)
                return self._by_name[name], False
            self._by_name[name] = seg
            names = self._slots.setdefault(slot, [])
            names.append(name)
            while len(names) > self.keep:
                old = self._by_name.pop(names.pop(0), None)
                if old is not None:
                    evicted.append(old)
        for old in evicted:
            if old is not seg:
                old.close()
        return seg, True

    def view(self, slot: Hashable, ref: Any) -> tuple[np.ndarray, Segment, int, bool]:
        """Resolve a header's ``"m"`` reference: ``(view, segment, byte offset, newly mapped)``.

        Raises:
            ShmError: the reference is malformed, names a segment that cannot be used, or a range
                outside it.
        """
        name, offset, count, dtype = parse_ref(ref)
        seg, new = self.get(slot, name)
        return seg.array(dtype, count, offset), seg, offset, new

    def close(self) -> None:
        with self._lock:
            segs = list(self._by_name.values())
            self._by_name.clear()
            self._slots.clear()
        for seg in segs:
            seg.close()


class Buffers:
    """Arrays this process allocates in its own segments, with a way back from an array to its segment.

    A buffer's segment is unlinked and unmapped when the array (and every
    view of it) is garbage.
    """

    def __init__(self, token: str) -> None:
        self.token = token
        self._segments: dict[int, Segment] = {}
        self._lock = threading.Lock()

    def alloc(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A zero-filled shared 1-D array.

        Raises:
            OSError: the segment cannot be created.
        """
        seg = Segment.create(self.token, count * dtype.itemsize)
        array = np.frombuffer(seg.mm, dtype=dtype, count=count)
        address = array.__array_interface__["data"][0]
        with self._lock:
            self._segments[address] = seg
        weakref.finalize(array, self._forget, address, seg)
        return array

    def _forget(self, address: int, seg: Segment) -> None:
        with self._lock:
            if self._segments.get(address) is seg:
                del self._segments[address]
        seg.unlink()
        seg.close()

    def segment_of(self, array: np.ndarray | None) -> Segment | None:
        """The segment a whole buffer from :meth:`alloc` lives in (None for any other array)."""
        if array is None:
            return None
        with self._lock:
            seg = self._segments.get(array.__array_interface__["data"][0])
        if seg is None or array.nbytes > seg.size:
            return None
        return seg

    def close(self) -> None:
        """Remove every buffer's name (the arrays stay usable until collected)."""
        with self._lock:
            segs = list(self._segments.values())
        for seg in segs:
            seg.unlink()
