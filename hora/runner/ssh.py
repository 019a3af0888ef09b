"""ssh for the launchers: client options, the agent's remote command, copying the working directory.

Every ssh hora runs is non-interactive (``BatchMode=yes``: a host that asks
for a password fails at once instead of hanging), gives up on a host after
``ConnectTimeout``, and notices a dead connection within about 15 seconds
(``ServerAliveInterval``).  Host keys: when the user's ssh configuration
says nothing about ``StrictHostKeyChecking``, hora uses ``accept-new``
(unknown hosts are added, changed keys are refused); an explicit setting in
the user's config, or in ``--ssh-config-file``, is left alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hora.errors import LaunchError
from hora.runner.launch_config import LaunchConfig

#: The agent's source, sent with ``python3 -c`` (see :mod:`hora.runner.agent`).
AGENT_SOURCE = (Path(__file__).parent / "agent.py").read_text(encoding="utf-8")
#: Seconds a file copy to one host may take.
SYNC_TIMEOUT = 600.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SshOptions:
    """How to reach the hosts: port, identity, config file, connect timeout."""

    port: int | None = None
    identity_file: str | None = None
    config_file: str | None = None
    connect_timeout: float = 10.0

    @classmethod
    def from_config(cls, config: LaunchConfig) -> SshOptions:
        """The ssh options of a launch."""
        return cls(
            port=config.ssh_port,
            identity_file=config.ssh_identity_file,
            config_file=config.ssh_config_file,
            connect_timeout=config.ssh_connect_timeout,
        )

    def head(self) -> list[str]:
        """The user's own choices: ``-F``, ``-p`` and ``-i``."""
        options = []
        if self.config_file:
            options += ["-F", self.config_file]
        if self.port:
            options += ["-p", str(self.port)]
        if self.identity_file:
            options += ["-i", self.identity_file]
        return options

    def options(self, host: str | None = None) -> list[str]:
        """Everything between ``ssh`` and the host name.

        Args:
            host: the host the options are for (its effective configuration
                decides the host-key policy); None for options shared by all.
        """
        head = self.head()
        options = head + [
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={max(1, math.ceil(self.connect_timeout))}",
            "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3",
            "-o", "LogLevel=ERROR",
        ]
        if _host_key_policy_unset(tuple(head), host or "localhost"):
            options += ["-o", "StrictHostKeyChecking=accept-new"]
        return options

    def command(self, host: str, remote_command: str) -> list[str]:
        """``ssh`` running ``remote_command`` (one shell string) on ``host``, without a terminal."""
        return ["ssh", "-T", *self.options(host), host, remote_command]

    def rsh(self, host: str | None = None) -> str:
        """The ssh command for ``rsync -e``."""
        return shlex.join(["ssh", *self.options(host)])

    def scp_options(self, host: str | None = None) -> list[str]:
        """The same options spelled for scp (``-P`` for the port)."""
        options = self.options(host)
        if "-p" in options:
            options[options.index("-p")] = "-P"
        return options


@functools.lru_cache(maxsize=256)
def _host_key_policy_unset(head: tuple[str, ...], host: str) -> bool:
    """Whether ssh's effective StrictHostKeyChecking for ``host`` is the default (``ask``)."""
    try:
        result = subprocess.run(
            ["ssh", "-G", *head, host], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return True
    for line in result.stdout.splitlines():
        name, _, value = line.partition(" ")
        if name.lower() == "stricthostkeychecking":
            return value.strip().lower() == "ask"
    return True


def agent_command(path: str | None, source: str = AGENT_SOURCE) -> str:
    """The remote shell command that starts the agent with the best Python on the host.

    It tries the launcher's own interpreter path first (hosts often share
    it), then ``python3`` and ``python`` on the launcher's PATH followed by
    the host's own.  ``source`` is the code run with ``-c`` (the agent's,
    possibly behind a prelude of the launcher's).
    """
    candidates = " ".join(shlex.quote(p) for p in (sys.executable, "python3", "python"))
    source = shlex.quote(source)
    lines = []
    if path:
        lines.append(f'PATH={shlex.quote(path)}:"$PATH"; export PATH')
    lines.append(
        f'for p in {candidates}; do if command -v "$p" >/dev/null 2>&1; then exec "$p" -c {source}; fi; done'
    )
    lines.append('echo "hora: no python3 on PATH on $(hostname)" >&2; exit 127')
    return "; ".join(lines)


def local_agent_command() -> list[str]:
    """The agent for this machine: a plain child of the launcher."""
    return [sys.executable, "-c", AGENT_SOURCE]


def sync_directory(source: str, hosts: Sequence[tuple[str, bool]], dst: str, ssh: SshOptions) -> None:
    """Copy ``source``'s contents into ``dst`` on every host, in parallel.

    rsync is used when it is installed here (and on the host); otherwise
    scp.  This machine (``(name, True)`` entries) gets a local copy.

    Raises:
        LaunchError: a copy failed; the message names the host and quotes the tool.
    """
    def copy(host: str, local: bool) -> None:
        if local:
            if os.path.realpath(source) != os.path.realpath(dst):
                shutil.copytree(source, dst, dirs_exist_ok=True, symlinks=True)
            return
        errors = []
        if shutil.which("rsync"):
            command = ["rsync", "-a", "--mkpath", "-e", ssh.rsh(host), f"{source.rstrip('/')}/", f"{host}:{dst}/"]
            result = _run(command)
            if result.returncode == 0:
                return
            errors.append(f"rsync: {_last_line(result.stderr)}")
        mkdir = _run(ssh.command(host, f"mkdir -p {shlex.quote(dst)}"))
        if mkdir.returncode != 0:
            raise LaunchError(f"--sync-dst-dir: cannot create {dst} on {host}: {_last_line(mkdir.stderr)}")
        entries = [os.path.join(source, name) for name in sorted(os.listdir(source))]
        if entries:
            result = _run(["scp", "-r", "-p", "-q", *ssh.scp_options(host), *entries, f"{host}:{dst}/"])
            if result.returncode != 0:
                errors.append(f"scp: {_last_line(result.stderr)}")
                raise LaunchError(f"--sync-dst-dir: copying {source} to {host}:{dst} failed ({'; '.join(errors)})")

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        for future in [pool.submit(copy, host, local) for host, local in hosts]:
            future.result()


def _run(command: Sequence[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            list(command), capture_output=True, text=True, timeout=SYNC_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as e:
        raise LaunchError(f"--sync-dst-dir: {command[0]} took longer than {SYNC_TIMEOUT:g} s") from e


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no error message"
