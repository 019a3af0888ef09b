"""The per-host agent of the ssh launcher: starts a host's processes and watches the connection.

``hora run`` starts one agent per host, over ssh for other hosts and as a
plain child for this machine, and talks to it through the agent's stdin and
stdout.  The agent needs only a Python 3 interpreter on the host: the
launcher sends this file's source with ``python3 -c``, so hora does not have
to be importable for the agent itself (it must be for the workers, of course).

The protocol, one JSON object per line (agent lines start with
:data:`MARKER`):

1. agent -> launcher ``{"hello": {hostname, python, ssh, addrs, ports}}``:
   what the launcher needs to pick rendezvous addresses (the address ssh
   reached, each interface's IPv4 address, two free TCP ports).
2. launcher -> agent ``{"op": "spec", "cwd", "env", "processes": [{"key",
   "argv", "env"}], "grace"}``; the agent checks the working directory and
   every program and answers ``{"ready": true}`` or ``{"error": "..."}``.
3. launcher -> agent ``{"op": "start"}``: the agent starts every process in
   its own process group, relays each output line as ``[key]<stdout>:...``
   and reports ``{"exit": {"key", "returncode"}}`` when one ends.
4. launcher -> agent ``{"op": "signal", "signum", "keys"}``: signal those
   processes' groups.
5. When stdin ends (the launcher finished or died, or the ssh connection
   broke), the agent sends SIGTERM to every group it started, SIGKILL after
   the grace period, and exits: nothing is left running on the host.  Each
   process also gets SIGKILL from the kernel if the agent itself is killed.
6. Heartbeats: when the spec carries ``"heartbeat": [interval, timeout]``,
   the agent sends ``{"beat": n}`` every ``interval`` seconds and the
   launcher sends ``{"op": "beat"}``; an agent that has heard nothing from
   the launcher for ``timeout`` seconds (a silent partition: no FIN, no
   RST) stops its processes as in 5.  With ``"watch": true`` the spec
   starts nothing: the agent only beats until the launcher goes (the mpi
   launcher's liveness check of hosts that mpirun reaches by itself).

When every process has ended the agent says ``{"done": true}`` and exits 0.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import queue
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

MARKER = b"__hora_agent__ "
_PR_SET_PDEATHSIG = 1
_SIOCGIFADDR = 0x8915
# The names of hora.envvars that the agent reads or sets; copied, because this file runs without hora
# (tests/unit/test_env_contract.py checks that they match).
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
HORA_NETWORK_INTERFACE = "HORA_NETWORK_INTERFACE"
HORA_RENDEZVOUS_ADDR = "HORA_RENDEZVOUS_ADDR"


def _ipv4_addresses() -> dict:
    """Each network interface's IPv4 address (Linux ioctl; empty elsewhere)."""
    found = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found[name] = socket.inet_ntoa(packed[20:24])
            except OSError:
                continue
    return found


def route_interface(address: str) -> str | None:
    """The interface this host would use to reach ``address`` (None if it cannot tell).

    gloo needs to be told which interface to use when the ranks are on
    several hosts; this is the one that carries the route to rank 0.
    """
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # UDP: picks a route, sends nothing
            source = s.getsockname()[0]
    except OSError:
        return None
    for name, ip in _ipv4_addresses().items():
        if ip == source and not ip.startswith("127."):
            return name
    return None


def default_gloo_interface(env: dict) -> None:
    """Set ``GLOO_SOCKET_IFNAME`` towards rank 0 when the job spans hosts and nobody chose one."""
    if env.get(GLOO_SOCKET_IFNAME) or env.get(HORA_NETWORK_INTERFACE):
        return
    address = env.get(HORA_RENDEZVOUS_ADDR, "")
    if not address or address in ("localhost", "::1") or address.startswith("127."):
        return
    interface = route_interface(address)
    if interface:
        env[GLOO_SOCKET_IFNAME] = interface


def _free_ports(count: int) -> list:
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def _pdeathsig():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None

    def arm() -> None:  # runs in the child between fork and exec
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return arm if sys.platform.startswith("linux") else None


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class Agent:
    """One host's side of a job (see the module docstring)."""

    def __init__(self) -> None:
        self.out = sys.stdout.buffer
        self.lock = threading.Lock()
        self.inbox: queue.Queue = queue.Queue()
        self.procs: dict = {}  # key -> Popen
        self.relays: dict = {}  # key -> [threads]
        self.reported: set = set()
        self.grace = 3.0
        self.stop_at = None  # when the grace period after our own SIGTERM ends
        self.killed = False
        self.signalled = False
        self.heard = time.monotonic()  # when the launcher last said anything
        self.beat_every: float | None = None
        self.silence_limit: float | None = None
        self.watch = False
        self.gone = False  # the launcher is gone (stdin ended, or silent past the limit)

    # -- talking to the launcher --

    def send(self, **record) -> None:
        """Send one record to the launcher."""
        self.write(MARKER + json.dumps(record).encode() + b"\n")

    def write(self, data: bytes) -> None:
        """Write one line to the launcher; a broken pipe counts as losing the launcher."""
        with self.lock:
            try:
                self.out.write(data)
                self.out.flush()
            except (OSError, ValueError):
                self.inbox.put(None)  # nobody listens any more: same as losing stdin

    def read_stdin(self) -> None:
        """Queue the launcher's messages; None when stdin ends."""
        try:
            for line in sys.stdin.buffer:
                self.heard = time.monotonic()
                line = line.strip()
                if line:
                    try:
                        self.inbox.put(json.loads(line))
                    except ValueError:
                        continue
        except (OSError, ValueError):
            pass
        self.inbox.put(None)

    def next_message(self, timeout: float | None):
        """The next message, ``{}`` after ``timeout`` seconds without one, None once the launcher is gone.

        Beats are not messages: they only prove the launcher is there.  A
        launcher silent for longer than the heartbeat limit counts as gone.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.silence_limit is not None and time.monotonic() - self.heard > self.silence_limit:
                return None
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            try:
                message = self.inbox.get(timeout=wait)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return {}
                continue
            if message is None or message.get("op") != "beat":
                return message

    def beat(self) -> None:
        """Send a beat every interval until the launcher is gone (runs on its own thread)."""
        count = 0
        while not self.gone and self.beat_every:
            count += 1
            self.send(beat=count)
            time.sleep(self.beat_every)

    # -- the job --

    def hello(self) -> None:
        """Tell the launcher about this host."""
        self.send(hello={
            "hostname": socket.gethostname(),
            "python": sys.executable,
            "ssh": os.environ.get("SSH_CONNECTION", ""),
            "addrs": _ipv4_addresses(),
            "ports": _free_ports(2),
            "pid": os.getpid(),
        })

    def prepare(self, spec: dict) -> list:
        """Check the spec; return the processes to start as (key, argv, env, cwd)."""
        self.grace = float(spec.get("grace", 3.0))
        heartbeat = spec.get("heartbeat")
        if heartbeat:
            self.beat_every, self.silence_limit = float(heartbeat[0]), float(heartbeat[1])
            self.heard = time.monotonic()
            threading.Thread(target=self.beat, daemon=True).start()
        self.watch = bool(spec.get("watch"))
        cwd = spec.get("cwd") or os.getcwd()
        if not os.path.isdir(cwd):
            raise RuntimeError(
                f"the working directory {cwd} does not exist; create it there, or copy it with --sync-dst-dir DIR"
            )
        base = dict(os.environ)
        common = dict(spec.get("env", {}))
        if "PATH" in common:  # the launcher's PATH first, then this host's own entries
            own = [p for p in base.get("PATH", "").split(os.pathsep) if p]
            given = common["PATH"].split(os.pathsep)
            common["PATH"] = os.pathsep.join(given + [p for p in own if p not in given])
        base.update(common)
        default_gloo_interface(base)
        planned = []
        for item in spec["processes"]:
            env = dict(base)
            env.update(item.get("env", {}))
            argv = list(item["argv"])
            program = argv[0]
            if os.sep in program:
                path = program if os.path.isabs(program) else os.path.join(cwd, program)
                if not os.path.isfile(path) or not os.access(path, os.X_OK):
                    raise RuntimeError(f"cannot run {program!r}: no such executable file")
            elif shutil.which(program, path=env.get("PATH", os.defpath)) is None:
                raise RuntimeError(f"cannot run {program!r}: command not found on PATH")
            planned.append((str(item["key"]), argv, env, cwd))
        return planned

    def start(self, planned: list) -> None:
        """Start every planned process in its own process group, with its output relayed."""
        arm = _pdeathsig()
        for key, argv, env, cwd in planned:
            try:
                proc = subprocess.Popen(
                    argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, close_fds=True, start_new_session=True, preexec_fn=arm,
                )
            except OSError as e:
                self.write(f"[{key}]<stderr>:hora: cannot start {argv[0]!r}: {e.strerror or e}\n".encode())
                self.send(exit={"key": key, "returncode": 127})
                self.reported.add(key)
                continue
            self.procs[key] = proc
            self.relays[key] = [
                self.relay(key, "stdout", proc.stdout),
                self.relay(key, "stderr", proc.stderr),
            ]

    def relay(self, key: str, stream: str, pipe) -> threading.Thread:
        """Copy ``pipe`` to the launcher line by line, each prefixed with the process's key."""
        prefix = f"[{key}]<{stream}>:".encode()

        def run() -> None:
            try:
                for line in iter(pipe.readline, b""):
                    if not line.endswith(b"\n"):
                        line += b"\n"
                    self.write(prefix + line)
            except (OSError, ValueError):
                pass
            finally:
                pipe.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def running(self) -> list:
        """Keys of the processes whose exit has not been reported."""
        return [key for key, proc in self.procs.items() if key not in self.reported]

    def signal(self, keys, signum: int) -> None:
        """Send ``signum`` to the process groups of ``keys``."""
        self.signalled = True
        for key in keys:
            proc = self.procs.get(key)
            if proc is not None and key not in self.reported:
                _signal_group(proc.pid, signum)

    def shut_down(self) -> None:
        """The launcher is gone: stop everything, SIGKILL after the grace period."""
        if self.stop_at is None:
            self.signal(self.running(), signal.SIGTERM)
            self.stop_at = time.monotonic() + self.grace

    def supervise(self) -> None:
        """Report exits and obey the launcher until every process has ended."""
        while self.running() or (self.watch and not self.gone):
            message = self.next_message(0.05)
            if message is None:
                self.gone = True
                self.shut_down()
            elif message.get("op") == "signal":
                keys = message.get("keys") or self.running()
                self.signal([str(k) for k in keys], int(message["signum"]))
            for key in self.running():
                returncode = self.procs[key].poll()
                if returncode is not None:
                    for thread in self.relays[key]:
                        thread.join(2.0)  # the last lines go out before the exit record
                    self.reported.add(key)
                    self.send(exit={"key": key, "returncode": returncode})
            if self.stop_at is not None and not self.killed and time.monotonic() >= self.stop_at:
                self.killed = True
                self.signal(self.running(), signal.SIGKILL)
        if self.signalled:  # leftovers in the groups of processes we stopped
            for proc in self.procs.values():
                _signal_group(proc.pid, signal.SIGKILL)

    def main(self) -> int:
        """Run the protocol; the exit status of the agent."""
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(signum, lambda *_: self.inbox.put(None))
        threading.Thread(target=self.read_stdin, daemon=True).start()
        self.hello()
        message = self.next_message(None)
        if not message or message.get("op") != "spec":
            return 0
        try:
            planned = self.prepare(message)
        except (RuntimeError, KeyError, TypeError, ValueError) as e:
            self.send(error=str(e))
            return 1
        self.send(ready=True)
        message = self.next_message(None)
        if not message or message.get("op") != "start":
            return 0
        self.start(planned)
        self.supervise()
        self.gone = True  # ends the beats
        self.send(done=True)
        return 0


if __name__ == "__main__":
    code = Agent().main()
    # Skip interpreter shutdown: the stdin reader thread may still block in read().
    sys.stdout.flush()
    os._exit(code)
