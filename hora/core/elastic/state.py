"""Elastic training state: what is committed, restored after a lost peer, and synced from rank 0 after a reset.

:class:`State` is Horovod's ``hvd.elastic.State`` without a framework:
``commit()`` saves a copy in memory and asks whether the hosts changed;
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
from collections.abc import Callable, Iterable
from typing import Any

from hora.config import ElasticConfig
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

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (default:
            :func:`hora.core.objects.broadcast_object`).
        get_rank: this process's rank now (default: the running engine's).
    """

    def __init__(self, bcast_object: BroadcastObject | None = None, get_rank: Callable[[], int] | None = None
                 ) -> None:
        self._bcast_object = bcast_object or _default_bcast
        self._rank = get_rank or _default_rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._elastic = ElasticConfig.from_env()

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset, once the new ring is up (e.g. to rescale the LR by size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run after a reset: the subclass's :meth:`reset`, then the registered callbacks."""
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

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when the elastic driver has news.

        Rank 0 asks the driver and broadcasts the answer, so every rank
        raises at the same commit.  Outside elastic jobs this does nothing.
        """
        if not self._elastic.enabled:
            return
        updated = False
        if self._rank() == 0:
            from hora.core.elastic import worker

            updated = worker.hosts_updated(self._elastic)
        if self._bcast_object(updated):
            log.info("hosts changed: re-forming the ring")
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
