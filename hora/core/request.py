"""Requests submitted to the engine and the handles returned for them."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from hora.core.buffers import Array, ArrayOps, ops_for
from hora.core.buffers.numpy_ops import NUMPY
from hora.core.ops import CollectiveType, ReduceOp
from hora.errors import HoraError

# Encoding a signature costs more than the rest of a small collective's round;
# training submits the same few signatures every step, so remember them.
_SIGNATURES: dict[tuple, bytes] = {}


@dataclasses.dataclass(slots=True)
class Entry:
    """One tensor of a request: its input and where its result goes.

    ``output`` is ``None`` when the engine allocates the result (allgather,
    alltoall, reducescatter, whose output shape depends on other ranks).
    """

    input: Array
    output: Array | None
    splits: list[int] | None = None  # alltoall only: rows sent to each rank


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """A named collective on one or more tensors (more than one: a grouped op).

    A grouped request is negotiated and executed as a unit: it runs only when
    every one of its tensors is ready on every rank.  All its tensors belong
    to one array family, whose operations (``ops``) the executor uses on them.
    """

    name: str
    kind: CollectiveType
    entries: list[Entry]
    process_set_id: int = 0
    op: ReduceOp = ReduceOp.SUM
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    payload: Any = None  # control requests (process-set ranks, ...)
    ops: ArrayOps | None = None  # the entries' family; found from the first input when not given
    sig_bytes: bytes | None = None
    handle: Handle = dataclasses.field(init=False)
    submitted_at: float = dataclasses.field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.ops is None:
            self.ops = ops_for(self.entries[0].input) if self.entries else NUMPY
        self.handle = Handle(self)

    @property
    def key(self) -> str:
        """The name negotiated across ranks: names are scoped to their process set."""
        return self.name if self.process_set_id == 0 else f"{self.name} [process set {self.process_set_id}]"

    def signature_bytes(self) -> bytes:
        """What this rank submitted, as compared across ranks during negotiation.

        Dtypes and shapes of every tensor, the operator, root, scale factors,
        process set, device and alltoall splits, encoded once and reused every
        round the request waits.
        """
        if self.sig_bytes is None:
            if self.kind == CollectiveType.ADD_PROCESS_SET:
                tensors: tuple = (("int64", tuple(self.payload), ()),)
            else:
                ops = self.ops
                tensors = tuple(
                    (ops.dtype_name(e.input), ops.shape(e.input), tuple(e.splits) if e.splits else ())
                    for e in self.entries
                )
            device = self.ops.device_type(self.entries[0].input) if self.entries else "cpu"
            key = (self.kind, tensors, self.op, self.root, self.prescale, self.postscale, self.process_set_id,
                   device)
            encoded = _SIGNATURES.get(key)
            if encoded is None:
                from hora.core.negotiation import Signature

                encoded = Signature(
                    self.kind, tensors, self.op, self.root, float(self.prescale), float(self.postscale),
                    self.process_set_id, device,
                ).encode()
                if len(_SIGNATURES) < 65536:
                    _SIGNATURES[key] = encoded
            self.sig_bytes = encoded
        return self.sig_bytes


# One condition for every handle: a round completes many handles, and a
# per-handle Event (a lock, a condition and a deque each) costs more than a
# small collective's whole round.  Waiters are few, so notify_all is cheap.
_DONE = threading.Condition()


class Handle:
    """An in-flight request; ``wait()`` returns its outputs or raises its error."""

    __slots__ = ("_request", "name", "ident", "_done", "_result", "_error", "driver", "wrap", "observed",
                 "__weakref__")

    def __init__(self, request: Request) -> None:
        # Request and handle point at each other while the request is in flight; _finish()
        # cuts the link so that the tensors go back to the allocator as soon as the caller
        # drops the handle, not whenever the cyclic garbage collector next runs.
        self._request: Request | None = request
        self.name = request.name
        #: (kind, name, process set id): what identifies the request after it finished
        self.ident = (int(request.kind), request.name, request.process_set_id)
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        #: set by the engine: runs negotiation rounds on the waiting thread
        self.driver: Callable[[Handle], None] | None = None
        #: set by the binding: turns the engine's result into the framework's (applied by wait())
        self.wrap: Callable[[Any], Any] | None = None
        #: True once the program has seen the request finish (wait() returned or poll() said done);
        #: until then its name may not be submitted again
        self.observed = False

    @property
    def request(self) -> Request | None:
        """The request while it is in flight; None once it finished."""
        return self._request

    def done(self) -> bool:
        """True once the request completed or failed; never blocks."""
        return self._done

    def poll(self) -> bool:
        """Like :meth:`done`, and a True answer counts as the program having seen the result."""
        if self._done:
            self.observed = True
        return self._done

    def wait_event(self, timeout: float | None) -> bool:
        """Block until done or ``timeout``, without driving the engine."""
        if self._done:
            return True
        with _DONE:
            return _DONE.wait_for(self.done, timeout)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the request finishes; return its result or raise its error."""
        if self.driver is not None and timeout is None and not self._done:
            self.driver(self)
        if not self.wait_event(timeout):
            raise TimeoutError(f"collective {self.name!r} did not finish within {timeout} s")
        self.observed = True
        if self._error is not None:
            raise self._error
        return self._result if self.wrap is None else self.wrap(self._result)

    def _finish(self) -> None:
        self._request = None
        with _DONE:
            self._done = True
            _DONE.notify_all()

    def set_result(self, result: Any) -> None:
        self._result = result
        self._finish()

    def set_error(self, error: BaseException) -> None:
        if not isinstance(error, HoraError):
            wrapped = HoraError(f"collective {self.name!r} failed: {error}")
            wrapped.__cause__ = error
            error = wrapped
        self._error = error
        self._finish()
