"""Engine bring-up: detect the topology, choose and connect the backends, start the engine."""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Mapping

from hora import envvars
from hora.config import ElasticConfig, EngineConfig, RendezvousConfig, environ
from hora.core.allocator import tune_malloc
from hora.core.backends.base import Backend
from hora.core.engine import Engine
from hora.core.topology import Topology, detect
from hora.errors import BackendError, ConfigError

log = logging.getLogger(__name__)

_generation = itertools.count()


def choose_controller(config: EngineConfig, topology: Topology) -> str:
    """``mpi`` when asked for or when mpirun started the job, else ``gloo``."""
    if config.controller != "auto":
        return config.controller
    return "mpi" if topology.started_by_mpi else "gloo"


def start_engine(config: EngineConfig | None = None, env: Mapping[str, str] | None = None) -> Engine:
    """Connect to the other ranks and start the collective engine.

    Args:
        config: engine knobs; read from the environment when omitted.
        env: environment mapping (tests pass their own).

    Raises:
        ConfigError, BackendError, TopologyError: with what to change.
    """
    env = environ() if env is None else env
    config = EngineConfig.from_env(env) if config is None else config
    if config.malloc_tuning:
        tune_malloc(env)
    elastic = ElasticConfig.from_env(env)
    if elastic.enabled:  # a worker of hora run's elastic driver: this round's rank and store come from it
        from hora.core.elastic import worker

        env = worker.rendezvous(elastic, env)
    topology = detect(env)
    controller_name = choose_controller(config, topology)
    # Every rank of a ring must use the same store prefix: the round number in elastic jobs, where
    # ranks have initialised different numbers of times, else this process's count of inits.
    generation = f"e{env[envvars.HORA_ELASTIC_ROUND]}" if elastic.enabled else f"g{next(_generation)}"
    store = None
    if controller_name == "mpi":
        if elastic.enabled:
            raise ConfigError("elastic training needs the gloo controller (MPI's world is fixed): run with --gloo")
        controller = _mpi_controller(topology)
    else:
        timeout = elastic.collective_timeout_s if elastic.enabled else None
        controller, store = _gloo_controller(topology, config, RendezvousConfig.from_env(env), generation, timeout)
    data_backends: dict[str, Backend] = {}
    nccl = _maybe_nccl(controller, store, config, generation)
    if nccl is not None:
        data_backends["cuda"] = nccl
    log.debug("hora engine: rank %d/%d, controller %s", controller.rank, controller.size, controller.name)
    return Engine(topology, config, controller, data_backends)


def _mpi_controller(topology: Topology) -> Backend:
    from hora.core.backends.mpi import MPIBackend

    backend = MPIBackend()
    if topology.launcher == "hora" and backend.size != topology.size:
        raise ConfigError(
            f"{envvars.HORA_CONTROLLER}=mpi but MPI sees {backend.size} process(es) while the launcher started "
            f"{topology.size}: launch with `hora run --mpi` (or mpirun) to use the MPI controller"
        )
    _abort_on_uncaught_exception()
    return backend


def _abort_on_uncaught_exception() -> None:
    """Make an exception that ends this rank end the whole MPI job at once (as ``python -m mpi4py`` does).

    Without it the rank prints its traceback and then waits in ``MPI_Finalize`` (mpi4py calls it at exit)
    until every other rank finalizes too, so mpirun, and ``hora run``'s fail-fast, learn of the failure
    only when the others stop by themselves: a peer in a long step or a collective keeps the job alive.
    """
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:  # type: ignore[no-untyped-def]
        previous(kind, value, traceback)  # the traceback first: it is what the user needs to read
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


def _gloo_controller(topology: Topology, config: EngineConfig, rdv: RendezvousConfig, generation: str,
                     collective_timeout: float | None = None):
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise BackendError(
            "the gloo engine comes from torch.distributed, and torch is not installed in this environment. "
            "Either install it (pip install 'hora[torch]'), or use MPI, which needs no torch: "
            f"pip install 'hora[mpi]' and launch with `hora run --mpi` (or {envvars.HORA_CONTROLLER}=mpi under mpirun)"
        ) from e

    from hora.core.backends.torch_dist import GlooBackend, connect_store

    if topology.size == 1 and rdv.addr is None:
        store = dist.HashStore()
        hostname = "127.0.0.1"
    else:
        if rdv.addr is None or rdv.port is None:
            raise ConfigError(
                f"rank {topology.rank} of {topology.size} has no rendezvous address for gloo: launch with "
                f"`hora run`, or set {envvars.HORA_RENDEZVOUS_ADDR}/{envvars.HORA_RENDEZVOUS_PORT} (or "
                f"{envvars.MASTER_ADDR}/{envvars.MASTER_PORT}), "
                "or use the MPI controller under mpirun"
            )
        store = connect_store(
            rdv.addr, rdv.port, topology.rank, topology.size,
            is_master=rdv.host_store and topology.rank == 0, timeout_s=config.start_timeout_seconds,
            secret=rdv.secret,
        )
        hostname = None if rdv.interface else _address_towards(rdv.addr, rdv.port)
    backend = GlooBackend(
        store, topology.rank, topology.size, prefix=f"hora/{generation}",
        timeout_s=collective_timeout or max(config.start_timeout_seconds, 300.0), interface=rdv.interface,
        hostname=hostname,
        devices=rdv.gloo_devices,
    )
    return backend, store


def _address_towards(addr: str, port: int) -> str:
    """This host's IP address on the route to ``addr``: the address peers can reach us at.

    Without an interface, gloo would otherwise resolve the hostname, which in
    containers and namespaces often has no DNS entry or maps to loopback.
    Connecting a UDP socket sends nothing; it only asks the kernel for a route.
    """
    import socket

    if addr in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, port))
            return s.getsockname()[0]
    except OSError as e:
        raise ConfigError(f"no route from this host to the rendezvous address {addr}:{port} ({e}); check "
                          f"{envvars.HORA_RENDEZVOUS_ADDR} or choose the interface with --network-interface") from e


def _maybe_nccl(controller: Backend, store, config: EngineConfig, generation: str) -> Backend | None:
    # Only a process that already uses torch can hand hora CUDA tensors: never import it here.
    if "torch" not in sys.modules:
        return None
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        return None
    from hora.core.backends.torch_dist import NCCLBackend, connect_store

    if store is None:  # MPI controller: make a store for NCCL's bootstrap, port shared over MPI
        import socket

        if controller.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            addr = socket.gethostbyname(socket.gethostname())
            msg = f"{addr}:{port}".encode()
        else:
            msg = b""
        addr, port_s = controller.allgather_bytes(msg)[0].decode().split(":")
        store = connect_store(addr, int(port_s), controller.rank, controller.size, controller.rank == 0,
                              config.start_timeout_seconds)
    try:
        return NCCLBackend(store, controller.rank, controller.size, prefix=f"hora/nccl{generation}",
                           timeout_s=max(config.start_timeout_seconds, 300.0))
    except BackendError as e:
        log.warning("NCCL unavailable, CUDA tensors will fail: %s", e)
        return None
