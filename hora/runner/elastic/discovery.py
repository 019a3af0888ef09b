"""Where the elastic driver learns which hosts exist: a discovery script, or the fixed ``-H`` / ``--hostfile`` list.

The script is horovodrun's ``--host-discovery-script``: an executable that
prints one host per line, ``host:slots`` or ``host`` (then
``--slots-per-host`` slots, default 1).  It is run again every poll; a run
that fails or times out keeps the previous answer and is logged.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping, Sequence

from hora.errors import ConfigError
from hora.placement import HostSlots
from hora.runner.hostlist import check_host_name

log = logging.getLogger(__name__)

#: Seconds one run of the discovery script may take.
SCRIPT_TIMEOUT = 30.0


def parse_discovery_output(text: str, default_slots: int | None, where: str = "discovery script") -> dict[str, int]:
    """The hosts of a discovery script's output: ``host:slots`` or ``host`` per line.

    Raises:
        ConfigError: a line is malformed, or a host gives no slots and no
            ``--slots-per-host`` was set.
    """
    hosts: dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, count = line.rpartition(":")
        if not sep:
            name, count = line, ""
        check_host_name(name, where)
        if count:  # the script's own count wins over --slots-per-host, as in horovodrun
            if not count.isdigit() or int(count) < 1:
                raise ConfigError(f"{where} printed {raw!r}: the slot count must be a positive integer")
            slots = int(count)
        else:
            slots = default_slots or 1
        hosts[name] = hosts.get(name, 0) + slots
    return hosts


class ScriptDiscovery:
    """Runs the discovery script; :meth:`find` returns host -> slots (the last good answer if a run fails)."""

    def __init__(self, script: str, slots_per_host: int | None = None, env: Mapping[str, str] | None = None) -> None:
        self.script = script
        self.slots_per_host = slots_per_host
        self.env = dict(env) if env is not None else None
        self._last: dict[str, int] = {}

    def find(self) -> dict[str, int]:
        try:
            proc = subprocess.run([self.script], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT,
                                  env=self.env, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("host discovery script %s failed: %s; keeping the previous hosts", self.script, e)
            return dict(self._last)
        if proc.returncode != 0:
            log.warning("host discovery script %s exited with %d (%s); keeping the previous hosts", self.script,
                        proc.returncode, proc.stderr.strip()[-300:])
            return dict(self._last)
        try:
            self._last = parse_discovery_output(proc.stdout, self.slots_per_host, self.script)
        except ConfigError as e:
            log.warning("%s; keeping the previous hosts", e)
        return dict(self._last)


class FixedHosts:
    """The ``-H`` / ``--hostfile`` hosts: always the same set (failures still blacklist)."""

    def __init__(self, hosts: Sequence[HostSlots]) -> None:
        self._hosts = {h.host: h.slots for h in hosts}

    def find(self) -> dict[str, int]:
        return dict(self._hosts)
