"""Elastic training state: what is committed, restored after a lost peer, and synced from rank 0 after a reset.

:class:`State` is Horovod's ``hvd.elastic.State`` without a framework:
``commit()`` saves a copy in memory and checks the queue of host-update
messages that the driver's notifications fill (``_host_messages``, as in
Horovod, whose own scripts read it);
``restore()`` goes back to the last commit (after a
:class:`~hora.errors.InternalError`); ``sync()`` makes every rank's state
rank 0's (after each reset, so that workers that joined start from it).
A binding subclasses it for its objects (``hora.torch.elastic.TorchState``:
model and optimizer ``state_dict``\\s); :class:`ObjectState` keeps plain
Python attributes (epoch, batch, ...), broadcast as one pickled object.
"""

from __future__ import annotations

import copy
import logging
import queue
from collections.abc import Callable, Iterable
from typing import Any

from hora.config import ElasticConfig
from hora.core.elastic.notifications import HostUpdateResult
from hora.errors import HostsUpdatedInterrupt

log = logging.getLogger(__name__)

#: ``bcast_object(obj, root_rank=0) -> obj``: a broadcast of a picklable object from rank 0.
BroadcastObject = Callable[..., Any]


def _default_bcast(obj: Any, root_rank: int = 0) -> Any:
    from hora.core.objects import broadcast_object

    return broadcast_object(obj, root_rank)


def _default_rank() -> int:
    from hora.core import runtime

    return runtime.current().engine.rank


class State:
    """Base of every elastic state (Horovod's ``hvd.elastic.State``).

    Two attributes keep Horovod's names and meaning, because Horovod's own
    elastic scripts use them: ``_host_messages``, a queue of
    ``(timestamp, HostUpdateResult)`` that the driver's notifications fill
    (emptied at every reset), and ``_last_updated_timestamp``, the newest
    timestamp acted on: a commit raises :class:`HostsUpdatedInterrupt` only
    for a message newer than it (set it to 0 to act on any message).

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (default:
            :func:`hora.core.objects.broadcast_object`).
        get_rank: this process's rank now (default: the running engine's).
    """

    def __init__(self, bcast_object: BroadcastObject | None = None, get_rank: Callable[[], int] | None = None
                 ) -> None:
        self._bcast_object = bcast_object or _default_bcast
        self._rank = get_rank or _default_rank
        self._host_messages: queue.Queue[tuple[float, HostUpdateResult]] = queue.Queue()
        self._last_updated_timestamp: float = 0
        self._reset_callbacks: list[Callable[[], None]] = []
        self._elastic = ElasticConfig.from_env()

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset, once the new ring is up (e.g. to rescale the LR by size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run after a reset: drop the old round's host messages, then the subclass's :meth:`reset`, then the
        registered callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state as the point to restore to, then check for host changes.

        Raises:
            HostsUpdatedInterrupt: the driver added or removed hosts or lost a
                worker; :func:`hora.core.elastic.run_fn` re-forms the ring and
                calls the training function again, without a restore.
        """
        self.save()
        self.check_host_updates()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None:
        """Queue a host-update message (called by the driver's notifications)."""
        self._host_messages.put((timestamp, update_res))

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when a queued host message is newer than the last.

        Every rank empties its queue; rank 0's verdict is broadcast, so every
        rank raises at the same commit.  Outside elastic jobs nothing fills
        the queue and this does nothing.
        """
        if not self._elastic.enabled:
            return
        previous = newest = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while True:
            try:
                timestamp, result = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > newest:
                newest = timestamp
                update |= result
        previous, self._last_updated_timestamp, bits = self._bcast_object((previous, newest, int(update)))
        if self._last_updated_timestamp > previous:
            log.info("hosts changed (%s): re-forming the ring", HostUpdateResult(bits))
            # Always synced afterwards: a worker that rejoined after a failure holds an older commit.
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Keep a copy of the state in memory (called by :meth:`commit`)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last :meth:`save`."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Subclass hook, run after every reset before the callbacks."""


class ObjectState(State):
    """Plain Python attributes as elastic state (Horovod's ``ObjectState``).

    ``ObjectState(epoch=0, batch=0)`` has attributes ``epoch`` and
    ``batch``; they are saved by deep copy, restored, and synced from rank 0
    as one pickled object.
    """

    def __init__(self, bcast_object: BroadcastObject | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


__all__ = ["BroadcastObject", "ObjectState", "State"]
