"""The sge launcher: Sun / Son of Grid Engine parallel-environment jobs, with tight integration.

Inside a parallel job (``qsub -pe PE N ... hora run python train.py``,
where the grid engine sets ``PE_HOSTFILE`` and ``JOB_ID``), the hosts and
their slots come from ``$PE_HOSTFILE``.  Each host of the job gets one hora
agent (:mod:`hora.runner.agent`, as under the ssh launcher) started with
``qrsh -inherit HOST``, all hosts in parallel: the grid engine accounts for
everything the agents start, and ``qdel`` ends them.  The agents receive
the job's environment explicitly, over their control channel (never
through ``qsub -v``, which splits values on commas); each agent starts its
host's ranks, servers and scheduler and relays their output, and the first
process that fails stops the job with the root-cause report, as with ssh.

The agent is detached from the task's process group: the grid engine's
``qdel`` kills process groups only, so the agent, told by the kernel that
its parent (the grid engine's task) died, stops every group it started
before it exits.

From outside a job, ``hora run --launcher sge -np N [--sge-pe PE]
[--sge-queue Q] cmd`` submits one parallel job with ``qsub -sync y`` that
runs the same ``hora run`` inside, prints its job id, streams its
rank-prefixed output and exits with the job's status (see :func:`submit`).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TextIO

from hora import envvars
from hora.config import interface_names
from hora.errors import ConfigError, LaunchError
from hora.placement import HostSlots
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import Endpoints, Interrupt, JobResult, Slot, exit_status
from hora.runner.launchers.registry import (
    MPI_ARGS_NEED_MPIRUN,
    MPI_NEEDS_MPIRUN,
    SYNC_NEEDS_SSH,
    Capabilities,
    ConfigView,
    Request,
)
from hora.runner.launchers.ssh import AgentLink, SshLauncher
from hora.runner.output import OutputSink, write_bytes
from hora.runner.ssh import AGENT_SOURCE, agent_command

logger = logging.getLogger(__name__)

#: The variables of a grid-engine task that differ from host to host: each host keeps its own.
HOST_SPECIFIC = (
    "TMPDIR", "TMP", "HOSTNAME", "HOST", "PWD", "OLDPWD", "SHLVL", "_", "SGE_JOB_SPOOL_DIR", "SGE_STDIN_PATH",
    "SGE_STDOUT_PATH", "SGE_STDERR_PATH", "SGE_CWD_PATH", "ENVIRONMENT", "REQUEST", "RESTARTED", "QUEUE",
)
#: Seconds each ``qrsh -inherit`` may take to start its agent (about half a second on an idle cluster).
QRSH_TIMEOUT_SECONDS = 60.0

# Run before the agent's own code on each host (the agent's source follows it in one ``python3 -c``): the
# agent moves to a session of its own, so that qdel, which kills the task's process group, kills only
# this parent; the kernel then sends the agent SIGTERM (PR_SET_PDEATHSIG), and the agent stops every
# process group it started, as when its launcher goes away.  The parent waits and passes the status on.
_DETACH = """
import ctypes as _c, os as _o, signal as _s
_p = _o.getpid()
_k = _o.fork()
if _k:
    _s.signal(_s.SIGTERM, _s.SIG_IGN); _s.signal(_s.SIGINT, _s.SIG_IGN); _s.signal(_s.SIGHUP, _s.SIG_IGN)
    _o._exit(_o.waitstatus_to_exitcode(_o.waitpid(_k, 0)[1]) & 255)
_o.setsid()
_c.CDLL(None).prctl(1, _s.SIGTERM, 0, 0, 0)
if _o.getppid() != _p:
    _o.kill(_o.getpid(), _s.SIGTERM)
"""


#: The parallel environment ``hora run --launcher sge`` submits to when ``--sge-pe`` is not given.
DEFAULT_PE = "hora"
_FUTURE = "from __future__ import annotations\n"
#: The agent's source with :data:`_DETACH` run first (after its ``__future__`` import, which must lead).
_DETACHED_AGENT = AGENT_SOURCE.replace(_FUTURE, _FUTURE + _DETACH, 1) if _FUTURE in AGENT_SOURCE else (
    _DETACH + AGENT_SOURCE)


def inside_job(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a grid-engine parallel job (``PE_HOSTFILE`` and ``JOB_ID`` set)."""
    environ = os.environ if environ is None else environ
    return bool(environ.get(envvars.PE_HOSTFILE) and environ.get(envvars.JOB_ID))


def find_tool(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The grid engine's ``name`` (qsub, qrsh, qconf) on PATH.

    Raises:
        LaunchError: it is not there; the message says how to get it.
    """
    environ = os.environ if environ is None else environ
    found = shutil.which(name, path=environ.get("PATH"))
    if found is None:
        raise LaunchError(
            f"--launcher sge needs the grid engine's {name} on PATH, and it is not there: load the grid "
            "engine's settings (. $SGE_ROOT/$SGE_CELL/common/settings.sh) or install its client "
            "(Debian: apt-get install gridengine-client)"
        )
    return found


def parse_pe_hostfile(text: str, where: str = "$PE_HOSTFILE") -> list[HostSlots]:
    """The hosts of a ``$PE_HOSTFILE`` with their granted slots, in the file's order.

    Each line is ``host slots queue processors``; a host listed more than
    once (slots from several queues) gets the sum of its slots.

    Raises:
        LaunchError: a line is malformed, or the file lists no slots.
    """
    slots: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 2 or not fields[1].isdigit():
            raise LaunchError(f"{where}:{number}: cannot read {line!r} (expected 'host slots queue processors')")
        slots[fields[0]] = slots.get(fields[0], 0) + int(fields[1])
    hosts = [HostSlots(host, count) for host, count in slots.items() if count > 0]
    if not hosts:
        raise LaunchError(f"{where} grants no slots")
    return hosts


def job_hosts(environ: Mapping[str, str] | None = None) -> list[HostSlots]:
    """The hosts and slots the grid engine granted this job (``$PE_HOSTFILE``).

    Raises:
        LaunchError: not inside a parallel job, or the file cannot be read.
    """
    environ = os.environ if environ is None else environ
    path = environ.get(envvars.PE_HOSTFILE)
    if not path or not environ.get(envvars.JOB_ID):
        raise LaunchError(
            "--launcher sge found no parallel job here (PE_HOSTFILE and JOB_ID are not set): run hora run inside "
            f"'qsub -pe PE N', or let it submit one (hora run --launcher sge --sge-pe {DEFAULT_PE} -np N ...)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            return parse_pe_hostfile(f.read(), path)
    except OSError as e:
        raise LaunchError(f"cannot read the job's PE_HOSTFILE {path!r}: {e.strerror}") from e


def check_slots(config: LaunchConfig, hosts: Sequence[HostSlots], pe: str | None = None) -> None:
    """Refuse a job that needs more slots than the grid engine granted (each server is a task of its own).

    Raises:
        LaunchError: fewer granted slots than workers plus servers; the
            message names the ``qsub -pe`` request that fits.
    """
    granted = sum(h.slots for h in hosts)
    needed = config.num_proc + config.num_servers
    if granted < needed:
        servers = f" and {config.num_servers} servers" if config.num_servers else ""
        raise LaunchError(
            f"the grid engine granted this job {granted} slots, but -np {config.num_proc}{servers} need "
            f"{needed}: submit with 'qsub -pe {pe or DEFAULT_PE} {needed}' (or lower -np)"
        )


def free_slots(hosts: Sequence[HostSlots], workers: Sequence[Slot], count: int) -> list[str]:
    """The hosts of the first ``count`` granted slots that no worker takes, in ``$PE_HOSTFILE`` order."""
    used = collections.Counter(s.host for s in workers)
    free = [h.host for h in hosts for _ in range(h.slots - used[h.host])]
    return free[:count]


def qrsh_command(qrsh: str, host: str, path: str | None) -> list[str]:
    """``qrsh -inherit HOST CMD``: the agent, detached from the task's process group, on ``host``.

    qrsh hands ``CMD`` to a shell on the host, so it is one shell-quoted
    string (the agent's source included); nothing of the job's environment
    travels on this command line.
    """
    return [qrsh, "-inherit", host, agent_command(path, source=_DETACHED_AGENT)]


class SgeLauncher(SshLauncher):
    """Starts each host's processes through an agent reached with ``qrsh -inherit`` (see the module docstring)."""

    name = "sge"
    summary = "qrsh -inherit inside a grid-engine parallel job, or one submitted with qsub -sync y"
    detects = "inside a grid-engine parallel job"
    priority = 20  # a batch system's job: its $PE_HOSTFILE says where the ranks go
    capabilities = Capabilities(servers=True, host_list=False)
    refusals = {
        "elastic": ("elastic training (--min-np/--max-np/--host-discovery-script) needs {able}: a grid-engine "
                    "job's hosts are fixed when it starts"),
        "controller": MPI_NEEDS_MPIRUN,
        "host_list": "--launcher sge takes its hosts from the grid engine's $PE_HOSTFILE; drop -H/--hostfile",
        "sync_dst_dir": SYNC_NEEDS_SSH,
        "mpi_args": MPI_ARGS_NEED_MPIRUN,
    }
    #: The agents get the whole job environment: a qrsh task starts with the execd's bare one.
    forward_all = True

    @classmethod
    def detect(cls, request: Request) -> bool:
        """Inside a parallel job (``PE_HOSTFILE`` and ``JOB_ID`` set, qrsh on PATH) when no host list was given."""
        env = request.environ
        return (request.hosts is None and inside_job(env)
                and shutil.which("qrsh", path=env.get("PATH")) is not None)

    @classmethod
    def check(cls, config: ConfigView) -> None:
        """As every launcher; ``--server-hosts`` too is refused: the servers take granted slots."""
        super().check(config)
        if config.server_host_list:
            raise ConfigError("--launcher sge places the servers in the job's granted slots ($PE_HOSTFILE); "
                              "drop --server-hosts")

    @classmethod
    def hosts(cls, config: LaunchConfig) -> list[HostSlots]:
        """The granted hosts (:func:`job_hosts`), which must hold the workers and a slot for each server.

        Outside a job (``hora run`` submits one, see :func:`submit`) there
        is nothing to place yet.

        Raises:
            LaunchError: not inside a parallel job, or too few slots (:func:`check_slots`).
        """
        hosts = job_hosts()
        check_slots(config, hosts, os.environ.get(envvars.PE))
        return hosts

    @classmethod
    def server_hosts(cls, hosts: Sequence[HostSlots], workers: Sequence[Slot], count: int) -> list[str]:
        """The servers take the granted slots the workers left (:func:`free_slots`)."""
        return free_slots(hosts, workers, count)

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.environ = dict(os.environ if environ is None else environ)

    def submits(self, config: LaunchConfig) -> bool:
        """Outside a parallel job, ``hora run`` submits one (:func:`submit`)."""
        return not inside_job(self.environ)

    def submit(self, config: LaunchConfig, stdout: TextIO, stderr: TextIO, interrupt: Interrupt) -> JobResult:
        """Submit the job with ``qsub -sync y`` (see :func:`submit`)."""
        return submit(config, stdout, stderr, interrupt)

    def prepare(self, config: LaunchConfig, slots: Sequence[Slot]) -> Endpoints:
        """Start an agent on every host of the job with ``qrsh -inherit`` and choose the rendezvous address.

        Raises:
            LaunchError: not inside a parallel job, or a host refused ``qrsh
                -inherit`` (the message names the likely fix).
        """
        qrsh = find_tool("qrsh", self.environ)
        job_hosts(self.environ)
        hosts = list(dict.fromkeys(s.host for s in slots))
        path = config.env.get("PATH", self.environ.get("PATH"))
        for host in hosts:
            self.agents[host] = AgentLink(host, False, qrsh_command(qrsh, host, path), self.events, via="qrsh -inherit")
        try:
            self._wait_for_hellos(QRSH_TIMEOUT_SECONDS)
        except LaunchError as e:
            raise LaunchError(f"{e}; {self._qrsh_hint()}") from None
        return self._sge_endpoints(config, slots)

    def _qrsh_hint(self) -> str:
        pe = self.environ.get(envvars.PE, "")
        control = pe_control_slaves(pe, self.environ) if pe else None
        if control is False:
            return (f"the parallel environment {pe!r} has control_slaves FALSE, so qrsh -inherit may not start "
                    f"tasks: set control_slaves TRUE (qconf -mp {pe}) or submit to a PE that has it")
        return ("qrsh -inherit starts tasks only inside a parallel job whose PE has control_slaves TRUE "
                f"(check: qconf -sp {pe or 'PE'}), and only on the hosts of $PE_HOSTFILE")

    def _sge_endpoints(self, config: LaunchConfig, slots: Sequence[Slot]) -> Endpoints:
        # Under qrsh there is no SSH_CONNECTION to tell how the hosts see each other: each host's address
        # is its name's address when that is one of its interfaces, else its first non-loopback address.
        iface = interface_names(config.network_interface)[0] if config.network_interface else None
        addrs: dict[str, str] = {}
        for host, agent in self.agents.items():
            own = (agent.hello or {}).get("addrs", {})
            if iface:
                if iface not in own:
                    have = ", ".join(sorted(own)) or "none with IPv4"
                    raise LaunchError(f"--network-interface {iface!r} does not exist on {host} (it has: {have})")
                addrs[host] = own[iface]
            else:
                addrs[host] = host_address(host, own)
        root = next(s for s in slots if s.key == 0).host
        hello = self.agents[root].hello or {}
        port, ps_port = hello["ports"][:2]
        self.host_addrs = addrs if len(addrs) > 1 else {}
        address = addrs[root] if len(addrs) > 1 else "127.0.0.1"
        return Endpoints(addr=address, port=port, ps_port=ps_port if config.num_servers > 0 else None,
                         host_addrs=self.host_addrs)

    def run(
        self,
        config: LaunchConfig,
        slots: Sequence[Slot],
        env: Mapping[str, str],
        sink: OutputSink,
        interrupt: Interrupt,
    ) -> JobResult:
        """Send every agent the job's environment (each host keeps its own :data:`HOST_SPECIFIC` ones) and run."""
        common = {k: v for k, v in env.items() if k not in HOST_SPECIFIC}
        return super().run(config, slots, common, sink, interrupt)


def host_address(host: str, addrs: Mapping[str, str]) -> str:
    """How the other hosts reach ``host``: its name's address if one of its interfaces has it, else the first
    non-loopback interface address, else the name itself."""
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        resolved = ""
    others = [a for name, a in sorted(addrs.items()) if not a.startswith("127.")]
    if resolved in others:
        return resolved
    return others[0] if others else host


def pe_control_slaves(pe: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """Whether parallel environment ``pe`` has ``control_slaves TRUE`` (None when ``qconf -sp`` cannot tell)."""
    qconf = shutil.which("qconf", path=(os.environ if environ is None else environ).get("PATH"))
    if qconf is None:
        return None
    try:
        result = subprocess.run([qconf, "-sp", pe], capture_output=True, text=True, timeout=30,
                                env=None if environ is None else dict(environ))
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^control_slaves\s+(\S+)", result.stdout, flags=re.MULTILINE)
    if result.returncode != 0 or match is None:
        return None
    return match.group(1).upper() == "TRUE"


# -- from outside a job: submit one ---------------------------------------------------------------


def submit_command(config: LaunchConfig, qsub: str, job: str, out: str, err: str) -> list[str]:
    """The ``qsub -sync y`` command line that runs ``hora run`` as one parallel job.

    The job's configuration travels base64-encoded as one argument (no
    shell or grid-engine parsing can split it); the environment with
    ``-V``, which copies each value as it is.
    """
    slots = config.num_proc + config.num_servers
    command = [qsub, "-sync", "y", "-V", "-cwd", "-b", "y", "-shell", "no", "-N", "hora",
               "-pe", config.sge_pe or DEFAULT_PE, str(slots), "-o", out, "-e", err]
    if config.sge_queue:
        command += ["-q", config.sge_queue]
    return [*command, sys.executable, "-m", "hora.runner.sge_job", job]


def encode_config(config: LaunchConfig) -> str:
    """``config`` as one base64 argument (:func:`decode_config` reads it back inside the job)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields["hosts"] = None
    fields["launcher"] = "sge"
    return base64.b64encode(json.dumps(fields).encode()).decode()


def decode_config(text: str) -> LaunchConfig:
    """The :class:`LaunchConfig` that :func:`encode_config` wrote."""
    fields = json.loads(base64.b64decode(text))
    if fields.get("blacklist_cooldown_range") is not None:
        fields["blacklist_cooldown_range"] = tuple(fields["blacklist_cooldown_range"])
    if fields.get("server_hosts") is not None:
        fields["server_hosts"] = tuple(fields["server_hosts"])
    return LaunchConfig(**fields)


def submit(config: LaunchConfig, stdout: TextIO, stderr: TextIO, interrupt: Interrupt) -> JobResult:
    """Submit the job with ``qsub -sync y``, stream its output, and return its exit status.

    The job's id is printed as soon as qsub says it; a signal to ``hora
    run`` deletes the job (``qdel``).

    Raises:
        LaunchError: no qsub, or the parallel environment cannot run hora
            (``control_slaves FALSE``).
    """
    qsub = find_tool("qsub")
    pe = config.sge_pe or DEFAULT_PE
    if pe_control_slaves(pe) is False:
        raise LaunchError(
            f"the parallel environment {pe!r} has control_slaves FALSE, so hora cannot start ranks in it with "
            f"qrsh -inherit: set control_slaves TRUE (qconf -mp {pe}) or choose another PE with --sge-pe"
        )
    base = os.path.join(os.getcwd(), f".hora-sge-{uuid.uuid4().hex[:12]}")
    out, err = base + ".out", base + ".err"
    for path in (out, err):
        open(path, "wb").close()  # the job appends; the tails start at once
    command = submit_command(config, qsub, encode_config(config), out, err)
    stdbuf = shutil.which("stdbuf")
    if stdbuf:  # qsub block-buffers its messages into a pipe: the job id would come at the end
        command = [stdbuf, "-oL", *command]
    if config.verbose:
        stderr.write(f"hora run: {shlex.join(command)}\n")
        stderr.flush()
    done = threading.Event()
    tails = [threading.Thread(target=_tail, args=(path, stream, done), daemon=True)
             for path, stream in ((out, stdout), (err, stderr))]
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        raise LaunchError(f"cannot start qsub {qsub!r}: {e.strerror or e}") from e
    for thread in tails:
        thread.start()
    job_id: list[str] = []
    said: list[str] = []
    qsub_reader = threading.Thread(target=_read_qsub, args=(proc, job_id, said, stderr), daemon=True)
    qsub_reader.start()
    interrupted = None
    while proc.poll() is None:
        signum = interrupt.pop()
        if signum is not None and interrupted is None:
            interrupted = signum
            if job_id:
                subprocess.run([find_tool("qdel"), job_id[0]], capture_output=True, timeout=30)
            else:
                proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    time.sleep(0.3)  # the job's last lines reach the files before qsub returns; let the tails catch up
    done.set()
    for thread in tails:
        thread.join(5.0)
    for path in (out, err):
        with contextlib.suppress(OSError):
            os.unlink(path)
    qsub_reader.join(5.0)
    if interrupted is not None:
        return JobResult(exit_code=128 + interrupted, interrupted_by=interrupted)
    if not job_id:
        message = (f"qsub did not submit the job; check the parallel environment (--sge-pe {pe}; qconf -spl lists "
                   "them) and the queue (--sge-queue; qconf -sql lists them)")
        return JobResult(exit_code=exit_status(proc.returncode) or 1, message=message, details=tuple(said[-5:]))
    return JobResult(**job_outcome(job_id[0], proc.returncode, said))


def job_outcome(job_id: str, returncode: int, said: Sequence[str]) -> dict[str, object]:
    """The :class:`JobResult` fields for what ``qsub -sync y`` said about the job at its end.

    qsub's own exit status is not enough: a job deleted with ``qdel`` can
    leave it at 0 ("Unable to run job").  The job's status is the one in
    "Job N exited with exit code X", or 128+N for "exited because of
    signal"; without either line, the job did not run to its end.
    """
    for line in said:
        exited = re.match(rf"Job {job_id} exited with exit code (\d+)", line)
        if exited:
            return {"exit_code": exit_status(int(exited.group(1)))}
        killed = re.match(rf"Job {job_id} exited because of signal (\S+?)\.?$", line)
        if killed:
            number = getattr(signal, killed.group(1), None)
            return {"exit_code": 128 + int(number) if number is not None else 1,
                    "message": f"the grid engine ended job {job_id} with {killed.group(1)}"}
    return {"exit_code": exit_status(returncode) or 1,
            "message": f"grid engine job {job_id} did not run to its end (deleted with qdel?)",
            "details": tuple(said[-5:])}


def _read_qsub(proc: subprocess.Popen, job_id: list[str], said: list[str], stderr: TextIO) -> None:
    streams = [proc.stdout, proc.stderr]

    def read(stream) -> None:  # type: ignore[no-untyped-def]
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            submitted = re.match(r"Your job (\d+) ", line)
            if submitted and not job_id:
                job_id.append(submitted.group(1))
                stderr.write(f"hora run: submitted grid engine job {job_id[0]} (qdel {job_id[0]} stops it)\n")
                stderr.flush()
                continue
            said.append(line)
            if not line.startswith("Job ") or " exited " not in line:
                stderr.write(f"hora run: qsub: {line}\n")
                stderr.flush()

    threads = [threading.Thread(target=read, args=(s,), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _tail(path: str, stream: TextIO, done: threading.Event) -> None:
    """Copy the lines appended to ``path`` to ``stream`` until ``done`` is set and the file is read out."""
    with open(path, "rb") as f:
        pending = b""
        while True:
            chunk = f.read(65536)
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    write_bytes(stream, line + b"\n")
                continue
            if done.is_set():
                if pending:
                    write_bytes(stream, pending + b"\n")
                return
            time.sleep(0.05)

