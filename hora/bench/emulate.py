"""``--emulate-hosts N --link 1gbit [--latency 0.1ms]``: run a benchmark on an emulated cluster.

The emulation is :mod:`hora.runner.emulate`: one Linux network namespace per
host on a bridge, each host's link shaped both ways with ``tc``, sshd on
every host.  :func:`emulated_hosts` is the only place ``hora bench`` touches
it: it starts ``N`` hosts, yields a :class:`Placement` (the ``-H`` list, the
cluster's ssh config for ``hora run``, and the ``nsenter`` prefix that starts
the launcher on the first host), and tears the cluster down afterwards.  The
launcher then reaches the other hosts over ssh, as on a real cluster, so
every rank (and every server, when the launcher places servers on hosts of
their own) talks over a shaped link.  Where the emulation cannot run (no
root, no ``ip netns``), asking for it raises
:class:`hora.errors.UnsupportedError` with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
from collections.abc import Iterator
from types import ModuleType

from hora.bench.units import fmt_rate, parse_duration, parse_rate
from hora.errors import ConfigError, HoraError, UnsupportedError

#: The module of the cluster emulation.
EMULATION_MODULE = "hora.runner.emulate"


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Placement:
    """Where the jobs of a benchmark run: ``-H`` hosts, extra ``hora run`` flags, and a command prefix.

    On localhost or real hosts only ``hosts`` may be set; on an emulated
    cluster ``prefix`` starts ``hora run`` inside the first host and
    ``run_args`` give it the cluster's ssh config.
    """

    hosts: str | None = None
    run_args: tuple[str, ...] = ()
    prefix: tuple[str, ...] = ()


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Emulation:
    """An emulated cluster: ``hosts`` namespace hosts, each on a link of ``link`` (tc units) with ``latency``."""

    hosts: int
    link: str
    latency: str | None = None

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise ConfigError(f"--emulate-hosts {self.hosts} must be >= 1")
        parse_rate(self.link)
        if self.latency is not None:
            parse_duration(self.latency)

    @classmethod
    def from_args(cls, hosts: int | None, link: str | None, latency: str | None) -> Emulation | None:
        """The emulation the flags ask for, or None without ``--emulate-hosts``.

        Raises:
            ConfigError: ``--emulate-hosts`` without ``--link``, or a bad value.
        """
        if hosts is None:
            return None
        if link is None or link == "auto":
            raise ConfigError("--emulate-hosts needs the emulated link's rate: add --link 1gbit (or 10gbit, ...)")
        return cls(hosts=hosts, link=link, latency=latency)

    @property
    def link_bps(self) -> float:
        """The link rate in bits per second."""
        return parse_rate(self.link)

    @property
    def latency_s(self) -> float:
        """The one-way latency in seconds (0 when none is added)."""
        return parse_duration(self.latency) if self.latency is not None else 0.0

    def describe(self) -> str:
        """``8 emulated hosts, 1 Gbit/s links, 0.1 ms latency``."""
        return f"{self.hosts} emulated hosts, {fmt_rate(self.link_bps)} links, {self.latency_s * 1e3:g} ms latency"


def emulation_module() -> ModuleType | None:
    """The cluster-emulation module if this installation has one, else None."""
    try:
        return importlib.import_module(EMULATION_MODULE)
    except ImportError:
        return None


def _run_accepts(flag: str) -> bool:
    """Whether ``hora run`` has ``flag`` in this installation."""
    from hora.runner.cli import add_run_arguments

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return flag in parser._option_string_actions


@contextlib.contextmanager
def emulated_hosts(emulation: Emulation) -> Iterator[Placement]:
    """Start the emulated cluster; yield where jobs run on it; tear it down after.

    Raises:
        UnsupportedError: no cluster emulation in this installation, or it
            cannot run here (no root, no ``ip netns``, no sshd), or ``hora run``
            has no ssh launcher to reach its hosts.
    """
    module = emulation_module()
    if module is None:
        raise UnsupportedError(
            f"--emulate-hosts needs hora's cluster emulation ({EMULATION_MODULE}), which this installation "
            "does not have; run without --emulate-hosts, or on a real cluster with -H/--hostfile")
    if not _run_accepts("--ssh-config-file"):
        raise UnsupportedError("--emulate-hosts needs hora run's ssh launcher (--ssh-config-file) to reach the "
                               "emulated hosts, which this installation does not have")
    try:
        cluster = module.EmulatedCluster(emulation.hosts, link=emulation.link, latency=emulation.latency)
        cluster.start()
    except HoraError as e:
        if isinstance(e, ConfigError):
            raise
        raise UnsupportedError(f"cannot start {emulation.describe()}: {e}") from e
    try:
        first = cluster.hosts[0].name
        yield Placement(hosts=cluster.hosts_spec(1), run_args=("--ssh-config-file", cluster.ssh_config),
                        prefix=tuple(cluster.command(first, [])))
    finally:
        cluster.close()
