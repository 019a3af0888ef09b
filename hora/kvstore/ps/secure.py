"""Who may connect to a parameter-server socket: authentication at the ZeroMQ handshake.

Every socket a role binds (the scheduler's and each server's ROUTER) admits a
peer only once it proved, during the ZeroMQ handshake, that it holds the job
secret (``HORA_SECRET``).  A peer that cannot prove it never gets a routing
id, a queue, or a byte read by hora: libzmq closes the connection and
hora's ZAP handler (a thread per role, on ``inproc://zeromq.zap.01``) logs
the refusal, rate-limited, with the peer's address.  No new variable travels
from the launcher: everything derives from the secret the launcher already
gives every role.

Two mechanisms, chosen by ``HORA_PS_ENCRYPT`` (:attr:`hora.config.PSConfig.encrypt`):

* **PLAIN + HMAC token** (default): the connecting socket binds its source
  address and presents ``HMAC(secret, "hora-ps/plain/" + that address)``.
  The handler accepts it only from that address, so a token seen on the
  wire is useless from anywhere else.  Traffic is not encrypted; every
  message still carries its HMAC (:mod:`hora.kvstore.ps.wire`).
* **CURVE** (``HORA_PS_ENCRYPT=1``): both keypairs (the listeners' and the
  connectors') are derived from the secret; the handler admits only the
  job's connector key, and connectors only talk to a listener that holds the
  job's listener key.  Traffic is encrypted (about 0.4 GB/s per connection
  on one core; see docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import threading
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from hora.kvstore.ps.net import DropLog

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
DOMAIN = "hora-ps"
_ZAP_VERSION = b"1.0"


@dataclass(frozen=True, slots=True)
class Credentials:
    """What one job's roles present and expect at the handshake, all derived from the job key."""

    encrypt: bool
    key: bytes
    listener_public: bytes  # z85, CURVE only
    listener_secret: bytes
    connector_public: bytes
    connector_secret: bytes

    def token(self, address: str) -> bytes:
        """The PLAIN password of a connection whose source address is ``address``."""
        return hmac.new(self.key, b"hora-ps/plain/" + address.encode(), hashlib.sha256).hexdigest().encode()


def _curve_pair(key: bytes, name: bytes) -> tuple[bytes, bytes]:
    secret = z85.encode(hmac.new(key, b"hora-ps/curve/" + name, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def credentials(key: bytes, encrypt: bool) -> Credentials:
    """The handshake credentials of the job whose HMAC key is ``key``.

    Raises:
        zmq.ZMQError: ``encrypt`` asks for CURVE but this libzmq was built without it.
    """
    if encrypt and not zmq.has("curve"):
        raise zmq.ZMQError(zmq.ENOTSUP, "this libzmq has no CURVE support: set HORA_PS_ENCRYPT=0")
    listener = _curve_pair(key, b"listener") if encrypt else (b"", b"")
    connector = _curve_pair(key, b"connector") if encrypt else (b"", b"")
    return Credentials(encrypt, key, *listener, *connector)


def secure_listener(sock: zmq.Socket, creds: Credentials) -> None:
    """Make ``sock`` (before it binds) authenticate every peer through this context's ZAP handler."""
    if creds.encrypt:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, creds.listener_secret)
    else:
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def source_address(host: str, port: int) -> str:
    """This host's IPv4 address on the route to ``host`` (a UDP connect sends nothing; it picks the route)."""
    if host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 9))
        return s.getsockname()[0]


def secure_connect(sock: zmq.Socket, creds: Credentials, endpoint: str) -> None:
    """Connect ``sock`` to ``endpoint`` (``tcp://ip:port``) presenting the job's credentials."""
    if creds.encrypt:
        sock.setsockopt(zmq.CURVE_SERVERKEY, creds.listener_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, creds.connector_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, creds.connector_secret)
        sock.connect(endpoint)
        return
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    source = source_address(host, int(port))
    sock.setsockopt(zmq.PLAIN_USERNAME, source.encode())
    sock.setsockopt(zmq.PLAIN_PASSWORD, creds.token(source))
    sock.connect(f"tcp://{source}:0;{host}:{port}")  # the source address the token names


_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


class Authenticator:
    """The ZAP handler of one ZeroMQ context: a thread answering the handshakes of its listening socket.

    Create it after :func:`secure_listener` and before the listener binds; it
    ends when the context is terminated (or :meth:`stop`).  Besides the
    handshakes it judges (wrong credentials: logged with the peer's address),
    it counts, through a monitor of ``listener``, the connections libzmq
    closes before asking it (no credentials at all, or another mechanism),
    whose address libzmq does not report.
    """

    def __init__(self, ctx: zmq.Context, creds: Credentials, who: str, listener: zmq.Socket) -> None:
        self.creds = creds
        self.refusals = DropLog(who, what="refused a connection")
        self.accepted = 0
        self._connector = z85.decode(creds.connector_public) if creds.encrypt else b""
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._monitor = listener.get_monitor_socket(_FAILED)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"hora-ps-zap-{who}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it also ends by itself when the context is terminated)."""
        self._stop = True
        self._thread.join(2)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop:
                events = dict(poller.poll(200))
                if self._sock in events:
                    self._sock.send_multipart(self._answer(self._sock.recv_multipart()))
                if self._monitor in events:
                    self._monitor.recv_multipart()  # (event, endpoint): the endpoint is ours, not the peer's
                    self.refusals.drop("it presented no hora credentials (no handshake mechanism, or another one)",
                                       "an address libzmq does not report")
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close(linger=0)
            self._monitor.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            return [_ZAP_VERSION, request[1] if len(request) > 1 else b"", b"500", b"bad ZAP request", b"", b""]
        _, rid, domain, address, _identity, mechanism, *creds = request
        peer = address.decode(errors="replace")
        why = self._check(domain, mechanism, creds, peer)
        if why:
            self.refusals.drop(why, peer or "?")
            return [_ZAP_VERSION, rid, b"400", why.encode(), b"", b""]
        self.accepted += 1
        return [_ZAP_VERSION, rid, b"200", b"OK", b"hora-job", b""]

    def _check(self, domain: bytes, mechanism: bytes, creds: list[bytes], peer: str) -> str:
        if domain != DOMAIN.encode():
            return f"unknown ZAP domain {domain!r:.40}"
        if self.creds.encrypt:
            if mechanism != b"CURVE" or len(creds) != 1:
                return f"expected the CURVE mechanism, got {mechanism.decode(errors='replace')!r:.20}"
            if not hmac.compare_digest(creds[0], self._connector):
                return "its CURVE key is not this job's (a different HORA_SECRET, or no secret)"
            return ""
        if mechanism != b"PLAIN" or len(creds) != 2:
            return (f"expected the PLAIN mechanism with hora's token, got {mechanism.decode(errors='replace')!r:.20}"
                    " (no credentials, or HORA_PS_ENCRYPT differs between roles)")
        username, password = creds
        if username.decode(errors="replace") != peer:
            return (f"its token is for address {username.decode(errors='replace')!r:.60}, but it connects from "
                    f"{peer} (a replayed token, or address translation between the hosts)")
        if not hmac.compare_digest(password, self.creds.token(peer)):
            return "its token does not verify (a different HORA_SECRET)"
        return ""
