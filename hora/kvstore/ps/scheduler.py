"""The scheduler: membership, barriers and failure detection for a parameter-server job.

It binds ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT`` and waits until
``DMLC_NUM_SERVER`` servers and ``DMLC_NUM_WORKER`` workers have registered.
Then it numbers them (a worker keeps the rank it asked for, e.g. its
``HORA_RANK``, and a server the launcher's index, ``HORA_PS_SERVER_INDEX``,
when the requests are consistent) and sends everyone a WELCOME
with the servers' addresses.  While the job runs it

* answers barriers once every worker arrived (a barrier a departed worker
  can never reach fails on every waiting worker instead of hanging);
* exchanges heartbeats with every node, and declares a node dead when it has
  been silent for ``HORA_PS_TIMEOUT`` seconds: every node is told (workers
  raise :class:`~hora.errors.PeerLostError`, servers exit) and the scheduler
  exits non-zero once the surviving workers said goodbye, or after one more
  timeout;
* tells the servers when a worker closed its store early, and stops them
  when every worker has said goodbye (exit code 0).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import zmq

from hora.config import PSConfig
from hora.errors import ConfigError
from hora.kvstore.ps import secure, wire
from hora.kvstore.ps.link import CONTROL_BYTES, CONTROL_FRAMES, SCHEDULER_ID
from hora.kvstore.ps.net import (
    DropLog,
    Receiver,
    job_key,
    make_socket,
    node_name,
    peer_address,
    resolve_host,
    send,
)
from hora.kvstore.ps.wire import Cmd, Message, WireError

log = logging.getLogger(__name__)

_RCVHWM = 100  # messages queued per connection: a node sends a heartbeat per interval and waits on its requests
_TURN_FRAMES = 4096  # frames read per loop turn, so a flood cannot delay the heartbeats and liveness checks


@dataclasses.dataclass(slots=True)
class Node:
    """A registered node, as the scheduler sees it."""

    route: bytes
    role: str
    host: str
    pid: int
    addr: str
    rank_hint: int
    mode: str
    index: int = -1
    id: str = ""
    last_seen: float = 0.0
    state: str = "alive"  # alive | left | lost

    @property
    def name(self) -> str:
        return node_name(self.role, self.index, {"pid": self.pid, "host": self.host})


class Scheduler:
    """Runs the scheduler role until the job ends; :meth:`run` returns the process exit code."""

    def __init__(self, config: PSConfig) -> None:
        config.require_job()
        self.config = config
        self.key = job_key(config)
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, rcvhwm=_RCVHWM, max_bytes=CONTROL_BYTES)
        creds = secure.credentials(self.key, config.encrypt)
        secure.secure_listener(self.sock, creds)
        self.auth = secure.Authenticator(self.ctx, creds, "scheduler", self.sock)
        self.endpoint = f"tcp://{resolve_host(config.root_uri)}:{config.root_port}"
        try:
            self.sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ConfigError(f"the scheduler cannot bind {self.endpoint}: {e}. Is the port in use, and is "
                              f"DMLC_PS_ROOT_URI={config.root_uri!r} an address of this host?") from e
        self.nodes: dict[bytes, Node] = {}
        self.started = False
        self.barriers: dict[int, dict[int, int]] = {}  # seq -> worker rank -> request id
        self.barrier_results: dict[int, str] = {}  # finished seq -> error ("" when it passed)
        self.exit_code: int | None = None
        self.dead_since: float | None = None
        self.drops = DropLog("scheduler")
        self.receiver = Receiver(self.sock, CONTROL_FRAMES, self.drops)

    # --- main loop --------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve the job; 0 when every worker said goodbye, 1 when a node was lost or the job never started."""
        cfg = self.config
        log.info("scheduler listening on %s for %d workers and %d servers", self.endpoint, cfg.num_workers,
                 cfg.num_servers)
        t0 = time.monotonic()
        next_tick = t0
        try:
            while self.exit_code is None:
                if self.sock.poll(max(1, int((next_tick - time.monotonic()) * 1000))):
                    for frames in self.receiver.messages(_TURN_FRAMES):
                        self._on_message(frames[0].bytes, frames[1:])
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + cfg.heartbeat_s
                    self._tick(now, t0)
            return self.exit_code
        finally:
            self.close()

    def close(self) -> None:
        """Close the socket (letting queued notices go out) and the context."""
        if self.auth.refusals.total:
            log.info("scheduler: refused %d connections at the handshake in all", self.auth.refusals.total)
        self.sock.close(linger=2000)
        self.ctx.term()

    def _tick(self, now: float, t0: float) -> None:
        cfg = self.config
        for node in self._alive():
            self._send(node, {"c": int(Cmd.HEARTBEAT)})
        if self.dead_since is not None:  # the job is dead: wait for the survivors to leave, then exit
            workers_alive = [n for n in self._alive() if n.role == "worker"]
            if not workers_alive or now - self.dead_since > cfg.timeout_s:
                self.exit_code = 1
            return
        if not self.started and now - t0 > cfg.start_timeout_s:
            workers = sum(n.role == "worker" for n in self.nodes.values())
            servers = len(self.nodes) - workers
            self._abort(None, f"only {workers}/{cfg.num_workers} workers and {servers}/{cfg.num_servers} servers "
                        f"registered within {cfg.start_timeout_s:g} s (HORA_PS_START_TIMEOUT)")
            return
        for node in self._alive():
            silent = now - node.last_seen
            if silent > cfg.timeout_s:
                self._abort(node, f"no heartbeat for {silent:.1f} s (HORA_PS_TIMEOUT={cfg.timeout_s:g})")
                return

    # --- messages ---------------------------------------------------------------------------------
    def _on_message(self, route: bytes, frames: list) -> None:
        try:
            msg = wire.decode(frames, self.key)
        except WireError as e:
            self.drops.drop(e, peer_address(frames[0]) if frames else "?")
            return
        node = self.nodes.get(route)
        if msg.cmd is Cmd.REGISTER:
            self._on_register(route, msg, frames)
            return
        if node is None or msg["d"] != SCHEDULER_ID or (node.id and msg["s"] != node.id):
            self.drops.drop(f"{msg.cmd.name} from an unregistered or misaddressed node", peer_address(frames[0]))
            return
        node.last_seen = time.monotonic()
        if msg.cmd is Cmd.HEARTBEAT:
            return
        if node.role != "worker" or not self.started:
            self.drops.drop(f"{msg.cmd.name} from {node.role} {node.index}", peer_address(frames[0]))
            return
        if msg.cmd is Cmd.BARRIER:
            self._on_barrier(node, msg)
        elif msg.cmd is Cmd.GOODBYE:
            self._on_goodbye(node, msg)
        else:
            self.drops.drop(f"unexpected {msg.cmd.name} from {node.name}", peer_address(frames[0]))

    def _on_register(self, route: bytes, msg: Message, frames: list) -> None:
        cfg = self.config
        if route in self.nodes:  # a resent REGISTER
            node = self.nodes[route]
            node.last_seen = time.monotonic()
            if self.started:
                self._welcome(node)
            return
        role = msg["role"]
        count = sum(n.role == role for n in self.nodes.values())
        limit = {"worker": cfg.num_workers, "server": cfg.num_servers}.get(role)
        if limit is None or self.started or count >= limit:
            why = (f"role {role!r} is not a server or worker" if limit is None else
                   f"the job already has its {limit} {role}s (DMLC_NUM_{role.upper()}={limit})")
            log.warning("scheduler: refusing pid %s on %s: %s", msg["pid"], msg["host"], why)
            self._send_route(route, "", {"c": int(Cmd.NODE_LOST), "node": "", "detail": f"registration refused: {why}"})
            return
        self.nodes[route] = Node(route=route, role=role, host=msg["host"], pid=msg["pid"], addr=msg["addr"],
                                 rank_hint=msg["rank"], mode=msg["mode"], last_seen=time.monotonic())
        log.debug("scheduler: %s pid %s on %s registered (%d/%d)", role, msg["pid"], msg["host"], count + 1, limit)
        if len(self.nodes) == cfg.num_workers + cfg.num_servers:
            self._start()

    def _start(self) -> None:
        cfg = self.config
        servers = [n for n in self.nodes.values() if n.role == "server"]
        workers = [n for n in self.nodes.values() if n.role == "worker"]
        server_hints = [n.rank_hint for n in servers]
        use_server_hints = sorted(server_hints) == list(range(len(servers)))  # the launcher's indices, if valid
        if not use_server_hints and any(h >= 0 for h in server_hints):
            log.warning("scheduler: the servers' launch indices %s are not 0..%d each once (HORA_PS_SERVER_INDEX); "
                        "numbering servers in registration order", server_hints, len(servers) - 1)
        for i, node in enumerate(servers):
            node.index = node.rank_hint if use_server_hints else i
            node.id = f"s{node.index}"
        hints = [n.rank_hint for n in workers]
        use_hints = sorted(hints) == list(range(cfg.num_workers))
        for i, node in enumerate(workers):
            node.index = node.rank_hint if use_hints else i
            node.id = f"w{node.index}"
        modes = {n.mode for n in workers}
        if len(modes) > 1:
            detail = ", ".join(f"{n.name} created {n.mode!r}" for n in workers)
            self._abort(None, f"the workers disagree on the KVStore type ({detail}); every worker must create the "
                        "same type")
            return
        self.sync = modes.pop() in ("dist_sync", "dist_device_sync")
        self.started = True
        log.info("scheduler: job started (%s), servers %s", "sync" if self.sync else "async",
                 [n.addr for n in servers])
        for node in self.nodes.values():
            self._welcome(node)

    def _welcome(self, node: Node) -> None:
        servers = sorted((n for n in self.nodes.values() if n.role == "server"), key=lambda n: n.index)
        nodes = {n.id: n.name for n in self.nodes.values()}
        self._send(node, {"c": int(Cmd.WELCOME), "id": node.id, "rank": node.index,
                          "servers": [n.addr for n in servers], "nodes": nodes,
                          "num_workers": self.config.num_workers, "num_servers": self.config.num_servers,
                          "sync": self.sync})

    def _on_barrier(self, node: Node, msg: Message) -> None:
        seq = msg["seq"]
        if seq in self.barrier_results:  # a resend after the barrier finished
            self._send(node, {"c": int(Cmd.BARRIER_DONE), "i": msg["i"], "e": self.barrier_results[seq]})
            return
        self.barriers.setdefault(seq, {})[node.index] = msg["i"]
        self._settle_barriers()

    def _settle_barriers(self) -> None:
        workers = {n.index: n for n in self.nodes.values() if n.role == "worker"}
        for seq in sorted(self.barriers):
            arrived = self.barriers[seq]
            missing = [workers[r] for r in workers if r not in arrived]
            gone = [n for n in missing if n.state != "alive"]
            if missing and not gone:
                continue
            error = "" if not missing else (
                f"barrier {seq} cannot complete: {', '.join(n.name for n in gone)} left the job (closed its "
                "KVStore) before reaching it")
            for rank, rid in arrived.items():
                if workers[rank].state == "alive":
                    self._send(workers[rank], {"c": int(Cmd.BARRIER_DONE), "i": rid, "e": error})
            self.barrier_results[seq] = error
            del self.barriers[seq]

    def _on_goodbye(self, node: Node, msg: Message) -> None:
        self._send(node, {"c": int(Cmd.BYE), "i": msg["i"]})
        if node.state != "alive":
            return
        node.state = "left"
        log.debug("scheduler: %s said goodbye", node.name)
        workers_alive = [n for n in self._alive() if n.role == "worker"]
        if self.dead_since is not None:
            return
        if workers_alive:
            for other in self._alive():
                if other.role == "server":
                    self._send(other, {"c": int(Cmd.WORKER_LEFT), "rank": node.index, "node": node.name})
            self._settle_barriers()
            return
        log.info("scheduler: every worker said goodbye; stopping the servers")
        for other in self._alive():
            self._send(other, {"c": int(Cmd.STOP)})
        self.exit_code = 0

    def _abort(self, node: Node | None, detail: str) -> None:
        """Tell every node the job is dead (``node`` died, or, with None, the job cannot go on)."""
        name = ""
        if node is not None:
            node.state = "lost"
            name = node.name if self.started else f"{node.role} pid {node.pid} on {node.host}"
        log.error("scheduler: %s; telling every node and ending the job",
                  f"{name} was lost: {detail}" if name else detail)
        for other in self._alive():
            self._send(other, {"c": int(Cmd.NODE_LOST), "node": name, "detail": detail})
        if self.dead_since is None:
            self.dead_since = time.monotonic()
        if not self.started:
            self.exit_code = 1

    # --- helpers ----------------------------------------------------------------------------------
    def _alive(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.state == "alive"]

    def _send(self, node: Node, header: dict[str, Any]) -> None:
        self._send_route(node.route, node.id, header)

    def _send_route(self, route: bytes, dst: str, header: dict[str, Any]) -> None:
        send(self.sock, wire.encode({"s": SCHEDULER_ID, "d": dst, **header}, (), self.key), route)
