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
from collections.abc import Sequence
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


def make_socket(ctx: zmq.Context, kind: int, identity: bytes | None = None) -> zmq.Socket:
    """A socket with the options every role wants: no message-count limits (memory is bounded by the
    data in flight, and a full queue must never block the event loop or drop silently), short linger."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 2000)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def send(sock: zmq.Socket, frames: Sequence[Any], route: bytes | None = None) -> None:
    """Send a message (zero-copy for large payloads), prefixed with a ROUTER route when given."""
    parts = [route, *frames] if route is not None else list(frames)
    try:
        sock.send_multipart([p if isinstance(p, (bytes, zmq.Frame)) else bytes_view(p) for p in parts], copy=False)
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
    """Logs dropped (bad) messages at most once per ``interval`` seconds, with a count of the rest."""

    def __init__(self, who: str, interval: float = 10.0) -> None:
        self.who = who
        self.interval = interval
        self.total = 0
        self._suppressed = 0
        self._last = -float("inf")

    def drop(self, error: WireError | str, peer: str = "?") -> None:
        self.total += 1
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more dropped since the last report)" if self._suppressed else ""
        log.warning("%s: dropped a bad message from %s: %s%s", self.who, peer, error, more)
        self._last, self._suppressed = now, 0


def node_name(role: str, index: int, info: dict[str, Any] | None = None) -> str:
    """``"server 1 (pid 42 on host-a)"``: how errors and logs name a node."""
    where = f" (pid {info.get('pid')} on {info.get('host')})" if info else ""
    return f"{role} {index}{where}"
