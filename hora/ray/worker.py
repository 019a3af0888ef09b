"""The Ray actor that is one rank: it reports where it runs, takes the job's environment, runs the user's code.

:class:`RayExecutor` wraps this class with ``ray.remote`` and creates one
per worker; Ray imports this module in each actor process, so the nodes need
hora installed (``pip install 'hora[ray]'``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.runner.env import NOT_INHERITED, free_port, interface_address


class Worker:
    """One rank of a :class:`~hora.ray.RayExecutor` job, living in its own Ray actor process.

    Horovod's ``BaseHorovodWorker`` methods (``hostname``, ``node_id``,
    ``update_env_vars``, ``env_vars``, ``execute``) keep their meaning.
    """

    def __init__(self) -> None:
        self.executable: Any = None

    def describe(self) -> dict[str, Any]:
        """Where Ray placed this actor: node id and IP, host name, pid and the GPUs Ray gave it."""
        import ray

        gpu_ids: list[Any] = []
        try:
            gpu_ids = list(ray.get_gpu_ids())
        except Exception:  # no GPUs in the cluster
            gpu_ids = []
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": tuple(str(g) for g in gpu_ids),
        }

    def rendezvous_endpoint(self, interface: str | None) -> tuple[str, int]:
        """The address rank 0 hosts the rendezvous store on (its node's Ray address, or
        ``interface``'s address) and a TCP port free there now."""
        import ray

        address = interface_address(interface) if interface else ray.util.get_node_ip_address()
        return address, free_port(address)

    def configure(self, env: Mapping[str, str], niceness: int | None = None) -> str | None:
        """Take the job's environment (an outer job's rank variables go, the job's come) and priority.

        Returns why the niceness could not be lowered to ``niceness``, or None.
        """
        for name in NOT_INHERITED:
            os.environ.pop(name, None)
        os.environ.update({str(k): str(v) for k, v in env.items()})
        return None if niceness is None else _renice(niceness)

    def update_env_vars(self, env_vars: Mapping[str, Any]) -> None:
        """Set environment variables in this actor's process (Horovod's name)."""
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        """This actor's environment (Horovod's name)."""
        return dict(os.environ)

    def hostname(self) -> str:
        """The host name of the node."""
        return socket.gethostname()

    def node_id(self) -> str:
        """Ray's id of the node."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def start_executable(self, executable_cls: type | None, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Create the user's object, after the environment is set, so its ``__init__`` may call ``hvd.init()``."""
        self.executable = executable_cls(*args, **kwargs) if executable_cls is not None else None

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)``: the object made by ``start(executable_cls=...)``, or None."""
        return fn(self.executable)

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``fn(*args, **kwargs)``."""
        return fn(*args, **kwargs)

    def run_elastic(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[
            int | None, Any]:
        """``fn(*args, **kwargs)`` in an elastic job: ``(rank in the last round, value)``, or
        ``(None, None)`` when the driver retired this worker (its node left, or the job needs fewer)."""
        from hora.core.elastic import worker as elastic_worker

        try:
            value = fn(*args, **kwargs)
        except elastic_worker.WorkerRetired:
            return None, None
        except SystemExit as e:  # hvd.elastic.run leaves with SystemExit(0) when retired mid-job
            if e.code in (0, None):
                return None, None
            raise
        assignment = elastic_worker.current()
        return (assignment.rank if assignment is not None else None), value


def _renice(niceness: int) -> str | None:
    """Set every thread of this process to ``niceness`` (Linux keeps it per thread, and threads started
    later inherit it from their creator); the reason when it may not be lowered, else None."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as e:
            return f"{e.strerror} (nice {os.getpriority(os.PRIO_PROCESS, 0)})"
    return None
