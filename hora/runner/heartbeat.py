"""Host-loss heartbeats, once for every launcher: who was heard from when, and who has gone silent.

A host that vanishes (power, a reclaimed spot instance, a dead switch port)
closes no socket: its packets just stop, and TCP on the other side waits for
minutes.  The authenticated channel hora already holds to each host, the ssh session
of the host's agent (which starts the host's processes, or under ``--mpi``
and for the elastic driver only beats), therefore carries a beat each
:attr:`HeartbeatConfig.interval_s`; anything received counts.  :class:`Liveness` is the bookkeeping (pure, with an
injectable clock, unit-tested); :class:`Beater` is the thread that sends the
launcher's own beats.  A host silent for :attr:`HeartbeatConfig.timeout_s`
is *lost*: the launcher ends a fixed job naming it, and the elastic driver
tells the survivors to leave the ring at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable

from hora.config import HeartbeatConfig

logger = logging.getLogger(__name__)


class Liveness:
    """When each peer was last heard from, and which have been silent past the deadline.

    Args:
        timeout_s: silence after which a peer is lost.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.heard: dict[Hashable, float] = {}
        self.lost: dict[Hashable, float] = {}  # peer -> the silence it was declared lost after
        self._lock = threading.Lock()

    def watch(self, peer: Hashable) -> None:
        """Start watching ``peer`` now (as if it had just been heard from)."""
        with self._lock:
            self.heard[peer] = self.clock()
            self.lost.pop(peer, None)

    def beat(self, peer: Hashable) -> None:
        """``peer`` said something (a beat or any other message); ignored once it was declared lost."""
        with self._lock:
            if peer in self.heard and peer not in self.lost:
                self.heard[peer] = self.clock()

    def forget(self, peer: Hashable) -> None:
        """Stop watching ``peer`` (it finished, or was stopped on purpose)."""
        with self._lock:
            self.heard.pop(peer, None)
            self.lost.pop(peer, None)

    def silence(self, peer: Hashable) -> float:
        """Seconds since ``peer`` was last heard from."""
        with self._lock:
            return self.clock() - self.heard[peer]

    def newly_lost(self) -> list[tuple[Hashable, float]]:
        """Peers silent for longer than the deadline and not reported before, with their silence.

        A peer is reported once; it stays lost until :meth:`watch` starts it again.
        """
        now = self.clock()
        found = []
        with self._lock:
            for peer, heard in self.heard.items():
                if peer not in self.lost and now - heard > self.timeout_s:
                    self.lost[peer] = now - heard
                    found.append((peer, now - heard))
        return found


def lost_note(host: str, silence: float, config: HeartbeatConfig) -> str:
    """The root-cause note of a host that stopped answering (names the host, the silence and the knob)."""
    since = time.strftime("%H:%M:%S", time.localtime(time.time() - silence))
    return (f"lost: {host} stopped answering (no heartbeat for {silence:.1f} s, last heard at {since}; "
            f"HORA_HEARTBEAT_TIMEOUT={config.timeout_s:g})")


class Beater:
    """Calls ``send`` for each peer every interval on a daemon thread, until :meth:`stop`.

    Args:
        peers: what to beat to, asked anew each time (so peers may come and go).
        send: sends one beat to one peer; its errors are the caller's concern
            (a dead channel is noticed by the receiving side's silence).
        interval_s: seconds between rounds of beats.
    """

    def __init__(self, peers: Callable[[], Iterable[object]], send: Callable[[object], object],
                 interval_s: float, name: str = "hora-heartbeat") -> None:
        self._peers = peers
        self._send = send
        self._interval = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Beater:
        """Start beating; returns self."""
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            for peer in list(self._peers()):
                try:
                    self._send(peer)
                except Exception as e:  # noqa: BLE001 - one bad channel must not stop the others' beats
                    logger.debug("heartbeat to %s failed: %s", peer, e)

    def stop(self) -> None:
        """Stop beating (returns at once; the thread ends within one interval)."""
        self._stopped.set()
