"""Host lists: horovodrun's ``-H host:slots,...``, hostfiles (horovodrun's and MXNet launch.py's), this machine's names.

Every launcher that takes ``-H``/``--hostfile`` reads hosts through here;
whether a name is this machine (:func:`is_local_host`) is decided here
once, for the launchers' checks and for merging this machine's names.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections.abc import Sequence

from hora.errors import ConfigError
from hora.placement import HostSlots

_HOST_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def parse_hosts(spec: str) -> tuple[HostSlots, ...]:
    """Parse horovodrun's ``-H host1:2,host2:4`` syntax.

    A host without ``:slots`` gets one slot, as in horovodrun.

    Raises:
        ConfigError: an entry is empty or its slot count is not a positive integer.
    """
    hosts: list[HostSlots] = []
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            raise ConfigError(f"-H {spec!r} has an empty host entry")
        name, count = split_entry(entry)
        hosts.append(HostSlots(check_host_name(name, spec), _slot_count(count or "1", entry)))
    return tuple(hosts)


def split_entry(entry: str) -> tuple[str, str | None]:
    """``"host:2"`` -> ``("host", "2")``; ``"host"`` and a bare IPv6 address have no count."""
    name, sep, count = entry.rpartition(":")
    if not sep or "]" in count or (name.count(":") and not name.endswith("]")):
        return entry.strip("[]"), None
    return name.strip("[]"), count


def check_host_name(name: str, where: str) -> str:
    """Return ``name`` if it is a plausible host name or IP address.

    Raises:
        ConfigError: it is empty or has characters no host name has.
    """
    if _HOST_NAME.match(name):
        return name
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    raise ConfigError(
        f"host {name!r} in {where!r} is malformed: give host or host:slots, where host has only letters, "
        "digits, '.', '-' and '_' (or is an IP address)"
    )


def check_unique_hosts(hosts: Sequence[HostSlots]) -> None:
    """Raise :class:`ConfigError` when a host is listed twice."""
    seen: dict[str, HostSlots] = {}
    for h in hosts:
        name = h.host.lower()
        if name in seen:
            raise ConfigError(
                f"host {h.host!r} is listed twice ({seen[name]} and {h}); list each host once with all its slots"
            )
        seen[name] = h


def spread(hosts: Sequence[HostSlots], num_proc: int) -> tuple[HostSlots, ...]:
    """Slots for hosts without counts: ``num_proc`` workers spread evenly, earlier hosts first."""
    share, extra = divmod(num_proc, len(hosts))
    return tuple(HostSlots(h.host, share + (i < extra)) for i, h in enumerate(hosts))


def parse_hostfile(path: str) -> tuple[HostSlots, ...]:
    """Read a hostfile: one host per line as ``host``, ``host:N`` or ``host slots=N``.

    The first two forms are MXNet launch.py's, the last is horovodrun's
    (and Open MPI's).  Blank lines and ``#`` comments are skipped.  When no
    line gives a slot count (an MXNet hostfile), the hosts are returned with
    ``fixed=False``: the workers are spread evenly over them.

    Raises:
        ConfigError: the file cannot be read, is empty or has a malformed line.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read hostfile {path!r}: {e.strerror}") from e
    hosts: list[HostSlots] = []
    counted = False
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) == 1:
            counted = counted or split_entry(fields[0])[1] is not None
            hosts.extend(parse_hosts(fields[0]))
        elif len(fields) == 2 and fields[1].startswith("slots="):
            counted = True
            name = check_host_name(fields[0], f"{path}:{number}")
            hosts.append(HostSlots(name, _slot_count(fields[1][6:], f"{path}:{number}")))
        else:
            raise ConfigError(f"{path}:{number}: cannot parse {raw!r} (use 'host slots=N' or 'host:N')")
    if not hosts:
        raise ConfigError(f"hostfile {path!r} lists no hosts")
    if not counted:
        return tuple(HostSlots(h.host, h.slots, fixed=False) for h in hosts)
    return tuple(hosts)


def _slot_count(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ConfigError(f"slot count {text!r} in {where!r} is not an integer") from None
    if slots < 1:
        raise ConfigError(f"slot count {slots} in {where!r} must be >= 1")
    return slots


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (a loopback address or our own hostname)."""
    name = host.strip("[]").lower()
    if name in ("localhost", "localhost.localdomain"):
        return True
    try:
        if ipaddress.ip_address(name).is_loopback:
            return True
    except ValueError:
        pass
    return name in _own_names()


@functools.lru_cache(maxsize=1)
def _own_names() -> frozenset[str]:
    own = {socket.gethostname().lower(), socket.getfqdn().lower()}
    return frozenset(own | {n.split(".")[0] for n in own})


def merged_hosts(hosts: Sequence[HostSlots]) -> list[HostSlots]:
    """The host list with every name of this machine merged into one entry.

    ``localhost``, ``127.0.0.1`` and this machine's hostname are one host:
    it takes the place of the first of them, is named by
    :func:`socket.gethostname`, and has the sum of their slots.
    """
    merged: list[HostSlots] = []
    local_index: int | None = None
    for h in hosts:
        if is_local_host(h.host):
            if local_index is None:
                local_index = len(merged)
                merged.append(HostSlots(socket.gethostname(), h.slots))
            else:
                merged[local_index] = HostSlots(merged[local_index].host, merged[local_index].slots + h.slots)
        else:
            merged.append(h)
    return merged
