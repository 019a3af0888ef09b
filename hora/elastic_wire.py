"""The elastic driver's wire format, shared by the driver (hora.runner.elastic) and the workers (hora.core.elastic).

It sits at the floor beside :mod:`hora.envvars` because both sides speak it
and neither may import the other.  A connection starts with the server
sending a random 16-byte nonce.  Every message after that is one frame:
a 4-byte big-endian length, a 32-byte HMAC-SHA256 and a UTF-8 JSON body.
The HMAC is keyed by the job secret (``HORA_SECRET``) and covers the nonce,
the direction (client to server or back), a per-direction sequence number
and the body, so a frame cannot be forged without the secret, replayed on
another connection, replayed within one, or reflected back to its sender.
A frame that fails the check closes the connection; nothing in it is read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any

from hora.errors import AuthError, HoraError

#: Bits of a host-update notification (the driver's ``watch`` answer; Horovod's ``HostUpdateResult`` values).
HOSTS_REMOVED = 1
HOSTS_ADDED = 2

#: Largest frame body either side accepts.
MAX_FRAME = 1 << 20
NONCE_BYTES = 16
_MAC_BYTES = 32
_HEADER = struct.Struct(">I")


class WireError(HoraError):
    """The connection to the elastic driver broke or carried a malformed frame."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise WireError(f"connection closed after {len(chunks)} of {n} bytes")
        chunks += chunk
    return bytes(chunks)


class Channel:
    """One authenticated connection; ``server`` says which end this is.

    Args:
        sock: a connected socket.
        secret: the job secret.
        server: True on the driver's side, which sends the nonce.
    """

    def __init__(self, sock: socket.socket, secret: str, server: bool) -> None:
        if not secret:
            raise AuthError("the elastic driver needs the job secret (HORA_SECRET); start the job with hora run")
        self.sock = sock
        self._key = hashlib.sha256(b"hora-elastic-driver:" + secret.encode()).digest()
        self._server = server
        self._sent = 0
        self._received = 0
        if server:
            self._nonce = os.urandom(NONCE_BYTES)
            sock.sendall(self._nonce)
        else:
            self._nonce = _recv_exact(sock, NONCE_BYTES)

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self._key, self._nonce + direction + struct.pack(">Q", seq) + body, hashlib.sha256).digest()

    def send(self, message: dict[str, Any]) -> None:
        """Send one message (a JSON-able dict)."""
        body = json.dumps(message, separators=(",", ":")).encode()
        direction = b"S" if self._server else b"C"
        mac = self._mac(direction, self._sent, body)
        self._sent += 1
        self.sock.sendall(_HEADER.pack(len(body)) + mac + body)

    def recv(self) -> dict[str, Any]:
        """Receive one message.

        Raises:
            WireError: the connection closed or the frame is too large or not JSON.
            AuthError: the frame's HMAC does not verify (another job's secret, or forged).
        """
        (length,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size))
        if length > MAX_FRAME:
            raise WireError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
        mac = _recv_exact(self.sock, _MAC_BYTES)
        body = _recv_exact(self.sock, length)
        direction = b"C" if self._server else b"S"
        if not hmac.compare_digest(mac, self._mac(direction, self._received, body)):
            raise AuthError("a message to or from the elastic driver failed its HMAC check: the peer does not "
                            "hold this job's HORA_SECRET")
        self._received += 1
        try:
            message = json.loads(body)
        except ValueError as e:
            raise WireError(f"malformed frame: {e}") from e
        if not isinstance(message, dict):
            raise WireError("malformed frame: not a JSON object")
        return message

    def close(self) -> None:
        """Close the socket (safe to call twice)."""
        try:
            self.sock.close()
        except OSError:
            pass


def connect(addr: str, port: int, secret: str, timeout: float) -> Channel:
    """Open a client channel to the driver at ``addr:port``.

    Raises:
        WireError: the driver cannot be reached within ``timeout``.
    """
    try:
        sock = socket.create_connection((addr, port), timeout=timeout)
    except OSError as e:
        raise WireError(f"cannot reach the elastic driver at {addr}:{port} ({e}); is hora run still running?") from e
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        return Channel(sock, secret, server=False)
    except (OSError, WireError) as e:
        sock.close()
        raise WireError(f"the elastic driver at {addr}:{port} closed the connection ({e})") from e
