"""The worker's side of the elastic driver's rendezvous: ask for a place in the next ring, ask whether hosts changed.

``init()`` of an elastic worker (see :func:`hora.core.start_engine`) calls
:func:`rendezvous`: it connects to the driver inside ``hora run``, says which
round it last took part in, and waits until the driver forms a newer round
with every live worker.  The answer is this worker's rank, size, local and
cross placement, and where the round's rendezvous store listens: the round's
rank 0 hosts a fresh store on a port it reported itself, and the gloo keys
carry the round number, so a worker left over from an older round can never
connect into a newer ring.  The driver may instead answer that this worker
is no longer needed (its host was removed or blacklisted, or the job has
finished): :class:`WorkerRetired`.

:func:`host_events` waits for the driver's events of the round this worker
runs in (hosts added or removed, a worker lost): the notifier of
:mod:`hora.core.elastic.notifications` keeps one such long poll open and
hands the events to the registered states.  Every message is authenticated
by :mod:`hora.elastic_wire`.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Mapping

from hora import elastic_wire, envvars
from hora.config import ElasticConfig
from hora.core.elastic import watch
from hora.errors import TopologyError
from hora.placement import Placement

log = logging.getLogger(__name__)


class WorkerRetired(SystemExit):
    """The elastic driver has no place for this worker in the next round (its host left, or the job is done).

    Not an error: a ``SystemExit`` with status 0, so a worker told to leave at
    its first ``init()``, or at a reset inside ``hvd.elastic.run``, exits
    quietly and successfully.  The message says why, in ``reason``.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(0)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Assignment(Placement):
    """This worker's :class:`~hora.placement.Placement` in one rendezvous round, and the round's store."""

    round: int
    store_addr: str
    store_port: int

    def env(self, *, host: bool = False) -> dict[str, str]:
        """The worker variables this assignment stands for (what a fixed job's launcher would have set).

        The host name stays the one the worker was started with, unless ``host``.
        """
        env = Placement.env(self, host=host)
        env[envvars.HORA_RENDEZVOUS_ADDR] = self.store_addr
        env[envvars.HORA_RENDEZVOUS_PORT] = str(self.store_port)
        env[envvars.HORA_ELASTIC_ROUND] = str(self.round)
        return env


#: The round this process last joined (None before its first).
_current: Assignment | None = None
_released: list[tuple[str, int]] = []


def current() -> Assignment | None:
    """The assignment of the round this process runs in, or None outside elastic jobs."""
    return _current


def rendezvous(config: ElasticConfig, env: Mapping[str, str]) -> dict[str, str]:
    """Join the next round; returns ``env`` with this worker's placement and the round's store in it.

    Raises:
        WorkerRetired: the driver has no place for this worker any more.
        TopologyError: the driver did not form a round within ``config.timeout_s``.
        hora.elastic_wire.WireError: the driver cannot be reached.
    """
    global _current
    _release_previous_store()
    after = _current.round if _current is not None else 0
    channel = elastic_wire.connect(str(config.driver_addr), int(config.driver_port or 0), str(config.secret),
                                   timeout=30.0)
    try:
        my_addr = channel.sock.getsockname()[0]
        channel.send({"op": "join", "worker": config.worker_id, "after": after, "addr": my_addr,
                      "port": _free_port(my_addr)})
        channel.sock.settimeout(config.timeout_s)
        try:
            reply = channel.recv()
        except TimeoutError:
            raise TopologyError(
                f"the elastic driver formed no round within {config.timeout_s:g} s (HORA_ELASTIC_TIMEOUT / "
                "--elastic-timeout); too few hosts may be available for --min-np") from None
    finally:
        channel.close()
    if "stop" in reply:
        reason = f"worker {config.worker_id} is not part of the next round: {reply['stop']}"
        log.info("%s; leaving", reason)
        raise WorkerRetired(reason)
    a = Assignment(**{f.name: reply[f.name] for f in dataclasses.fields(Assignment)})
    _current = a
    watch.follow(config, a.round, a.store_port)  # the line the driver's aborts come on
    log.info("elastic round %d: rank %d of %d on %s", a.round, a.rank, a.size, a.host)
    return {**env, **a.env()}


def host_events(config: ElasticConfig, round_: int, after: int, timeout: float) -> list[tuple[int, float, int]]:
    """The driver's events of round ``round_`` numbered after ``after``, as ``(seq, timestamp, update)``.

    The driver answers as soon as there is one, or with none after at most
    ``timeout`` seconds (its own limit may be shorter), or when the round is over.

    Raises:
        hora.elastic_wire.WireError: the driver cannot be reached, or the answer broke off.
        OSError: the connection failed.
    """
    channel = elastic_wire.connect(str(config.driver_addr), int(config.driver_port or 0), str(config.secret),
                                   timeout=30.0)
    try:
        channel.send({"op": "events", "worker": config.worker_id, "round": round_, "after": after})
        channel.sock.settimeout(timeout + 30.0)
        reply = channel.recv()
    finally:
        channel.close()
    return [(int(seq), float(ts), int(update)) for seq, ts, update in reply.get("events", [])]


def forget() -> None:
    """Drop the round's assignment (tests, and a process leaving the job)."""
    global _current
    watch.stop()
    _release_previous_store()
    _current = None


def _release_previous_store() -> None:
    """Close the previous round's rendezvous store: each round has its own, on its own port."""
    if _current is None:
        return
    import sys

    torch_dist = sys.modules.get("hora.core.backends.torch_dist")
    if torch_dist is not None:
        torch_dist.release_store(_current.store_addr, _current.store_port)


def _free_port(addr: str) -> int:
    """A port free on this host now, for the store this worker hosts if it becomes the round's rank 0."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
