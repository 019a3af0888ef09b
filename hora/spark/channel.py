"""The line from each rank's Spark task back to the driver: its output lines and its outcome.

The driver listens on a TCP port of its own address (``spark.driver.host``);
each task connects once it knows its rank.  A message is a 4-byte length and
a msgpack list.  The first one a task sends carries the job's token, compared
in constant time: a connection that does not know it is closed unread.
Spark's own path (a collected result) is not used for outcomes, so that the
driver learns of a failing rank at once and cancels the job itself.
"""

from __future__ import annotations

import hmac
import logging
import queue
import socket
import struct
import threading
from typing import Any

import msgpack

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
#: Largest message accepted: a rank's pickled return value travels in one.
MAX_MESSAGE = 1 << 31
HELLO, OUTPUT, OUTCOME, FAILED = "hello", "out", "outcome", "failed"


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def recv_message(sock: socket.socket) -> list[Any] | None:
    """The next message on ``sock``, or None when the connection ended (or sent an oversized length)."""
    header = _recv_exact(sock, _LENGTH.size)
    if header is None:
        return None
    (size,) = _LENGTH.unpack(header)
    if size > MAX_MESSAGE:
        return None
    body = _recv_exact(sock, size)
    return None if body is None else msgpack.unpackb(body, raw=False)


def send_message(sock: socket.socket, message: list[Any]) -> None:
    """Send one message: a 4-byte length and the msgpack body."""
    body = msgpack.packb(message, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(body)) + body)


class Listener:
    """A TCP server on a free port of ``address`` that serves each connection in a thread of its own.

    Subclasses implement :meth:`serve` (which must authenticate the peer
    first); :meth:`stop_listening` ends the accepting and hands back the
    connections that were accepted.
    """

    def __init__(self, address: str, backlog: int, name: str) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._server = socket.socket(family, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((address, 0))
        self._server.listen(backlog)
        self.address = address
        self.port = self._server.getsockname()[1]
        self._name = name
        self._closed = False
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.append(conn)
            threading.Thread(target=self.serve, args=(conn,), name=self._name, daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        """Handle one accepted connection until it ends (in its own thread)."""
        raise NotImplementedError

    def stop_listening(self) -> list[socket.socket]:
        """Stop accepting; return the connections accepted so far (the caller decides their fate)."""
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._server.close()
        return connections


class DriverChannel(Listener):
    """The driver's end: accepts the tasks' connections and queues what they send.

    ``messages`` holds ``(kind, rank, ...)`` tuples in arrival order:
    ``("out", rank, stream, line)``, ``("outcome", rank, returncode, host, result, stderr_tail, stopped)``,
    ``("failed", rank, text)`` when the job could not start its ranks (MPI mode: mpirun failed), and
    ``("closed", rank)`` when a task's connection ends.  An ``out`` line that a task relays for another
    rank (under MPI, rank 0's task relays every rank's) carries that rank, or None for mpirun's own lines.
    """

    def __init__(self, address: str, token: str) -> None:
        self.token = token
        self.messages: queue.Queue[tuple[Any, ...]] = queue.Queue()
        super().__init__(address, 64, "hora-spark-rank")

    def serve(self, conn: socket.socket) -> None:
        """Read one task's messages into :attr:`messages` until its connection ends."""
        rank = None
        try:
            hello = recv_message(conn)
            if (not hello or hello[0] != HELLO or not isinstance(hello[1], str)
                    or not hmac.compare_digest(hello[1].encode(), self.token.encode())):
                log.warning("hora.spark: a connection without the job's token was refused")
                return
            rank = int(hello[2])
            while True:
                message = recv_message(conn)
                if message is None:
                    break
                if message[0] == OUTPUT and len(message) > 3:  # relayed: [OUTPUT, stream, line, rank]
                    self.messages.put((OUTPUT, message[3], message[1], message[2]))
                else:
                    self.messages.put((message[0], rank, *message[1:]))
        except (OSError, ValueError, msgpack.UnpackException) as e:
            log.debug("hora.spark: the connection of rank %s ended: %s", rank, e)
        finally:
            conn.close()
            if rank is not None:
                self.messages.put(("closed", rank))

    def close(self) -> None:
        """Stop listening and drop every connection; safe to call twice."""
        for conn in self.stop_listening():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


class TaskChannel:
    """A task's end: connects to the driver and sends its rank's lines and outcome (thread-safe)."""

    def __init__(self, address: str, port: int, token: str, rank: int, timeout: float = 30.0) -> None:
        self._sock = socket.create_connection((address, port), timeout=timeout)
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        send_message(self._sock, [HELLO, token, rank])

    def output(self, stream: str, line: bytes, rank: int | None = -1) -> None:
        """Send one line written to ``stream`` (``stdout`` or ``stderr``): by this task's rank, or
        relayed for ``rank`` (None: a line of mpirun's own)."""
        message: list[Any] = [OUTPUT, stream, line] if rank == -1 else [OUTPUT, stream, line, rank]
        with self._lock:
            send_message(self._sock, message)

    def outcome(self, returncode: int, host: str, result: bytes, stderr_tail: list[str],
                stopped: bool = False) -> None:
        """Send how the rank ended: its exit code, host, ``hora.runner.run_task`` result file and stderr tail;
        ``stopped`` when it was ended because another rank failed first."""
        with self._lock:
            send_message(self._sock, [OUTCOME, returncode, host, result, stderr_tail, stopped])

    def failed(self, text: str) -> None:
        """Tell the driver that the job's ranks could not be started, and why."""
        with self._lock:
            send_message(self._sock, [FAILED, text])

    def close(self) -> None:
        """Close the connection."""
        try:
            self._sock.close()
        except OSError:
            pass
