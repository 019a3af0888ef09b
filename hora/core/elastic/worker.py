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

:func:`hosts_updated` is the cheap question rank 0 asks at every
``State.commit()``: has the driver anything newer than the round we run in?
Every message is authenticated by :mod:`hora.elastic_wire`.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Mapping

from hora import elastic_wire, envvars
from hora.config import ElasticConfig
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


#: The round this process last joined (None before its first); read by :func:`hosts_updated`.
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
    log.info("elastic round %d: rank %d of %d on %s", a.round, a.rank, a.size, a.host)
    return {**env, **a.env()}


def hosts_updated(config: ElasticConfig) -> bool:
    """Whether the driver has news since the current round: hosts added or removed, or a worker lost.

    Raises:
        hora.elastic_wire.WireError: the driver cannot be reached.
    """
    if _current is None:
        return False
    channel = elastic_wire.connect(str(config.driver_addr), int(config.driver_port or 0), str(config.secret),
                                   timeout=30.0)
    try:
        channel.send({"op": "poll", "worker": config.worker_id, "round": _current.round})
        channel.sock.settimeout(30.0)
        return bool(channel.recv().get("updated"))
    finally:
        channel.close()


def forget() -> None:
    """Drop the round's assignment (tests, and a process leaving the job)."""
    global _current
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
