"""What every role shares: addresses to bind, ZeroMQ sockets, the job key, rate-limited logs.

Servers and the scheduler bind one address only, never ``0.0.0.0`` by default.
The scheduler binds ``DMLC_PS_ROOT_URI``; a server binds ``DMLC_NODE_HOST``,
else the IPv4 address of the configured interface (``DMLC_INTERFACE``), else
the local address that routes to the scheduler's host (loopback for a local
job).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from hora.config import PSConfig
from hora.errors import ConfigError
from hora.kvstore.ps.wire import WireError, bytes_view

log = logging.getLogger(__name__)

_INSECURE_KEY = b"hora-ps: no HORA_SECRET was set for this job"
_warned_secret = False
_warn_lock = threading.Lock()


def job_key(config: PSConfig) -> bytes:
    """The HMAC key of the job: its secret (a fixed public key, with a warning, when none is set)."""
    global _warned_secret
    if config.secret:
        return config.secret.encode()
    with _warn_lock:
        if not _warned_secret:
            _warned_secret = True
            log.warning("HORA_SECRET is not set: parameter-server messages are signed with a public default key, "
                        "so anyone who can reach the servers can change the model. `hora run` sets a secret; "
                        "when starting roles by hand, export the same random HORA_SECRET to every role")
    return _INSECURE_KEY


def resolve_host(host: str, what: str = "DMLC_PS_ROOT_URI") -> str:
    """The IPv4 address of ``host`` (a name or an address); ``what`` names the setting in errors.

    Raises:
        ConfigError: the name does not resolve.
    """
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ConfigError(f"{what}={host!r} does not resolve to an IPv4 address: {e}") from e


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface.

    Raises:
        ConfigError: the interface does not exist or has no IPv4 address.
    """
    import psutil

    addresses = psutil.net_if_addrs()
    if interface not in addresses:
        raise ConfigError(f"network interface {interface!r} (DMLC_INTERFACE / --network-interface) does not "
                          f"exist here; interfaces: {', '.join(sorted(addresses))}")
    for addr in addresses[interface]:
        if addr.family == socket.AF_INET:
            return addr.address
    raise ConfigError(f"network interface {interface!r} has no IPv4 address")


def bind_address(config: PSConfig) -> str:
    """The address a server binds: ``DMLC_NODE_HOST``, else the interface's, else the local end of the route
    to the scheduler."""
    if config.node_host:
        return resolve_host(config.node_host, "DMLC_NODE_HOST")
    if config.interface:
        return interface_address(config.interface)
    root = resolve_host(config.root_uri)
    if root.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((root, config.root_port or 9))  # a UDP connect sends nothing; it picks the route
            return s.getsockname()[0]
        except OSError as e:
            raise ConfigError(f"no route to the scheduler's host {config.root_uri} ({root}): {e}; set "
                              "DMLC_INTERFACE to the interface the job should use") from e


def scheduler_endpoint(config: PSConfig) -> str:
    """``tcp://ip:port`` of the scheduler."""
    config.require_job()
    return f"tcp://{resolve_host(config.root_uri)}:{config.root_port}"


def make_socket(ctx: zmq.Context, kind: int, identity: bytes | None = None, *, rcvhwm: int = 0,
                max_bytes: int = -1) -> zmq.Socket:
    """A socket with the options every role wants: no send limit (a full queue must never block the event
    loop or drop silently; what a role sends is bounded by what it was asked), a receive queue of ``rcvhwm``
    messages per peer (0: unbounded, only for sockets whose peers answer what this role asked), frames of
    at most ``max_bytes`` (-1: any; a larger frame closes the connection), short linger.  A ROUTER hands a
    routing id over to the newest connection that claims it, so a legitimate peer that reconnects is never
    locked out by a connection it left behind."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.LINGER, 2000)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    return sock


def random_identity(role: str) -> bytes:
    """An explicit routing id for a connecting socket, so that the listener never generates one (libzmq's
    generated ids are predictable, and it aborts when one it generates is already taken)."""
    return f"{role[:1]}-".encode() + os.urandom(8).hex().encode()


def send(sock: zmq.Socket, frames: Sequence[Any], route: bytes | None = None, *, block: bool = True) -> None:
    """Send a message (zero-copy for large payloads), prefixed with a ROUTER route when given.

    With ``block=False`` a socket that has no pipe to any peer raises :class:`zmq.Again` instead of
    waiting for one.  The send limit is off, so that only happens when libzmq gave the connection up for
    good, as it does after a handshake fails on a protocol error (a mechanism mismatch).
    """
    parts = [route, *frames] if route is not None else list(frames)
    try:
        sock.send_multipart([p if isinstance(p, (bytes, zmq.Frame)) else bytes_view(p) for p in parts],
                            0 if block else zmq.NOBLOCK, copy=False)
    except zmq.ZMQError as e:
        if e.errno == zmq.EHOSTUNREACH:  # the peer disconnected; it will resend or is being declared dead
            log.debug("dropping a message to a disconnected peer %r", route)
        else:
            raise


def peer_address(frame: Any) -> str:
    """The remote address a received frame came from, for logs ('?' when ZeroMQ cannot tell)."""
    try:
        return frame.get("Peer-Address")
    except Exception:
        return "?"


class Wakeup:
    """A pipe other threads write to, so that an event loop polling ZeroMQ sockets wakes up."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def set(self) -> None:
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):
            pass  # a full pipe already wakes the loop; a closed one means the loop is gone

    def clear(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.fd, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class DropLog:
    """Logs dropped (bad) messages, or refused connections, per peer address: at most once per ``interval``
    seconds each, with a count of the rest.  Remembers at most ``max_peers`` addresses (forgetting them all
    when a flood of addresses exceeds that, which only makes the next reports come sooner)."""

    def __init__(self, who: str, interval: float = 10.0, max_peers: int = 1024,
                 what: str = "dropped a bad message") -> None:
        self.who = who
        self.what = what
        self.interval = interval
        self.max_peers = max_peers
        self.total = 0
        self._peers: dict[str, list[float]] = {}  # peer -> [time of the last report, drops since]

    def drop(self, error: WireError | str, peer: str = "?") -> None:
        """Count one from ``peer`` (an address or a role's name) and log it when due."""
        self.total += 1
        now = time.monotonic()
        entry = self._peers.get(peer)
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            return
        if entry is None and len(self._peers) >= self.max_peers:
            self._peers.clear()
        more = f" ({int(entry[1])} more from it since the last report)" if entry is not None and entry[1] else ""
        log.warning("%s: %s from %s: %s%s", self.who, self.what, peer, error, more)
        self._peers[peer] = [now, 0]


class Receiver:
    """Reads a socket's messages a frame at a time, with bounds a sender cannot push past.

    A message of more than ``max_frames`` frames (not counting a ROUTER's
    routing frame) is discarded while it is read, its frames never held
    together; one call of :meth:`messages` reads at most ``budget`` frames,
    so a flood of frames cannot keep an event loop from its heartbeats.  A
    message cut by the budget is finished by the next call.
    """

    def __init__(self, sock: zmq.Socket, max_frames: int, drops: DropLog, peer: str = "") -> None:
        self.sock = sock
        self.max_frames = max_frames
        self.limit = max_frames + (1 if sock.socket_type == zmq.ROUTER else 0)  # with the routing frame
        self.drops = drops
        self.peer = peer  # names the sender in logs for a connecting socket; a ROUTER's frames name it
        self._parts: list[zmq.Frame] = []
        self._count = 0

    def messages(self, budget: int) -> Iterator[list[zmq.Frame]]:
        """Yield the complete messages that arrive within ``budget`` frames (without blocking)."""
        sock = self.sock
        while budget > 0:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            budget -= 1
            self._count += 1
            if self._count <= self.limit:
                self._parts.append(frame)
            elif self._count == self.limit + 1:
                del self._parts[1:]  # keep the first frame, which tells where the message came from
            if frame.more:
                continue
            parts, count = self._parts, self._count
            self._parts, self._count = [], 0
            if count > self.limit:
                self.drops.drop(f"a message of {count - self.limit + self.max_frames} frames (at most "
                                f"{self.max_frames} are read)",
                                self.peer or peer_address(parts[0]))
                continue
            yield parts


def node_name(role: str, index: int, info: dict[str, Any] | None = None) -> str:
    """``"server 1 (pid 42 on host-a)"``: how errors and logs name a node."""
    where = f" (pid {info.get('pid')} on {info.get('host')})" if info else ""
    return f"{role} {index}{where}"
