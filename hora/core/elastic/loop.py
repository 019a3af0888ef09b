"""The elastic retry loop behind ``hvd.elastic.run``: restore, re-form the ring, call the function again.

A lost peer surfaces in the training function as
:class:`~hora.errors.InternalError` (the engine turns the backend's
connection error into it and fails every pending collective): the loop
restores the last commit, re-forms the ring and calls the function again.  A
host change raises :class:`~hora.errors.HostsUpdatedInterrupt` at a commit:
the ring is re-formed without a restore.  After every re-formation the state
is synced from the new rank 0, which is always a worker that was in the
previous ring, so workers that joined start from the committed state.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hora.core.elastic.notifications import notifier
from hora.core.elastic.state import State
from hora.elastic_wire import WireError
from hora.errors import BackendError, HostsUpdatedInterrupt, InternalError

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: Re-formations a worker tries in a row when a round fails to connect (a peer died meanwhile).
RESET_ATTEMPTS = 20


def run_fn(func: F, reset: Callable[[], None]) -> F:
    """Wrap ``func(state, *args, **kwargs)`` so that it survives lost peers and host changes.

    Args:
        func: the training function; its first argument is a :class:`State`.
        reset: shuts the engine down and initialises it again (the binding's
            ``shutdown(); init()``); in an elastic job ``init()`` joins the
            driver's next round.

    Returns:
        The wrapped function.  A worker that the driver no longer needs
        (its host was removed) leaves with :class:`~hora.core.elastic.worker.WorkerRetired`,
        a ``SystemExit(0)``.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        sync = True
        notifier.register(state)  # the driver's host updates fill state._host_messages
        try:
            while True:
                try:
                    if sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except InternalError as e:  # ShutdownError too: a peer that exited shut its engine down
                    log.warning("a peer was lost (%s); restoring the last commit and re-forming the ring", e)
                    state.restore()
                    sync = True
                except HostsUpdatedInterrupt as e:
                    sync = not e.skip_sync
                _reform(reset)
                state.on_reset()
        finally:
            notifier.remove(state)

    return wrapper  # type: ignore[return-value]


def _reform(reset: Callable[[], None]) -> None:
    """``reset()``, again while a new round fails to connect (a peer died while it formed)."""
    for attempt in range(1, RESET_ATTEMPTS + 1):
        try:
            reset()
            return
        except (BackendError, InternalError, WireError) as e:
            if attempt == RESET_ATTEMPTS:
                raise
            log.warning("re-forming the ring failed (%s); joining the next round", e)
            if isinstance(e, WireError):
                time.sleep(min(attempt, 5))  # the driver was busy or unreachable: give it a moment
