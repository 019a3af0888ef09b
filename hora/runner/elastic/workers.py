"""Starting and stopping the elastic driver's worker processes: local children, or over ssh on other hosts.

Each worker is one process, started in its own process group (local), or
through ``ssh host`` running a small shell wrapper (other hosts) that starts
the command in its own group and kills that group when ssh's stdin closes,
so stopping the ssh client, or losing the connection, stops the worker too.
Output lines go to the job's :class:`~hora.runner.output.OutputSink`
under the worker's sequence number (``[3]`` is the fourth worker started,
whatever its rank now); exits arrive on a queue.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shlex
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence

from hora.errors import LaunchError
from hora.runner.env import forwarded_names
from hora.runner.hostlist import is_local_host
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import new_group_kwargs, signal_group
from hora.runner.output import STREAMS, OutputSink, pump
from hora.runner.ssh import SshOptions

log = logging.getLogger(__name__)

# Runs on the remote host: the command, killed when ssh's stdin closes (the launcher stopped it, or the
# connection dropped).  fd 3 keeps stdin for the watcher: a background list of a non-interactive shell
# would otherwise read /dev/null.
_REMOTE_WRAPPER = (
    'exec 3<&0; "$@" </dev/null & child=$!; '
    "trap 'kill -TERM $child 2>/dev/null' TERM HUP INT; "
    "(while read -r _ <&3; do :; done; kill -TERM $child 2>/dev/null; sleep 3; kill -KILL $child 2>/dev/null) & "
    "watcher=$!; wait $child; code=$?; kill $watcher 2>/dev/null; exit $code"
)


@dataclasses.dataclass(slots=True)
class WorkerProcess:
    """One started worker."""

    seq: int
    host: str
    proc: subprocess.Popen
    pumps: list[threading.Thread]
    remote: bool

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker (its whole group locally; the ssh client, which ends it, remotely)."""
        if self.remote:
            if signum == signal.SIGKILL:
                signal_group(self.proc.pid, signal.SIGKILL)
            else:
                try:
                    self.proc.stdin.close()  # type: ignore[union-attr]
                except OSError:
                    pass
                signal_group(self.proc.pid, signum)
        else:
            signal_group(self.proc.pid, signum)


class Spawner:
    """Starts workers for the driver and reports their exits on :attr:`exits` as ``(seq, returncode)``."""

    def __init__(self, config: LaunchConfig, env: Mapping[str, str], sink: OutputSink) -> None:
        self.config = config
        self.env = dict(env)
        self.sink = sink
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self.processes: dict[int, WorkerProcess] = {}
        self._ssh = SshOptions.from_config(config)

    def start(self, seq: int, host: str, extra_env: Mapping[str, str]) -> WorkerProcess:
        """Start worker ``seq`` on ``host`` with the job's environment plus ``extra_env``.

        Raises:
            LaunchError: the command (or ssh) cannot be started.
        """
        remote = not is_local_host(host)
        env = {**self.env, **extra_env}
        if remote:
            names = sorted(set(forwarded_names(env, self.config)) | set(extra_env))
            assignments = [f"{n}={shlex.quote(env[n])}" for n in names if n in env]
            cwd = self.config.sync_dst_dir or os.getcwd()
            inner = (f"cd {shlex.quote(cwd)} && exec env {' '.join(assignments)} sh -c "
                     f"{shlex.quote(_REMOTE_WRAPPER)} hora-worker {' '.join(map(shlex.quote, self.config.command))}")
            command = ["ssh", *self._ssh.options(host), host, inner]
            stdin = subprocess.PIPE
            run_env = dict(os.environ)
        else:
            command = list(self.config.command)
            stdin = subprocess.DEVNULL
            run_env = env
        try:
            proc = subprocess.Popen(command, env=run_env, stdin=stdin, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, close_fds=True, **new_group_kwargs())
        except OSError as e:
            raise LaunchError(f"cannot start {command[0]!r} for worker {seq} on {host}: {e.strerror or e}") from e
        pumps = [pump(getattr(proc, stream), lambda line, s=stream: self.sink.emit(seq, s, line))
                 for stream in STREAMS]
        worker = WorkerProcess(seq, host, proc, pumps, remote)
        self.processes[seq] = worker

        def wait() -> None:
            code = proc.wait()
            for thread in pumps:
                thread.join(2.0)
            self.exits.put((seq, code))

        threading.Thread(target=wait, name=f"hora-elastic-wait-{seq}", daemon=True).start()
        log.info("started worker %d on %s (pid %d)", seq, host, proc.pid)
        return worker

    def signal(self, seqs: Sequence[int], signum: int) -> None:
        """Signal the workers ``seqs`` that are still running."""
        for seq in seqs:
            worker = self.processes.get(seq)
            if worker is not None and worker.proc.poll() is None:
                worker.signal(signum)
