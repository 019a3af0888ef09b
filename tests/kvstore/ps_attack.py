"""Hostile peers for the attack tests: what an outsider without the job secret can send a PS role.

Each attack opens its own connections from this process and returns a
summary of what it managed.  They come in two shapes:

* **ZeroMQ peers** (pyzmq sockets with no credentials, wrong credentials, or
  a chosen routing id): what a script with pyzmq does.
* **raw TCP** speaking ZMTP 3.0 by hand: a greeting, a READY command naming
  any routing id, then whatever byte stream the attack wants (a million
  empty frames in one message, a 64 MiB header frame), written without
  waiting for the listener to agree, so it also probes what the listener
  buffers before the handshake completes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable

import zmq

#: libzmq 4.3.5 gives a peer that sets no routing id ``0x00`` + a counter that starts at 0x6b8b4567 in every
#: fresh process; a ROUTER aborts when the id it generates is already taken (issue 19, attack 1).
AUTO_ID_START = 0x6B8B4567


def auto_ids(count: int) -> list[bytes]:
    """The first ``count`` routing ids a fresh libzmq ROUTER generates."""
    return [b"\0" + (AUTO_ID_START + i).to_bytes(4, "big") for i in range(count)]


def host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host, int(port)


# ------------------------------------------------------------------------------- ZeroMQ peers
class Peers:
    """ZeroMQ DEALER connections kept open until :meth:`close` (a squatter holds its ids)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []

    def connect(self, endpoint: str, identity: bytes | None = None, plain: tuple[bytes, bytes] | None = None,
                curve: bool = False) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        if plain is not None:
            sock.setsockopt(zmq.PLAIN_USERNAME, plain[0])
            sock.setsockopt(zmq.PLAIN_PASSWORD, plain[1])
        if curve:
            server_public, _ = zmq.curve_keypair()  # a guess at the listener's key
            public, secret = zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.connect(endpoint)
        self.socks.append(sock)
        return sock

    def send_all(self, frames: list[bytes]) -> int:
        """Queue ``frames`` on every connection (never blocking); how many were queued."""
        sent = 0
        for sock in self.socks:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
        return sent

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)
        self.ctx.term()


def squat(endpoint: str, ids: Iterable[bytes], hold_s: float = 1.0) -> dict[str, int]:
    """Connect with each of ``ids`` (then once with no id, and once each with wrong PLAIN and CURVE
    credentials), send a message on every connection, and hold them for ``hold_s`` seconds."""
    peers = Peers()
    try:
        for identity in ids:
            peers.connect(endpoint, identity)
        peers.connect(endpoint)
        peers.connect(endpoint, b"w0", plain=(b"127.0.0.1", b"0" * 64))
        peers.connect(endpoint, b"w1", curve=True)
        queued = peers.send_all([b"\x81\xa1c\x01", b"x" * 32])
        time.sleep(hold_s)
        return {"connections": len(peers.socks), "queued": queued}
    finally:
        peers.close()


# ---------------------------------------------------------------------------------- raw ZMTP
def greeting(mechanism: bytes = b"NULL") -> bytes:
    """A ZMTP 3.0 greeting of a connecting peer."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" + b"\0" * 31


def command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    return (b"\x04" + bytes([len(data)]) if len(data) < 256 else b"\x06" + len(data).to_bytes(8, "big")) + data


def ready(identity: bytes) -> bytes:
    """A NULL-mechanism READY naming a DEALER with ``identity``."""
    props = (b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
             + b"\x08Identity" + len(identity).to_bytes(4, "big") + identity)
    return command(b"READY", props)


def many_frames(count: int) -> bytes:
    """One message of ``count`` empty frames."""
    return b"\x01\x00" * (count - 1) + b"\x00\x00"


def long_frame(size: int) -> bytes:
    """The start of one frame of ``size`` bytes (its header; the caller streams the body)."""
    return b"\x02" + size.to_bytes(8, "big")


def raw_stream(endpoint: str, chunks: Iterable[bytes], identity: bytes = b"w0", timeout: float = 10.0) -> bool:
    """Send a greeting, a READY and then ``chunks`` over raw TCP, stopping when the listener closes the
    connection; whether it did close it (within ``timeout`` seconds of the last byte this side could send)."""
    with socket.create_connection(host_port(endpoint), timeout=timeout) as s:
        try:
            for chunk in (greeting(), ready(identity), *chunks):
                s.sendall(chunk)
            while s.recv(65536):  # the listener's greeting, then end of file once it gave up on us
                pass
        except TimeoutError:
            return False  # still open: the listener is reading whatever we send
        except OSError:  # reset by the listener
            pass
    return True


def flood(endpoint: str, messages: int = 12, frames: int = 1_000_000, connections: int = 6) -> list[bool]:
    """``messages`` messages of ``frames`` empty frames, spread over ``connections`` raw connections (about
    24 MB for the defaults, as in issue 19), then a 64 MiB header frame on one more; for each connection,
    whether the listener closed it."""
    per = max(1, messages // connections)
    closed = [raw_stream(endpoint, [many_frames(frames)] * per, identity=b"flood%d" % i) for i in range(connections)]
    header = long_frame(64 << 20)
    closed.append(raw_stream(endpoint, [header + b"\0" * (1 << 20)] + [b"\0" * (1 << 20)] * 63, identity=b"big"))
    return closed


def listening_endpoint(pid: int, timeout: float = 30.0) -> str:
    """``tcp://ip:port`` of the TCP listener of process ``pid`` (polling until it appears), as an attacker
    watching ``/proc/net/tcp`` finds a server before the workers do."""
    import psutil

    deadline = time.monotonic() + timeout
    proc = psutil.Process(pid)
    while time.monotonic() < deadline:
        for conn in proc.net_connections(kind="tcp4"):
            if conn.status == psutil.CONN_LISTEN:
                return f"tcp://{conn.laddr.ip}:{conn.laddr.port}"
        time.sleep(0.002)
    raise AssertionError(f"process {pid} opened no TCP listener within {timeout} s")
