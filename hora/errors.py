"""One exception tree for hora.

Every error hora raises on purpose derives from :class:`HoraError`.  They are
plain classes with picklable state, because they cross process boundaries (the
launcher reports a worker's failure, ``hora.run`` returns per-rank errors).

``HoraError`` subclasses ``RuntimeError`` so code written for Horovod, which
catches ``RuntimeError`` around collectives, keeps working unchanged.
"""

from __future__ import annotations


class HoraError(RuntimeError):
    """Root of every error hora raises on purpose."""


class ConfigError(HoraError, ValueError):
    """A knob, flag or environment variable has a value hora cannot use."""


class NotInitializedError(HoraError, ValueError):
    """A call needs ``hora.init()`` first."""


class TopologyError(HoraError):
    """Rank/size information is missing or inconsistent."""


class BackendError(HoraError):
    """A backend (MPI, gloo, NCCL) failed or is not available."""


class MismatchError(HoraError, ValueError):
    """Ranks submitted the same collective with different metadata.

    Raised on every participating rank; the message names the tensor and the
    value each rank submitted.
    """


class ArgumentError(HoraError, ValueError):
    """A collective was called with arguments it cannot take (splits that do not fit the tensor, ...).

    Both a ``ValueError`` and, through :class:`HoraError`, a ``RuntimeError``:
    Horovod raises such errors from its C++ core as ``RuntimeError`` (MXNet:
    ``MXNetError``), and scripts catch either.
    """


class DuplicateNameError(HoraError, ValueError):
    """A collective was submitted under a name whose earlier collective the program has not yet waited for."""


class StallError(HoraError):
    """A collective waited on missing ranks for longer than the stall deadline."""


class InternalError(HoraError):
    """A collective failed in a way that leaves the job in an unknown state.

    Elastic training catches this one to restore the last committed state.
    ``hora.torch.HorovodInternalError`` is an alias of this class.
    """


class ShutdownError(InternalError):
    """The engine was shut down (locally or by another rank) with work pending.

    An :class:`InternalError`: a rank that exits (a script's exception, then
    its shutdown at exit) fails the others' pending collectives with this,
    and elastic training recovers from it as from a rank that died.
    """


class HostsUpdatedInterrupt(HoraError):
    """The set of hosts changed; elastic training re-rendezvouses."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync

    def __reduce__(self):  # keep the flag across pickling
        return (type(self), (self.skip_sync,))


class UnsupportedError(HoraError, NotImplementedError):
    """The operation exists in the API but is not supported in this configuration."""


class LaunchError(HoraError):
    """The launcher could not start or keep running the job."""


class WorkerFailedError(LaunchError):
    """A worker process exited with an error; carries the root cause."""

    def __init__(self, rank: int, exitcode: int, host: str = "localhost", stderr_tail: str = "") -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.host = host
        self.stderr_tail = stderr_tail
        super().__init__(f"rank {rank} on {host} exited with code {exitcode}")

    def __reduce__(self):
        return (type(self), (self.rank, self.exitcode, self.host, self.stderr_tail))


class RankFailedError(WorkerFailedError):
    """A rank of a :func:`hora.spark.run` job raised or died; the job was cancelled.

    Besides :class:`WorkerFailedError`'s fields, ``traceback`` holds the
    rank's own Python traceback (empty when it died without one), which the
    message shows; the rank's exception, when it could be sent, is the ``__cause__``.
    """

    def __init__(self, rank: int, exitcode: int, host: str = "localhost", stderr_tail: str = "",
                 traceback: str = "") -> None:
        super().__init__(rank, exitcode, host, stderr_tail)
        self.traceback = traceback
        detail = f"; its traceback:\n{traceback}" if traceback else (
            f"; its last lines of stderr:\n{stderr_tail}" if stderr_tail else "")
        self.args = (f"rank {rank} on {host} exited with code {exitcode}; the Spark job was cancelled{detail}",)

    def __reduce__(self):
        return (type(self), (self.rank, self.exitcode, self.host, self.stderr_tail, self.traceback))


class ActorFailedError(LaunchError):
    """A worker actor of :class:`hora.ray.RayExecutor` raised or died; the executor has torn the job down.

    ``rank``, ``actor`` (Ray's actor id), ``node`` (the node's IP address) and
    ``cause`` (the exception raised, or why Ray says the actor died) name it.
    """

    def __init__(self, rank: int, actor: str, node: str, cause: str) -> None:
        self.rank = rank
        self.actor = actor
        self.node = node
        self.cause = cause
        super().__init__(f"rank {rank} (Ray actor {actor} on node {node}) {cause}")

    def __reduce__(self):
        return (type(self), (self.rank, self.actor, self.node, self.cause))


class PlacementTimeoutError(LaunchError, TimeoutError):
    """The Ray cluster could not place the workers' placement group within its timeout."""


class PSError(HoraError):
    """The parameter-server job failed: a server rejected a request, or the job ended."""


class PeerLostError(PSError):
    """A scheduler, server or worker of the parameter-server job died or went silent.

    ``node`` names it (for example ``"server 1 (pid 4242 on host-a)"``).
    """

    def __init__(self, node: str, detail: str = "") -> None:
        self.node = node
        self.detail = detail
        super().__init__(f"{node} was lost{': ' + detail if detail else ''}; the parameter-server job cannot "
                         "continue")

    def __reduce__(self):
        return (type(self), (self.node, self.detail))


class AuthError(PSError):
    """Messages of this process were rejected: its job secret (``HORA_SECRET``) differs from the job's."""
