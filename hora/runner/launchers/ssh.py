"""The ssh launcher: one agent per host starts that host's processes and reports back.

For each host of the job, ``hora run`` starts :mod:`hora.runner.agent`:
over ssh for other hosts (``BatchMode``, the job's port, identity and
config, see :mod:`hora.runner.ssh`), as a plain child for this machine.
All hosts are reached in parallel.  The launch then goes in three steps, so
that a problem on one host starts nothing anywhere:

1. every agent says hello (an unreachable host fails here, by name, within
   the connect timeout); the rendezvous address is chosen from the answers;
2. every agent checks its share (the working directory, each program on its
   PATH) and says ready;
3. every agent starts its processes.

Fail fast: the first process that fails, on any host, makes the launcher
tell every agent to signal its processes (SIGTERM, then SIGKILL after the
grace period).  An agent whose connection drops stops its own processes, so
nothing is left running on a host whatever happens to the launcher; and a
host that stops answering ends the job with a root cause naming it.

Heartbeats (:mod:`hora.runner.heartbeat`) ride on the same ssh sessions: each
agent beats every ``HORA_HEARTBEAT_INTERVAL`` seconds and the launcher beats
back, so a host cut off without a word (no FIN, no RST) is lost after
``HORA_HEARTBEAT_TIMEOUT`` seconds rather than when ssh's keep-alive gives
up; its agent, hearing nothing either, stops what it runs.  :class:`HostWatch`
runs agents that start nothing and only beat, for launchers whose ranks
another tool starts (mpirun).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora import envvars
from hora.config import HeartbeatConfig
from hora.errors import LaunchError
from hora.runner.agent import MARKER
from hora.runner.env import Endpoints, forwarded_names, free_port, interface_address
from hora.runner.heartbeat import Beater, Liveness, lost_note
from hora.runner.hostlist import is_local_host
from hora.runner.keys import Key, parse_key
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import Interrupt, JobResult, Slot, Supervisor, new_group_kwargs, signal_group
from hora.runner.launchers.registry import MPI_ARGS_NEED_MPIRUN, MPI_NEEDS_MPIRUN, Capabilities, Launcher, Request
from hora.runner.output import TAIL_LINES, OutputSink, pump, split_prefixed
from hora.runner.plan import slot_command
from hora.runner.ssh import SshOptions, agent_command, local_agent_command, sync_directory

logger = logging.getLogger(__name__)

#: Extra seconds, beyond ssh's connect timeout, a host gets to start its agent and say hello.
HELLO_SLACK_SECONDS = 20.0
#: How long the agents may take to check their share of the job.
READY_TIMEOUT_SECONDS = 60.0
#: After SIGKILL was sent, how long a host may take to confirm before its connection is cut.
UNRESPONSIVE_SECONDS = 5.0


def host_env(
    env: Mapping[str, str], config: LaunchConfig, *, local: bool, node_host: str | None = None
) -> dict[str, str]:
    """The job's environment as the agent of one host gets it (each process adds its :meth:`Slot.env`).

    On this machine all of ``env``; on another host only the variables of
    :func:`forwarded_names`, because the host's own login environment gives
    the rest.  With parameter servers, ``node_host`` (the host's address on a
    multi-host job) becomes its ``DMLC_NODE_HOST``.
    """
    common = dict(env) if local else {name: env[name] for name in forwarded_names(env, config)}
    if node_host is not None and config.num_servers > 0:
        common[envvars.DMLC_NODE_HOST] = node_host
    return common


class AgentLink:
    """The launcher's end of one host's agent."""

    def __init__(self, host: str, local: bool, command: list[str], events: queue.Queue, via: str = "ssh") -> None:
        self.host = host
        self.local = local
        self.via = via
        self.events = events
        self.hello: dict[str, Any] | None = None
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.sink: OutputSink | None = None
        self.done = False
        self.liveness: Liveness | None = None  # set once the job runs: every line counts as a beat
        self.stdin_lock = threading.Lock()
        try:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
                **new_group_kwargs(),
            )
        except OSError as e:
            raise LaunchError(f"cannot start {command[0]!r} to reach {host}: {e.strerror or e}") from e
        self.stderr_pump = pump(self.proc.stderr, self._stderr_line)  # type: ignore[arg-type]
        self.stdout_pump = threading.Thread(target=self._read_stdout, name=f"hora-agent-{host}", daemon=True)
        self.stdout_pump.start()

    def _read_stdout(self) -> None:
        try:
            for line in iter(self.proc.stdout.readline, b""):  # type: ignore[union-attr]
                if self.liveness is not None:
                    self.liveness.beat(self.host)
                self._stdout_line(line)
        except (OSError, ValueError):
            pass
        self.stderr_pump.join(2.0)  # ssh's own last words explain why the connection ended
        self.events.put((self.host, {"eof": self.proc.wait()}))

    def _stdout_line(self, line: bytes) -> None:
        if line.startswith(MARKER):
            try:
                record = json.loads(line[len(MARKER):])
            except ValueError:
                record = None
            if isinstance(record, dict):
                if "hello" in record:
                    self.hello = record["hello"]
                self.events.put((self.host, record))
                return
        prefixed = split_prefixed(line)
        if prefixed is not None and self.sink is not None:
            self.sink.emit(*prefixed)
        elif self.sink is not None:
            self.sink.emit_raw("stdout", line)  # e.g. a login script that prints
        else:
            logger.debug("%s: %s", self.host, line.decode("utf-8", errors="replace").rstrip())

    def _stderr_line(self, line: bytes) -> None:
        text = line.decode("utf-8", errors="replace").rstrip("\r\n")
        self.stderr_tail.append(text)
        if self.sink is not None:
            self.sink.emit_raw("stderr", f"hora run: {self.host}: {text}".encode())

    def send(self, **record: Any) -> bool:
        """Send one message; False if the agent can no longer be reached."""
        data = json.dumps(record).encode() + b"\n"
        with self.stdin_lock:
            try:
                self.proc.stdin.write(data)  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
                return True
            except (OSError, ValueError):
                return False

    def cut(self) -> None:
        """Give up on a host that stopped answering: kill its ssh at once (closing would wait on it)."""
        signal_group(self.proc.pid, signal.SIGKILL)

    def close(self, wait: float) -> None:
        """Close the control channel (the agent then stops what still runs) and reap ssh."""
        with self.stdin_lock, _suppress():
            self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            signal_group(self.proc.pid, signal.SIGKILL)
            with _suppress():
                self.proc.wait(timeout=5)

    def why_gone(self) -> str:
        """What ssh (or the agent) said before the connection ended."""
        code = self.proc.poll()
        lines = [line for line in self.stderr_tail if line.strip()]
        said = " / ".join(lines[-3:]) if lines else "no error message"
        what = "the local agent" if self.local else self.via
        return f"{what} exited with code {code}: {said}" if code is not None else said


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, value: BaseException | None, tb: object) -> bool:
        return kind is not None and issubclass(kind, (OSError, ValueError, subprocess.TimeoutExpired))


class SshLauncher(Launcher):
    """Starts each host's processes through an agent reached over ssh (see the module docstring)."""

    name = "ssh"
    summary = "other hosts over ssh"
    detects = "when -H names another machine"
    priority = 10  # a host that is not this machine can only be reached over ssh
    capabilities = Capabilities(servers=True, elastic=True, sync_dst_dir=True)
    refusals = {"controller": MPI_NEEDS_MPIRUN, "mpi_args": MPI_ARGS_NEED_MPIRUN}
    checks_command = True  # each host's agent checks the command where it runs
    #: Whether remote agents get the whole job environment, not only :func:`forwarded_names` (a launcher
    #: whose remote processes start without the user's login environment sets it).
    forward_all = False

    @classmethod
    def detect(cls, request: Request) -> bool:
        """A host named (``-H``, ``--hostfile``, ``--server-hosts``) is not this machine."""
        return any(not is_local_host(h.host) for h in request.hosts or ())

    def __init__(self) -> None:
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.agents: dict[str, AgentLink] = {}
        self.cwd = os.getcwd()
        self.ssh = SshOptions()
        self.host_addrs: dict[str, str] = {}
        self.heartbeat = HeartbeatConfig()
        self.beater: Beater | None = None

    # -- before the environment exists --

    def prepare(self, config: LaunchConfig, slots: Sequence[Slot]) -> Endpoints:
        """Copy files (``--sync-dst-dir``), reach every host, and choose the rendezvous address.

        Raises:
            LaunchError: a copy failed, or a host could not be reached (the
                message names each such host and what ssh said).
        """
        self.ssh = SshOptions.from_config(config)
        self.heartbeat = HeartbeatConfig.from_env()
        hosts = list(dict.fromkeys(s.host for s in slots))
        local = {h: is_local_host(h) for h in hosts}
        if config.sync_dst_dir is not None:
            logger.info("copying %s to %s on %s", self.cwd, config.sync_dst_dir, ", ".join(hosts))
            sync_directory(self.cwd, [(h, local[h]) for h in hosts], config.sync_dst_dir, self.ssh)
            self.cwd = config.sync_dst_dir
        path = config.env.get("PATH", os.environ.get("PATH"))
        for host in hosts:
            command = local_agent_command() if local[host] else self.ssh.command(host, agent_command(path))
            self.agents[host] = AgentLink(host, local[host], command, self.events)
        self._wait_for_hellos(config.ssh_connect_timeout + HELLO_SLACK_SECONDS)
        return self._endpoints(config, slots)

    def _wait_for_hellos(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        failed: dict[str, str] = {}
        later: list[tuple[str, dict[str, Any]]] = []  # an agent that ended after its hello: for the next step
        while any(a.hello is None for h, a in self.agents.items() if h not in failed):
            try:
                host, record = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                for host, agent in self.agents.items():
                    if agent.hello is None and host not in failed:
                        said = " / ".join(list(agent.stderr_tail)[-2:])
                        failed[host] = f"did not answer within {timeout:g} s" + (f" ({said})" if said else "")
                break
            if "eof" in record and self.agents[host].hello is None:
                failed[host] = f"cannot be reached: {self.agents[host].why_gone()}"
            elif "hello" not in record:
                later.append((host, record))
        for event in later:
            self.events.put(event)
        if failed:
            lines = [f"host {host} {why}" for host, why in failed.items()]
            first = next(iter(failed))
            if not self.agents[first].local and self.agents[first].via == "ssh":
                lines.append(f"check with: {shlex.join(['ssh', *self.ssh.head(), first, 'true'])}")
            raise LaunchError("; ".join(lines))

    def _endpoints(self, config: LaunchConfig, slots: Sequence[Slot]) -> Endpoints:
        iface = config.network_interface
        remote_hellos = [a.hello for a in self.agents.values() if not a.local and a.hello]
        # The address our remote hosts reached us from is how they can reach this machine.
        seen_as = next((h["ssh"].split()[0] for h in remote_hellos if h.get("ssh")), None)
        addrs: dict[str, str] = {}
        for host, agent in self.agents.items():
            hello = agent.hello or {}
            if iface:
                if iface not in hello.get("addrs", {}):
                    have = ", ".join(sorted(hello.get("addrs", {}))) or "none with IPv4"
                    raise LaunchError(f"--network-interface {iface!r} does not exist on {host} (it has: {have})")
                addrs[host] = hello["addrs"][iface]
            elif agent.local:
                addrs[host] = seen_as or "127.0.0.1"
            else:
                addrs[host] = hello.get("ssh", "").split()[2] if len(hello.get("ssh", "").split()) > 2 else host
        root = next(s for s in slots if s.key == 0).host
        if self.agents[root].local:
            address = interface_address(iface) if iface else addrs[root]
            port = free_port("" if address != "127.0.0.1" else address)
            ps_port = None
            while config.num_servers > 0 and ps_port in (None, port):
                ps_port = free_port("")
        else:
            address = addrs[root]
            port, ps_port = self.agents[root].hello["ports"][:2]  # type: ignore[index]
            ps_port = ps_port if config.num_servers > 0 else None
        self.host_addrs = addrs if len(addrs) > 1 else {}
        return Endpoints(addr=address, port=port, ps_port=ps_port, host_addrs=self.host_addrs)

    # -- the job --

    def run(
        self,
        config: LaunchConfig,
        slots: Sequence[Slot],
        env: Mapping[str, str],
        sink: OutputSink,
        interrupt: Interrupt,
    ) -> JobResult:
        """Have every agent check its share, start them all, and supervise until all have ended."""
        for host, agent in self.agents.items():
            common = host_env(env, config, local=agent.local or self.forward_all, node_host=self.host_addrs.get(host))
            processes = [
                {"key": str(s.key), "argv": slot_command(config, s), "env": s.env()} for s in slots if s.host == host
            ]
            agent.send(op="spec", cwd=self.cwd, env=common, processes=processes, grace=config.grace_period,
                       heartbeat=[self.heartbeat.interval_s, self.heartbeat.timeout_s])
        # From the spec on, an agent counts the launcher's silence: beat while the slowest host gets ready too.
        agents = dict(self.agents)
        self.beater = Beater(lambda: agents.values(), lambda a: a.send(op="beat"),  # type: ignore[attr-defined]
                             self.heartbeat.interval_s).start()
        self._wait_until_ready()
        liveness = Liveness(self.heartbeat.timeout_s)
        for host, agent in self.agents.items():
            agent.sink = sink
            liveness.watch(host)
            agent.liveness = liveness
        for agent in self.agents.values():
            agent.send(op="start")
        supervisor = _SshSupervisor(self.agents, self.events, slots, sink, interrupt, config)
        supervisor.watch(liveness, self.heartbeat)
        return supervisor.run()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        waiting = set(self.agents)
        errors: dict[str, str] = {}
        later: list[tuple[str, dict[str, Any]]] = []  # events for the supervisor
        while waiting:
            try:
                host, record = self.events.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    errors.update({h: f"did not confirm within {READY_TIMEOUT_SECONDS:g} s" for h in waiting})
                    break
                continue
            if "ready" in record and host in waiting:
                waiting.discard(host)
            elif "error" in record and host in waiting:
                errors[host] = str(record["error"])
                waiting.discard(host)
            elif "eof" in record and host in waiting:
                errors[host] = f"ended before starting anything: {self.agents[host].why_gone()}"
                waiting.discard(host)
            else:
                later.append((host, record))
        for event in later:
            self.events.put(event)
        if errors:
            by_message: dict[str, list[str]] = collections.defaultdict(list)
            for host in self.agents:  # in the order of the host list
                if host in errors:
                    by_message[errors[host]].append(host)
            raise LaunchError("; ".join(f"{why} (on {', '.join(hosts)})" for why, hosts in by_message.items()))

    def close(self) -> None:
        """Close every agent's control channel (each then stops what still runs) and reap ssh."""
        if self.beater is not None:
            self.beater.stop()
        agents, self.agents = list(self.agents.values()), {}
        threads = [threading.Thread(target=a.close, args=(10.0,), daemon=True) for a in agents]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20.0)


class _SshSupervisor(Supervisor):
    """Exits arrive from the agents; a broken connection counts as a failure of what ran there."""

    def __init__(
        self,
        agents: Mapping[str, AgentLink],
        events: queue.Queue[tuple[str, dict[str, Any]]],
        slots: Sequence[Slot],
        sink: OutputSink,
        interrupt: Interrupt,
        config: LaunchConfig,
    ) -> None:
        super().__init__(slots, sink, interrupt, config.grace_period, config.server_grace)
        self.agents = agents
        self.events = events
        self.keys_by_host: dict[str, list[Key]] = collections.defaultdict(list)
        for slot in slots:
            self.keys_by_host[slot.host].append(slot.key)
        self.abandoned = False
        self.liveness: Liveness | None = None
        self.heartbeat = HeartbeatConfig()

    def watch(self, liveness: Liveness, heartbeat: HeartbeatConfig) -> None:
        """Count a host silent for ``heartbeat.timeout_s`` as lost, with what ran there."""
        self.liveness, self.heartbeat = liveness, heartbeat

    def wait(self, timeout: float) -> list[tuple[Key, int, str]]:
        try:
            host, record = self.events.get(timeout=timeout)
        except queue.Empty:
            return []
        found = []
        while True:
            found += self._exits(host, record)
            try:
                host, record = self.events.get_nowait()
            except queue.Empty:
                return found

    def _exits(self, host: str, record: dict[str, Any]) -> list[tuple[Key, int, str]]:
        agent = self.agents[host]
        if "exit" in record:
            key = parse_key(str(record["exit"]["key"]))
            return [(key, int(record["exit"]["returncode"]), "")]
        if "done" in record:
            agent.done = True
        if ("done" in record or "eof" in record) and self.liveness is not None:
            self.liveness.forget(host)
        if "eof" in record:
            lost = [k for k in self.keys_by_host[host] if k not in self.exits]
            if lost:
                note = f"lost: the connection to {host} ended; {agent.why_gone()}"
                return [(key, 255, note) for key in lost]
        return []

    def deliver(self, keys: Sequence[Key], signum: int) -> None:
        wanted = set(keys)
        for host, agent in self.agents.items():
            mine = [str(k) for k in self.keys_by_host[host] if k in wanted]
            if mine:
                agent.send(op="signal", signum=int(signum), keys=mine)

    def tick(self, now: float) -> None:
        self._check_heartbeats()
        if self.abandoned or self.killed_at is None or now - self.killed_at < UNRESPONSIVE_SECONDS:
            return
        self.abandoned = True
        for host, agent in self.agents.items():
            lost = [k for k in self.keys_by_host[host] if k not in self.exits]
            if lost:
                logger.warning("%s did not confirm that its processes ended; closing its connection", host)
                agent.close(wait=2.0)
                for key in lost:
                    self.record(key, -signal.SIGKILL, f"{host} did not answer; its connection was closed")

    def _check_heartbeats(self) -> None:
        if self.liveness is None:
            return
        for host, silence in self.liveness.newly_lost():
            agent = self.agents[host]  # type: ignore[index]
            lost = [k for k in self.keys_by_host[host] if k not in self.exits]  # type: ignore[index]
            if agent.done or not lost:
                continue
            note = lost_note(str(host), silence, self.heartbeat)
            logger.warning("%s", note)
            agent.cut()
            for key in lost:
                self.record(key, 255, note)

    def finish(self) -> None:
        for agent in self.agents.values():
            agent.close(wait=5.0)



class HostWatch:
    """Agents that start nothing and only beat: liveness of hosts whose processes hora does not start itself.

    mpirun starts its ranks, and the elastic driver starts its workers over
    plain ssh; a separate agent per remote host, in watch mode, gives both
    the ssh launcher's heartbeats.  Being its own process, it beats however
    busy the host's workers are (a worker holding Python's GIL while gloo
    connects cannot beat for itself).  The handshake runs on a thread, so the
    job starts without waiting for it; a host whose agent cannot be started is
    not watched (what runs there fails on its own).  :meth:`lost` says which
    hosts stopped answering since the last call.  ``command`` builds the
    command that reaches a host's agent (default: ssh); the slurm launcher
    passes ``srun --overlap``.
    """

    def __init__(self, hosts: Sequence[str], ssh: SshOptions, heartbeat: HeartbeatConfig,
                 path: str | None = None, command: Callable[[str], list[str]] | None = None,
                 via: str = "ssh") -> None:
        self.heartbeat = heartbeat
        self.ssh = ssh
        self.path = path
        # How an agent is reached on a host; a batch system's own channel (srun) where ssh may be refused.
        self.command = command or (lambda host: self.ssh.command(host, agent_command(self.path)))
        self.via = via
        self.liveness = Liveness(heartbeat.timeout_s)
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.agents: dict[str, AgentLink] = {}
        self._lost: queue.Queue[tuple[str, str]] = queue.Queue()
        self._closed = threading.Event()
        for host in dict.fromkeys(hosts):
            self.watch(host)
        self.beater = Beater(self._watched, lambda a: a.send(op="beat"), heartbeat.interval_s,  # type: ignore[attr-defined]
                             name="hora-hostwatch-beat").start()
        self._thread = threading.Thread(target=self._run, name="hora-hostwatch", daemon=True)
        self._thread.start()

    def watch(self, host: str) -> None:
        """Start watching ``host`` (again, if its agent ended); this machine is never watched."""
        if is_local_host(host) or self._closed.is_set():
            return
        agent = self.agents.get(host)
        if agent is not None and agent.proc.poll() is None:
            return
        try:
            self.agents[host] = AgentLink(host, False, self.command(host), self.events, via=self.via)
        except LaunchError as e:
            logger.warning("cannot watch %s: %s", host, e)

    def _watched(self) -> list[AgentLink]:
        return [a for h, a in self.agents.items() if h in self.liveness.heard]

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                host, record = self.events.get(timeout=0.2)
            except queue.Empty:
                host, record = "", {}
            if host and self.agents.get(host) is None:
                continue
            if "hello" in record:
                self.agents[host].send(op="spec", cwd="/", env={}, processes=[], watch=True,
                                       heartbeat=[self.heartbeat.interval_s, self.heartbeat.timeout_s])
            elif "ready" in record:
                self.agents[host].liveness = self.liveness
                self.liveness.watch(host)
                self.agents[host].send(op="start")
            elif "eof" in record and host in self.liveness.heard and host not in self.liveness.lost:
                self.liveness.forget(host)
                if not self._closed.is_set():
                    self._lost.put((host, f"lost: the connection to {host} ended; {self.agents[host].why_gone()}"))
            elif "error" in record:
                logger.warning("cannot watch %s: %s", host, record["error"])
            for lost, silence in self.liveness.newly_lost():
                self.agents[str(lost)].cut()
                self._lost.put((str(lost), lost_note(str(lost), silence, self.heartbeat)))

    def lost(self) -> list[tuple[str, str]]:
        """Hosts found lost since the last call, each with the note that names it and says why."""
        found = []
        while True:
            try:
                found.append(self._lost.get_nowait())
            except queue.Empty:
                return found

    def close(self) -> None:
        """Stop watching: every agent's session ends (closed, or killed after a few seconds)."""
        self._closed.set()
        self.beater.stop()
        # A watch agent runs nothing: it exits as soon as its stdin closes, or its ssh is killed after 1 s.
        threads = [threading.Thread(target=a.close, args=(1.0,), daemon=True) for a in self.agents.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10.0)
