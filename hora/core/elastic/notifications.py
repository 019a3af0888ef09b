"""Host-update notifications: the elastic driver's events reach every registered :class:`~hora.core.elastic.State`.

Horovod's driver calls into its workers when hosts change, and each
worker's ``State`` queues ``(timestamp, HostUpdateResult)``; ``commit()``
then raises ``HostsUpdatedInterrupt`` when a message is newer than the last
one acted on.  Here a worker has no server: one daemon thread per process
keeps a long poll (:func:`hora.core.elastic.worker.host_events`) open to the driver
for the round the process runs in, and hands each event to the states that
:func:`hora.core.elastic.run_fn` registered, through ``on_hosts_updated``.
Outside elastic jobs nothing is started.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Protocol

from hora import elastic_wire
from hora.config import ElasticConfig

log = logging.getLogger(__name__)

#: How long one long poll may wait; the driver answers sooner (its own limit is shorter).
EVENTS_TIMEOUT_SECONDS = 30.0


class HostUpdateResult(enum.IntFlag):
    """What a host-update notification says changed (Horovod's ``HostUpdateResult``)."""

    no_update = 0
    removed = elastic_wire.HOSTS_REMOVED
    added = elastic_wire.HOSTS_ADDED
    mixed = elastic_wire.HOSTS_REMOVED | elastic_wire.HOSTS_ADDED


class Listener(Protocol):
    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None: ...


class Notifier:
    """Delivers the driver's events of the current round to the registered listeners (one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._thread: threading.Thread | None = None
        self._after = -1  # the last event delivered; events are numbered across rounds

    def register(self, listener: Listener) -> None:
        """Deliver events to ``listener`` until :meth:`remove`; starts the watching thread in an elastic job."""
        config = ElasticConfig.from_env()
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)
            if config.enabled and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run, args=(config,), name="hora-elastic-notify",
                                                daemon=True)
                self._thread.start()

    def remove(self, listener: Listener) -> None:
        """Stop delivering to ``listener``; the thread ends once no listener is left."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _run(self, config: ElasticConfig) -> None:
        from hora.core.elastic import worker

        while True:
            with self._lock:
                if not self._listeners:
                    self._thread = None
                    return
            assignment = worker.current()
            if assignment is None:  # between rounds: init() has not joined the next one yet
                time.sleep(0.1)
                continue
            try:
                events = worker.host_events(config, assignment.round, self._after, EVENTS_TIMEOUT_SECONDS)
            except (elastic_wire.WireError, OSError) as e:
                log.debug("watching the elastic driver for host updates failed (%s); trying again", e)
                time.sleep(1.0)
                continue
            if worker.current() is not assignment:
                continue  # the round ended while the answer travelled: its events are spent (State.on_reset)
            for seq, timestamp, update in events:
                self._after = max(self._after, seq)
                with self._lock:
                    listeners = list(self._listeners)
                for listener in listeners:
                    listener.on_hosts_updated(timestamp, HostUpdateResult(update))


#: The process's notifier.
notifier = Notifier()

__all__ = ["HostUpdateResult", "Listener", "Notifier", "notifier"]
