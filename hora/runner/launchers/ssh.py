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
from collections.abc import Mapping, Sequence
from typing import Any

from hora import envvars
from hora.errors import LaunchError
from hora.runner.agent import MARKER
from hora.runner.env import Endpoints, forwarded_names, free_port, interface_address
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


class _Agent:
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
        self.agents: dict[str, _Agent] = {}
        self.cwd = os.getcwd()
        self.ssh = SshOptions()
        self.host_addrs: dict[str, str] = {}

    # -- before the environment exists --

    def prepare(self, config: LaunchConfig, slots: Sequence[Slot]) -> Endpoints:
        """Copy files (``--sync-dst-dir``), reach every host, and choose the rendezvous address.

        Raises:
            LaunchError: a copy failed, or a host could not be reached (the
                message names each such host and what ssh said).
        """
        self.ssh = SshOptions.from_config(config)
        hosts = list(dict.fromkeys(s.host for s in slots))
        local = {h: is_local_host(h) for h in hosts}
        if config.sync_dst_dir is not None:
            logger.info("copying %s to %s on %s", self.cwd, config.sync_dst_dir, ", ".join(hosts))
            sync_directory(self.cwd, [(h, local[h]) for h in hosts], config.sync_dst_dir, self.ssh)
            self.cwd = config.sync_dst_dir
        path = config.env.get("PATH", os.environ.get("PATH"))
        for host in hosts:
            command = local_agent_command() if local[host] else self.ssh.command(host, agent_command(path))
            self.agents[host] = _Agent(host, local[host], command, self.events)
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
            agent.send(op="spec", cwd=self.cwd, env=common, processes=processes, grace=config.grace_period)
        self._wait_until_ready()
        for agent in self.agents.values():
            agent.sink = sink
        for agent in self.agents.values():
            agent.send(op="start")
        return _SshSupervisor(self.agents, self.events, slots, sink, interrupt, config).run()

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
        agents: Mapping[str, _Agent],
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

    def finish(self) -> None:
        for agent in self.agents.values():
            agent.close(wait=5.0)

