"""The elastic driver inside ``hora run``: hosts come and go, workers fail, rounds of rendezvous re-form the ring.

The driver owns three things:

* **the hosts** (:class:`~hora.runner.elastic.hosts.HostManager`): what
  discovery offers every ``discovery_interval`` seconds, minus blacklisted
  hosts (a host is blacklisted when one of its workers fails);
* **the workers**: it starts one per free slot of the usable hosts, up to
  ``--max-np``, and retires those on hosts that disappeared or were
  blacklisted;
* **the rounds**: a worker's ``init()`` sends ``join`` with the last round
  it took part in; once every live, unretired worker is waiting, and at
  least ``--min-np`` of them, the driver forms the next round: ranks follow
  the order the workers were started in (so rank 0 is always a worker that
  has the committed state), each worker gets its rank, size, local and cross
  placement, and the address of the store that the round's rank 0 hosts.
  Everything that breaks the current round (hosts added or removed, a
  worker lost) is an **event**: a timestamp and whether workers were added
  or removed.  A worker's ``events`` request waits (a long poll) for the events of
  its round after the last one it saw; they fill its ``State``'s queue of
  host messages, and the next ``commit()`` raises ``HostsUpdatedInterrupt``
  on every rank.

The job fails, with a message naming the flag, when fewer than ``--min-np``
workers can run for longer than ``--elastic-timeout``, when every host is
blacklisted for good, or when the ring re-forms more often than
``--reset-limit``.  It succeeds when the workers finish: once one exits 0,
no new worker starts, and the job ends when the others have exited.

The socket speaks :mod:`hora.elastic_wire`: every frame carries an HMAC of
the job secret, bound to a per-connection nonce.

Host loss in seconds: every remote host with workers is watched by a
beat-only agent over ssh (``host_watch``, the ssh launcher's
:class:`~hora.runner.launchers.ssh.HostWatch`); a host silent for
``HORA_HEARTBEAT_TIMEOUT`` seconds is lost: its workers count as failed, it
is blacklisted and their ssh sessions are killed.  Each worker of a round
keeps a ``watch`` connection to the driver open
(:mod:`hora.core.elastic.watch`), and when a member of the running round is
lost that way, or its host is dropped by discovery, the driver sends the
other members an ``abort`` on it, so their blocked collective ends at once
instead of after ``HORA_ELASTIC_COLLECTIVE_TIMEOUT``.  A worker that exits
needs no abort: its connections close with it and the others' collectives
fail within milliseconds (shutting the connections of an engine that is
already going down is what must not happen).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from hora import elastic_wire, envvars
from hora.errors import AuthError, HoraError
from hora.placement import Placement
from hora.runner.elastic.hosts import HostManager
from hora.runner.hostlist import is_local_host
from hora.runner.launchers.base import Interrupt, JobResult, RankExit, describe_returncode, exit_status
from hora.runner.output import OutputSink

log = logging.getLogger(__name__)

#: How often the main loop looks at exits, joins, signals and deadlines.
TICK_SECONDS = 0.05
#: Seconds a retired worker gets to leave on its own before it is stopped.
RETIRE_GRACE_SECONDS = 10.0
#: Connections that have not yet sent an authenticated first frame, at most; more are closed at once.
MAX_UNAUTHENTICATED = 64
#: Seconds a new connection has to send its first (authenticated) frame.
FIRST_FRAME_SECONDS = 5.0
#: Longest an ``events`` request waits for an event before answering with none (the worker then asks again).
EVENTS_WAIT_SECONDS = 10.0


class Discovery(Protocol):
    def find(self) -> dict[str, int]: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ElasticSettings:
    """The elastic flags of ``hora run``.

    Attributes:
        num_proc: workers to wait for before the first round (``-np``), at least ``min_np``.
        min_np: fewest workers the job trains with (``--min-np``).
        max_np: most workers (``--max-np``); None: every free slot.
        timeout_s: ``--elastic-timeout``: how long the job may have fewer
            than ``min_np`` workers, and how long a round may wait for a worker.
        reset_limit: ``--reset-limit``: most re-formations; None: unlimited.
        discovery_interval_s: seconds between runs of the discovery script.
    """

    num_proc: int
    min_np: int
    max_np: int | None = None
    timeout_s: float = 600.0
    reset_limit: int | None = None
    discovery_interval_s: float = 1.0


@dataclasses.dataclass(slots=True)
class Worker:
    """The driver's record of one worker process."""

    seq: int
    host: str
    alive: bool = True
    retired: bool = False
    retired_at: float | None = None
    returncode: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """Something that breaks the round it happened in: workers removed or added (``elastic_wire`` bits)."""

    seq: int
    timestamp: float
    update: int
    round: int


@dataclasses.dataclass(slots=True)
class _Join:
    channel: elastic_wire.Channel
    after: int
    addr: str
    port: int


def assign(members: list[Worker], stores: Mapping[int, tuple[str, int]], round_: int) -> dict[int, dict[str, Any]]:
    """The placement of each member of a new round (by worker seq).

    Ranks follow ``members``' order (the order workers were started in);
    hosts are numbered in the order of their first rank, local ranks in rank
    order within a host; the store is where the round's rank 0 said it
    would listen.
    """
    host_order: list[str] = []
    for w in members:
        if w.host not in host_order:
            host_order.append(w.host)
    per_host = {h: [w for w in members if w.host == h] for h in host_order}
    store_addr, store_port = stores[members[0].seq]
    out: dict[int, dict[str, Any]] = {}
    for rank, w in enumerate(members):
        local = per_host[w.host]
        place = Placement(
            rank=rank, size=len(members), local_rank=local.index(w), local_size=len(local),
            cross_rank=host_order.index(w.host), cross_size=len(host_order), host=w.host,
        )
        out[w.seq] = {"round": round_, **dataclasses.asdict(place), "store_addr": store_addr, "store_port": store_port}
    return out


class ElasticDriver:
    """Runs an elastic job to its end (see the module docstring).

    Args:
        settings: the elastic flags.
        hosts: the host bookkeeping (with its clock).
        discovery: where hosts come from.
        spawner: starts workers (``start(seq, host, env)``, ``signal(seqs, signum)``, ``exits`` queue).
        secret: the job secret.
        sink: the job's output (for the stderr tails of failed workers).
        interrupt: signals received by hora run.
        bind_addr: the address the driver listens on.
        advertise: the driver's address as a host sees it.
        clock: monotonic seconds.
        host_watch: tells which remote hosts stopped answering (``watch(host)``, ``lost()``); None: no
            host-loss detection beyond ssh's own keep-alive.
    """

    def __init__(self, settings: ElasticSettings, hosts: HostManager, discovery: Discovery, spawner: Any,
                 secret: str, sink: OutputSink, interrupt: Interrupt, bind_addr: str = "127.0.0.1",
                 advertise: Callable[[str], str] | None = None, clock: Callable[[], float] = time.monotonic,
                 host_watch: Any = None) -> None:
        self.settings = settings
        self.hosts = hosts
        self.discovery = discovery
        self.spawner = spawner
        self.secret = secret
        self.sink = sink
        self.interrupt = interrupt
        self.clock = clock
        self.advertise = advertise or (lambda host: bind_addr)
        self.host_watch = host_watch
        self._watches: dict[int, tuple[int, elastic_wire.Channel]] = {}  # seq -> (round, channel)
        self._addrs: dict[int, str] = {}  # seq -> the address the worker reached the driver from
        self.workers: dict[int, Worker] = {}
        self.round = 0
        self.members: list[int] = []
        self.events: list[Event] = []
        self._event_count = 0  # events are numbered across rounds, so a watcher's "after" stays meaningful
        self._last_timestamp = 0.0
        self.finishing = False
        self.failures: list[RankExit] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an event, a new round, or the driver closing
        self._waiting: dict[int, _Join] = {}
        self._requests: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._next_seq = 0
        self._short_since: float | None = None
        self._waiting_since: float | None = None
        self._last_discovery = -float("inf")
        self._started = False
        self._server = socket.create_server((bind_addr, 0), backlog=256)
        self._server.settimeout(0.2)
        self.port = self._server.getsockname()[1]
        self._closed = threading.Event()
        self._unauthenticated = threading.BoundedSemaphore(MAX_UNAUTHENTICATED)
        self._acceptor = threading.Thread(target=self._accept, name="hora-elastic-driver", daemon=True)
        self._acceptor.start()
        self._found: dict[str, int] | None = None
        self._discoverer: threading.Thread | None = None

    # ------------------------------------------------------------ socket side
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._unauthenticated.acquire(blocking=False):
                # Every slot is held by a connection that has not authenticated yet: a flood, not a worker.
                log.warning("elastic driver: %d connections have not authenticated yet; closing one from %s",
                            MAX_UNAUTHENTICATED, peer)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, peer), name="hora-elastic-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        sock.settimeout(FIRST_FRAME_SECONDS)
        try:
            channel = elastic_wire.Channel(sock, self.secret, server=True)
            message = channel.recv()
        except AuthError as e:
            log.warning("elastic driver: dropped a connection from %s: %s", peer, e)
            sock.close()
            return
        except (OSError, elastic_wire.WireError) as e:
            log.debug("elastic driver: connection from %s ended: %s", peer, e)
            sock.close()
            return
        finally:
            self._unauthenticated.release()
        sock.settimeout(None)
        op = message.get("op")
        try:
            seq = int(str(message.get("worker", "")).rpartition("-")[2])
        except ValueError:
            seq = -1
        if op == "events":
            try:
                round_, after = int(message.get("round", 0)), int(message.get("after", -1))
                events = self._wait_for_events(round_, after, EVENTS_WAIT_SECONDS)
                channel.send({"events": [[e.seq, e.timestamp, e.update] for e in events]})
            except (OSError, TypeError, ValueError):
                pass
            channel.close()
        elif op == "join":
            try:
                join = _Join(channel, int(message["after"]), str(message["addr"]), int(message["port"]))
            except (KeyError, TypeError, ValueError):
                channel.close()
                return
            self._requests.put(("join", (seq, join)))
        elif op == "watch" and seq >= 0:
            self._follow(seq, int(message.get("round", 0)), channel)
        else:
            channel.close()

    def _follow(self, seq: int, round_: int, channel: elastic_wire.Channel) -> None:
        """Keep one worker's watch line until it ends (runs on the connection's thread)."""
        with self._lock:
            old = self._watches.get(seq)
            self._watches[seq] = (round_, channel)
        if old is not None:
            old[1].close()
        try:
            while True:
                channel.recv()  # the worker says nothing more; this only notices the end
        except (OSError, elastic_wire.WireError, AuthError):
            pass
        with self._lock:
            if self._watches.get(seq, (0, None))[1] is channel:
                del self._watches[seq]
        channel.close()
    def _note(self, update: int) -> None:
        """Record an event of the current round and wake the watchers."""
        with self._changed:
            # Strictly increasing, so that every event is newer than the one a worker saw last.
            self._last_timestamp = max(time.time(), self._last_timestamp + 1e-6)
            self.events.append(Event(self._event_count, self._last_timestamp, update, self.round))
            self._event_count += 1
            self._changed.notify_all()

    def _wait_for_events(self, round_: int, after: int, timeout: float) -> list[Event]:
        """The events of ``round_`` after event ``after``: at once if there are some, else when one happens,
        the round changes or ``timeout`` passes (then none)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                events = [e for e in self.events if e.round == round_ and e.seq > after]
                remaining = deadline - time.monotonic()
                if events or self.round != round_ or self._closed.is_set() or remaining <= 0:
                    return events
                self._changed.wait(remaining)

    # ------------------------------------------------------------- the loop
    def run(self) -> JobResult:
        """Drive the job until it ends; returns its outcome."""
        try:
            while True:
                signum = self.interrupt.pop()
                if signum is not None:
                    self._stop_all(signum)
                    return JobResult(exit_code=128 + signum, interrupted_by=signum)
                self._reap()
                self._check_heartbeats()
                self._take_requests()
                now = self.clock()
                self._discover(now)
                result = self._check_end(now)
                if result is not None:
                    return result
                self._reconcile(now)
                failure = self._try_form(now)
                if failure is not None:
                    return failure
                time.sleep(TICK_SECONDS)
        finally:
            self.close()

    def _discover(self, now: float) -> None:
        """Start the next discovery run when one is due, and take the latest result.

        The script may take seconds (probing hosts over ssh), so it runs on its own thread: this loop
        must keep answering joins.  Only while no host is known yet does it run here, synchronously.
        """
        busy = self._discoverer is not None and self._discoverer.is_alive()
        if not busy and now - self._last_discovery >= self.settings.discovery_interval_s:
            self._last_discovery = now

            def find() -> None:
                result = self.discovery.find()
                with self._lock:
                    self._found = result

            if self.hosts.discovered:
                self._discoverer = threading.Thread(target=find, name="hora-elastic-discovery", daemon=True)
                self._discoverer.start()
            else:
                find()
        with self._lock:
            found, self._found = self._found, None
        if found is not None and self.hosts.update(found):
            log.info("discovered hosts: %s", self.hosts.discovered)

    def _eligible(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive and not w.retired]

    def _reap(self) -> None:
        while True:
            try:
                seq, code = self.spawner.exits.get_nowait()
            except queue.Empty:
                return
            worker = self.workers.get(seq)
            if worker is None or not worker.alive:  # unknown, or already given up as lost
                continue
            worker.alive, worker.returncode = False, code
            join = self._waiting.pop(seq, None)
            if join is not None:
                join.channel.close()
            if seq in self.members:
                self._note(elastic_wire.HOSTS_REMOVED)
            if worker.retired:
                log.info("retired worker %d on %s %s", seq, worker.host, describe_returncode(code))
            elif code == 0:
                log.info("worker %d on %s finished", seq, worker.host)
                self.finishing = True
            else:
                tail = tuple(self.sink.tail(seq))
                self.failures.append(RankExit(rank=seq, host=worker.host, returncode=code, stderr_tail=tail,
                                              note="worker sequence number, not a rank"))
                log.warning("worker %d on %s %s", seq, worker.host, describe_returncode(code))
                if not self.hosts.is_blacklisted(worker.host):  # its other workers going down too is one event
                    self.hosts.blacklist(worker.host)

    def _check_heartbeats(self) -> None:
        """Give up on the workers of hosts that stopped answering."""
        for host, note in self.host_watch.lost() if self.host_watch is not None else ():
            lost = [w for w in self.workers.values() if w.host == host and w.alive and not w.retired]
            if not lost:
                continue
            log.warning("%s", note)
            for w in lost:
                w.alive, w.returncode = False, 255
                join = self._waiting.pop(w.seq, None)
                if join is not None:
                    join.channel.close()
                self.failures.append(RankExit(rank=w.seq, host=w.host, returncode=255, note=note,
                                              stderr_tail=tuple(self.sink.tail(w.seq))))
            self.spawner.signal([w.seq for w in lost], signal.SIGKILL)  # its ssh session: no use waiting for it
            if not self.hosts.is_blacklisted(host):
                self.hosts.blacklist(host)
            self._abort_round([w.seq for w in lost], note)

    def _abort_round(self, lost: list[int], reason: str) -> None:
        """Tell the other members of the running round to leave it now, if any of ``lost`` is a member."""
        with self._lock:
            if not any(seq in self.members for seq in lost):
                return
            round_, members = self.round, list(self.members)
            watches = dict(self._watches)
        self._note(elastic_wire.HOSTS_REMOVED)  # a member is gone: the ring is broken
        addrs = sorted({self._addrs[seq] for seq in members if seq in self._addrs})
        message = {"abort": reason, "round": round_, "addrs": addrs}
        told = []
        for seq in members:
            watch = watches.get(seq)
            if seq in lost or watch is None or watch[0] != round_:
                continue
            try:
                watch[1].send(message)
                told.append(seq)
            except OSError as e:
                log.debug("elastic driver: could not tell worker %d to leave round %d: %s", seq, round_, e)
        log.info("round %d aborted (%s); told workers %s", round_, reason, told)

    def _take_requests(self) -> None:
        while True:
            try:
                _, (seq, join) = self._requests.get_nowait()
            except queue.Empty:
                return
            worker = self.workers.get(seq)
            if worker is None or not worker.alive or worker.retired or self.finishing:
                reason = "the job is finishing" if self.finishing else "its host left the job"
                self._reply(join, {"stop": reason})
                continue
            if join.after >= self.round and seq in self.members:
                self._note(elastic_wire.HOSTS_REMOVED)  # a member of the current round left it: the ring is broken
            old = self._waiting.pop(seq, None)
            if old is not None:
                old.channel.close()
            self._waiting[seq] = join

    def _reply(self, join: _Join, message: dict[str, Any]) -> None:
        try:
            join.channel.send(message)
        except OSError as e:
            log.debug("elastic driver: could not answer a join: %s", e)
        join.channel.close()

    def _reconcile(self, now: float) -> None:
        """Retire workers on hosts that are no longer usable; start workers on free slots."""
        available = self.hosts.available()
        for w in self._eligible():
            if w.host not in available:
                w.retired, w.retired_at = True, now
                self._note(elastic_wire.HOSTS_REMOVED)
                join = self._waiting.pop(w.seq, None)
                if join is not None:
                    self._reply(join, {"stop": "its host left the job"})
                self._abort_round([w.seq], f"discovery no longer lists {w.host}")
        for w in self.workers.values():
            if w.retired and w.alive and w.retired_at is not None and now - w.retired_at > RETIRE_GRACE_SECONDS:
                self.spawner.signal([w.seq], signal.SIGTERM if now - w.retired_at < 2 * RETIRE_GRACE_SECONDS
                                    else signal.SIGKILL)
        if self.finishing:
            return
        free = sum(available.values())
        if not self._started and free < self.settings.num_proc:
            return  # wait for -np slots before the first round (bounded by the min-np timeout)
        running = self._eligible()
        limit = self.settings.max_np if self.settings.max_np is not None else free
        per_host = {h: sum(1 for w in running if w.host == h) for h in available}
        started = []
        for host, slots in available.items():
            while per_host[host] < slots and len(running) + len(started) < limit:
                started.append(self._start(host, len(running) + len(started)))
                per_host[host] += 1
        if started:
            self._started = True
            if self.round > 0:
                self._note(elastic_wire.HOSTS_ADDED)

    def _start(self, host: str, provisional_rank: int) -> Worker:
        seq = self._next_seq
        self._next_seq += 1
        worker = Worker(seq, host)
        self.workers[seq] = worker
        env = {
            envvars.HORA_ELASTIC_DRIVER_ADDR: self.advertise(host),
            envvars.HORA_ELASTIC_DRIVER_PORT: str(self.port),
            envvars.HORA_ELASTIC_WORKER_ID: f"{host}-{seq}",
            envvars.HORA_ELASTIC_TIMEOUT: f"{self.settings.timeout_s:g}",
            envvars.HORA_HOSTNAME: host, envvars.HOROVOD_PLACEMENT[-1]: host,
            envvars.HORA_RANK: str(provisional_rank), envvars.HOROVOD_PLACEMENT[0]: str(provisional_rank),
        }
        self.spawner.start(seq, host, env)
        if self.host_watch is not None:
            self.host_watch.watch(host)
        return worker

    def _try_form(self, now: float) -> JobResult | None:
        eligible = self._eligible()
        if len(eligible) < self.settings.min_np:
            if self._short_since is None:
                self._short_since = now
            elif now - self._short_since > self.settings.timeout_s:
                return self._fail(f"fewer than --min-np {self.settings.min_np} workers could run for "
                                  f"{self.settings.timeout_s:g} s (--elastic-timeout); {len(eligible)} running, "
                                  f"usable hosts: {self.hosts.available() or 'none'}")
            return None
        self._short_since = None
        if not all(w.seq in self._waiting for w in eligible):
            if self._waiting and self._waiting_since is None:
                self._waiting_since = now
            if self._waiting_since is not None and now - self._waiting_since > self.settings.timeout_s:
                late = [w for w in eligible if w.seq not in self._waiting]
                log.warning("workers %s did not join the next round within %g s; stopping them",
                            [w.seq for w in late], self.settings.timeout_s)
                self.spawner.signal([w.seq for w in late], signal.SIGKILL)
                self._waiting_since = now
            return None
        self._waiting_since = None
        members = sorted(eligible, key=lambda w: w.seq)
        round_ = self.round + 1
        resets = round_ - 1
        if self.settings.reset_limit is not None and resets > self.settings.reset_limit:
            return self._fail(f"the ring was re-formed {resets} times, more than --reset-limit "
                              f"{self.settings.reset_limit}")
        stores = {w.seq: (self._waiting[w.seq].addr, self._waiting[w.seq].port) for w in members}
        addr, port = stores[members[0].seq]
        remote = next((w.host for w in members if not is_local_host(w.host)), None)
        if remote is not None and ipaddress.ip_address(addr).is_loopback:
            # Rank 0 runs here and reached the driver over loopback: the other hosts need this machine's
            # address towards them, which rank 0's store then listens on.
            stores[members[0].seq] = (self.advertise(remote), port)
        self._addrs.update({seq: addr for seq, (addr, _) in stores.items()})  # where its peers reach it
        placement = assign(members, stores, round_)
        with self._changed:
            self.round = round_
            self.members = [w.seq for w in members]
            # Events of rounds before the previous one can no longer be asked for.
            self.events = [e for e in self.events if e.round >= round_ - 1]
            self._changed.notify_all()
        log.info("round %d: %d workers on %s", round_, len(members),
                 ",".join(dict.fromkeys(w.host for w in members)))
        for w in members:
            self._reply(self._waiting.pop(w.seq), placement[w.seq])
        return None

    def _check_end(self, now: float) -> JobResult | None:
        alive = [w for w in self.workers.values() if w.alive]
        if self.finishing:
            for seq in list(self._waiting):
                self._reply(self._waiting.pop(seq), {"stop": "the job is finishing"})
            if not alive:
                return JobResult(exit_code=0)
            return None
        if self.hosts.all_blacklisted_for_good() and not any(not w.retired for w in alive):
            return self._fail("every host is blacklisted after its workers failed")
        return None

    def _fail(self, message: str) -> JobResult:
        log.error("elastic job failed: %s", message)
        self._stop_all(signal.SIGTERM)
        details: list[str] = []
        for f in self.failures[:8]:
            details.append(f"worker {f.rank} on {f.host} {describe_returncode(f.returncode)}")
            details += [f"  {line}" for line in f.stderr_tail[-5:]]
        code = exit_status(self.failures[0].returncode) if self.failures else 1
        return JobResult(exit_code=code or 1, message=message, details=tuple(details))

    def _stop_all(self, signum: int) -> None:
        for seq in list(self._waiting):
            self._reply(self._waiting.pop(seq), {"stop": "the job is stopping"})
        alive = [w.seq for w in self.workers.values() if w.alive]
        self.spawner.signal(alive, signum)
        deadline = time.monotonic() + 5.0
        while any(w.alive for w in self.workers.values()) and time.monotonic() < deadline:
            self._reap_quietly(0.1)
        still = [w.seq for w in self.workers.values() if w.alive]
        if still:
            self.spawner.signal(still, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while any(w.alive for w in self.workers.values()) and time.monotonic() < deadline:
                self._reap_quietly(0.1)

    def _reap_quietly(self, timeout: float) -> None:
        try:
            seq, code = self.spawner.exits.get(timeout=timeout)
        except queue.Empty:
            return
        if seq in self.workers:
            self.workers[seq].alive, self.workers[seq].returncode = False, code

    def close(self) -> None:
        """Stop listening and drop waiting connections."""
        self._closed.set()
        with self._changed:
            self._changed.notify_all()
        try:
            self._server.close()
        except OSError:
            pass
        for join in self._waiting.values():
            join.channel.close()
        self._waiting.clear()
        with self._lock:
            watches, self._watches = list(self._watches.values()), {}
        for _, channel in watches:
            channel.close()


def route_address(host: str, fallback: str) -> str:
    """This machine's address on the route to ``host`` (``fallback`` for this machine or when unresolvable)."""
    if is_local_host(host):
        return fallback
    try:
        target = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError as e:
        raise HoraError(f"no route from this machine to host {host!r} ({e})") from e
