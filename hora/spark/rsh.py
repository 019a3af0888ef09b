"""The rsh agent of hora.spark's MPI mode: mpirun reaches other hosts through their Spark tasks, not ssh.

Rank 0's task runs mpirun with ``plm_ssh_agent`` set to ``python -m
hora.spark.rsh_agent AGENTS_FILE`` (:func:`main`).  Where Open MPI would run ``ssh HOST
COMMAND...`` to start its daemon on a host, it runs this agent instead:
the agent reads the port of the task serving ``HOST`` and the job's token
from ``AGENTS_FILE`` (written by rank 0's task, readable by its user
only), connects, proves the token, and asks that task to run ``COMMAND``
with ``/bin/sh -c`` as its own child.  The task streams the child's output
back and, at the end, its exit code, which the agent relays and exits with,
as ssh would.  One task per host serves (:class:`AgentServer`, the task of
the host's local rank 0); the daemon it starts forks that host's ranks.

The protocol is :mod:`hora.spark.channel`'s framing (a 4-byte length, a
msgpack list): ``["start", token, command]`` from the agent, then
``["data", stream, bytes]`` lines and one ``["exit", code]`` from the task.
A connection whose first message does not carry the token is closed unread;
when the agent's connection drops, the task kills what it started.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from hora.runner.launchers.base import parent_death_signal, signal_group
from hora.runner.output import pump
from hora.spark.channel import Listener, recv_message, send_message

log = logging.getLogger(__name__)

START, DATA, EXIT = "start", "data", "exit"
#: Seconds the agent may take to reach a host's task before it reports the host unreachable.
CONNECT_TIMEOUT_S = 20.0
#: What the agent exits with when it cannot reach the task or the task went away (ssh's code for it).
UNREACHABLE = 255
#: Seconds a started command gets between SIGTERM and SIGKILL when its agent went away or the task stops.
KILL_GRACE_S = 2.0


def write_agents_file(path: str, token: str, ports: Mapping[str, tuple[str, int]]) -> None:
    """Write the agent's file: the job's token and, per host name in mpirun's ``-H``, the serving task's
    ``(address, port)``; readable by this user only, since the token lets one start processes in the tasks."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"token": token, "hosts": {h: list(a) for h, a in ports.items()}}, f)


def agent_command(agents_file: str) -> str:
    """The ``plm_ssh_agent`` value: this interpreter running the agent with the job's file."""
    return f"{sys.executable} -m hora.spark.rsh_agent {agents_file}"


def parse_agent_args(argv: Sequence[str]) -> tuple[str, str, str]:
    """``(agents_file, host, command)`` from the agent's arguments.

    Open MPI calls ``AGENT HOST WORD...``; a launcher that adds ssh-style
    flags without values (``-x``) before the host has them skipped.  The
    words are joined with spaces, as ssh joins them for the remote shell.

    Raises:
        ValueError: no host or no command.
    """
    args = list(argv)
    if not args:
        raise ValueError("usage: python -m hora.spark.rsh_agent AGENTS_FILE HOST COMMAND...")
    agents_file, rest = args[0], args[1:]
    while rest and rest[0].startswith("-"):
        rest = rest[1:]
    if len(rest) < 2:
        raise ValueError("usage: python -m hora.spark.rsh_agent AGENTS_FILE HOST COMMAND...")
    return agents_file, rest[0], " ".join(rest[1:])


def run_remote(address: str, port: int, token: str, command: str, host: str = "",
               timeout: float = CONNECT_TIMEOUT_S) -> int:
    """Ask the task at ``address:port`` to run ``command``; relay its output here; return its exit code.

    Returns :data:`UNREACHABLE` (with a message on stderr naming the host)
    when the task cannot be reached or goes away before the command ends.
    """
    name = host or address
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError as e:
        sys.stderr.write(f"hora.spark: cannot reach the Spark task serving host {name} at {address}:{port} to "
                         f"start Open MPI's daemon there: {e}\n")
        sys.stderr.flush()
        return UNREACHABLE
    sock.settimeout(None)
    outputs = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    try:
        send_message(sock, [START, token, command])
        while True:
            message = recv_message(sock)
            if message is None:
                break
            if message[0] == DATA:
                target = outputs.get(message[1], outputs["stderr"])
                target.write(message[2])
                target.flush()
            elif message[0] == EXIT:
                code = int(message[1])
                return code if code >= 0 else 128 - code
    except OSError as e:
        sys.stderr.write(f"hora.spark: the connection to the Spark task serving host {name} broke: {e}\n")
        return UNREACHABLE
    finally:
        sock.close()
    sys.stderr.write(f"hora.spark: the Spark task serving host {name} ended the connection before the command "
                     "did (a wrong token, or the task was stopped)\n")
    return UNREACHABLE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m hora.spark.rsh_agent AGENTS_FILE HOST COMMAND...`` (run by mpirun, not by users)."""
    try:
        agents_file, host, command = parse_agent_args(sys.argv[1:] if argv is None else argv)
        with open(agents_file, encoding="utf-8") as f:
            agents = json.load(f)
    except (ValueError, OSError) as e:
        sys.stderr.write(f"hora.spark rsh agent: {e}\n")
        return UNREACHABLE
    target = agents["hosts"].get(host)
    if target is None:
        sys.stderr.write(f"hora.spark rsh agent: host {host!r} has no Spark task of this job (hosts: "
                         f"{', '.join(sorted(agents['hosts']))})\n")
        return UNREACHABLE
    return run_remote(str(target[0]), int(target[1]), str(agents["token"]), command, host)


#: ``preexec_fn`` for a task's children (its rank, mpirun, an Open MPI daemon): SIGKILL when the thread that
#: started them ends, since Spark kills a task's Python worker on cancel and they must not outlive it.
#: None off Linux: the child then outlives a killed worker, but still ends when its peers fail.
die_with_parent = parent_death_signal(signal.SIGKILL)


def _kill_group(process: subprocess.Popen, grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the command's process group, SIGKILL it after ``grace`` seconds; wait for the command."""
    for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        signal_group(process.pid, signum)
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class AgentServer(Listener):
    """A task's end: runs the commands that authenticated agents send, as this task's children.

    Args:
        address: where to listen (the task's address, reachable from rank 0's task).
        token: the job's token the agents must present.
        env: the environment of the commands (the task's, less the rank variables).
    """

    def __init__(self, address: str, token: str, env: Mapping[str, str] | None = None) -> None:
        self._token = token.encode()
        self._env = dict(os.environ if env is None else env)
        self._processes: list[subprocess.Popen] = []
        #: The exit codes of the commands that ran, in the order they ended (for the task's log and tests).
        self.exits: list[int] = []
        super().__init__(address, 16, "hora-spark-agent")

    def serve(self, conn: socket.socket) -> None:
        """Authenticate one agent's request and run its command to the end."""
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            start = recv_message(conn)
            conn.settimeout(None)
        except (OSError, ValueError) as e:
            log.debug("hora.spark agent: a connection ended before its request: %s", e)
            conn.close()
            return
        if (not start or start[0] != START or len(start) < 3 or not isinstance(start[1], str)
                or not hmac.compare_digest(start[1].encode(), self._token)):
            log.warning("hora.spark: a request to start a process without the job's token was refused")
            conn.close()
            return
        self._run(conn, str(start[2]))

    def _run(self, conn: socket.socket, command: str) -> None:
        send_lock = threading.Lock()

        def send(message: list) -> None:
            with send_lock:
                try:
                    send_message(conn, message)
                except OSError:
                    pass  # the agent went away: the watcher below stops the command

        with self._lock:
            if self._closed:
                conn.close()
                return
            try:
                process = subprocess.Popen(["/bin/sh", "-c", command], env=self._env, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           start_new_session=True, preexec_fn=die_with_parent)
            except OSError as e:
                send([DATA, "stderr", f"hora.spark: cannot start /bin/sh on this task's host: {e}\n".encode()])
                send([EXIT, 127])
                conn.close()
                return
            self._processes.append(process)
        pumps = [pump(process.stdout, lambda line: send([DATA, "stdout", line])),  # type: ignore[arg-type]
                 pump(process.stderr, lambda line: send([DATA, "stderr", line]))]  # type: ignore[arg-type]

        def watch() -> None:
            # The agent's connection carries nothing more; its end means mpirun dropped the agent.
            try:
                while recv_message(conn) is not None:
                    pass
            except (OSError, ValueError):
                pass
            if process.poll() is None:
                _kill_group(process)

        threading.Thread(target=watch, name="hora-spark-agent-watch", daemon=True).start()
        returncode = process.wait()
        for thread in pumps:
            thread.join(timeout=5)
        with self._lock:
            self.exits.append(returncode)
        send([EXIT, returncode])
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()

    def close(self) -> None:
        """Stop listening and stop every command still running (SIGTERM, then SIGKILL); safe twice."""
        self.stop_listening()
        with self._lock:
            processes = list(self._processes)
        for process in processes:
            if process.poll() is None:
                _kill_group(process)

