"""A server's or worker's connection to the scheduler: joining the job, heartbeats, liveness.

The node registers, then waits for the scheduler's WELCOME, which comes once
every role of the job has registered.  From then on the node's event loop
calls :meth:`SchedulerLink.tick` often: it sends a heartbeat every interval
and raises :class:`~hora.errors.PeerLostError` when the scheduler has been
silent for longer than the dead-peer timeout.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.utils.monitor

from hora.config import PSConfig
from hora.errors import AuthError, PeerLostError, PSError
from hora.kvstore.ps import secure, wire
from hora.kvstore.ps.net import DropLog, Receiver, make_socket, random_identity, scheduler_endpoint, send
from hora.kvstore.ps.wire import Cmd, Message, WireError

log = logging.getLogger(__name__)

SCHEDULER_ID = "H"
#: Frames of any message between the scheduler and a node: a header and a MAC (they carry no arrays).
CONTROL_FRAMES = 2
#: Largest frame between the scheduler and a node.
CONTROL_BYTES = wire.MAX_HEADER + 64
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class SchedulerLink:
    """The DEALER socket to the scheduler, and the bookkeeping that proves both sides alive."""

    def __init__(self, ctx: zmq.Context, config: PSConfig, key: bytes, role: str, *, addr: str = "",
                 rank_hint: int = -1, mode: str = "") -> None:
        self.config = config
        self.key = key
        self.role = role
        self.endpoint = scheduler_endpoint(config)
        self.creds = secure.credentials(key, config.encrypt)
        # The scheduler only answers and heartbeats: a bounded queue holds far more than it ever sends at once.
        self.sock = make_socket(ctx, zmq.DEALER, random_identity(role), rcvhwm=1000, max_bytes=CONTROL_BYTES)
        self._monitor: zmq.Socket | None = self.sock.get_monitor_socket(_HANDSHAKE_FAILED)
        secure.secure_connect(self.sock, self.creds, self.endpoint)
        self.id = ""  # known after WELCOME
        self._register = {"c": int(Cmd.REGISTER), "s": "", "d": SCHEDULER_ID, "i": 0, "role": role,
                          "host": socket.gethostname(), "pid": os.getpid(), "addr": addr, "rank": rank_hint,
                          "mode": mode}
        self.last_recv = time.monotonic()
        self._last_beat = 0.0
        self.drops = DropLog(f"{role} link")
        self.receiver = Receiver(self.sock, CONTROL_FRAMES, self.drops, "the scheduler")

    def send(self, header: dict[str, Any], arrays: tuple = ()) -> None:
        """Sign and send a message to the scheduler."""
        self._send(wire.encode({"s": self.id, "d": SCHEDULER_ID, **header}, arrays, self.key))

    def _send(self, frames: list) -> None:
        """Send without ever blocking: a DEALER whose only connection libzmq dropped for good would wait
        forever for a peer.  libzmq drops it after a handshake that failed on a protocol error (the
        scheduler runs another security mechanism), a moment after the monitor reports the failure."""
        try:
            send(self.sock, frames, block=False)
        except zmq.Again:
            self._check_handshake(wait_ms=2000)
            raise PSError(f"this {self.role} lost its connection to the scheduler at {self.endpoint} for good "
                          "(libzmq gave it up, as it does when the handshake fails): check that every role of "
                          "the job has the same HORA_SECRET and the same HORA_PS_ENCRYPT") from None

    def register(self) -> Message:
        """Join the job and return the scheduler's WELCOME.

        Raises:
            AuthError: the scheduler refused our handshake (a different job secret).
            PSError: the job did not start within the start timeout, or was aborted.
        """
        try:
            return self._join()
        finally:
            self._stop_monitor()

    def _join(self) -> Message:
        cfg = self.config
        deadline = time.monotonic() + cfg.start_timeout_s
        heard = False
        next_register = 0.0
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise PSError(
                    f"this {self.role} could not join the parameter-server job within {cfg.start_timeout_s:g} s "
                    + ("(the scheduler answered, but not every role registered; check that DMLC_NUM_WORKER="
                       f"{cfg.num_workers} workers and DMLC_NUM_SERVER={cfg.num_servers} servers were started)"
                       if heard else f"(no answer from a scheduler at {self.endpoint}; is it running, and do "
                       "DMLC_PS_ROOT_URI / DMLC_PS_ROOT_PORT point at it?)")
                    + "; raise HORA_PS_START_TIMEOUT if roles start slowly"
                )
            if not heard and now >= next_register:
                self._send(wire.encode(self._register, (), self.key))
                next_register = now + max(1.0, 2 * (cfg.heartbeat_s or 1.0))
            elif heard and now - self._last_beat >= cfg.heartbeat_s:  # registered: stay alive while others join
                self._last_beat = now
                self.send({"c": int(Cmd.HEARTBEAT)})
            self._check_handshake()
            if self.sock.poll(200):
                for msg in self.incoming():
                    heard = True
                    if msg.cmd is Cmd.WELCOME:
                        self.id = msg["id"]
                        return msg
                    if msg.cmd is Cmd.NODE_LOST:
                        raise lost_error(msg)

    def _check_handshake(self, wait_ms: int = 0) -> None:
        """Raise when the scheduler refused our ZeroMQ handshake (libzmq retries some refusals forever,
        silently, and gives others up without a word); wait up to ``wait_ms`` for the monitor's report."""
        if self._monitor is None or not self._monitor.poll(wait_ms):
            return
        event = zmq.utils.monitor.recv_monitor_message(self._monitor)["event"]
        how = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "our credentials were refused",
               zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the security mechanisms differ"}.get(event, "the key differs")
        nat = "" if self.config.encrypt else (
            "; with HORA_PS_ENCRYPT=0 the listener must also see the address this host connects from (no NAT "
            "between the hosts; across NAT use HORA_PS_ENCRYPT=1)")
        raise AuthError(f"the scheduler at {self.endpoint} refused this {self.role}'s connection at the handshake "
                        f"({how}). Every role of a job must have the same HORA_SECRET and the same HORA_PS_ENCRYPT "
                        f"(this {self.role}: HORA_PS_ENCRYPT={int(self.config.encrypt)}){nat}")

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def incoming(self, budget: int = 1024) -> Iterator[Message]:
        """The valid messages from the scheduler that arrived (at most ``budget`` frames read; bad ones are
        logged and dropped)."""
        for frames in self.receiver.messages(budget):
            msg = self.receive(frames)
            if msg is not None:
                yield msg

    def receive(self, frames: list) -> Message | None:
        """Decode a message from the scheduler (None for a bad one, which is logged and dropped)."""
        try:
            msg = wire.decode(frames, self.key)
        except WireError as e:
            self.drops.drop(e, "the scheduler")
            return None
        if msg["s"] != SCHEDULER_ID or (self.id and msg["d"] != self.id):
            self.drops.drop(f"{msg.cmd.name} addressed from {msg['s']!r} to {msg['d']!r}", "the scheduler")
            return None
        self.last_recv = time.monotonic()
        return msg

    def tick(self, now: float) -> None:
        """Heartbeat when due.

        Raises:
            PeerLostError: nothing came from the scheduler for longer than the timeout.
        """
        if now - self._last_beat >= self.config.heartbeat_s:
            self._last_beat = now
            self.send({"c": int(Cmd.HEARTBEAT)})
        silent = now - self.last_recv
        if silent > self.config.timeout_s:
            raise PeerLostError(f"the scheduler at {self.endpoint}",
                                f"nothing received for {silent:.1f} s (HORA_PS_TIMEOUT={self.config.timeout_s:g})")

    def close(self) -> None:
        self._stop_monitor()
        self.sock.close()


def lost_error(msg: Message) -> PSError:
    """The error a NODE_LOST notice means: a named node died, or (no node) the job was aborted."""
    if msg["node"]:
        return PeerLostError(msg["node"], msg["detail"])
    return PSError(f"the parameter-server job was aborted: {msg['detail']}")
