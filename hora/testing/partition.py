"""Silent partitions on an emulated cluster: a host's link cut without a word, and put back.

:func:`cut` takes the host's veth off the cluster bridge and down, which is
what a dead switch port, a power loss or a reclaimed spot instance looks
like from the other hosts: its packets stop, no FIN, no RST, and every TCP
connection to it hangs.  :func:`restore` puts it back (a blip when soon).
"""

from __future__ import annotations

import subprocess

from hora.testing.emulate import EmulatedCluster


def _link(cluster: EmulatedCluster, host: str) -> tuple[str, str]:
    number = [h.name for h in cluster.hosts].index(cluster.host(host).name) + 1
    return f"hora{cluster.index}v{number}", f"hora{cluster.index}br"


def cut(cluster: EmulatedCluster, host: str) -> None:
    """Take ``host``'s link off the bridge and down: its packets stop, nobody is told."""
    veth, _ = _link(cluster, host)
    subprocess.run(["ip", "link", "set", veth, "nomaster"], check=True, timeout=30)
    subprocess.run(["ip", "link", "set", veth, "down"], check=True, timeout=30)


def restore(cluster: EmulatedCluster, host: str) -> None:
    """Put ``host``'s link back on the bridge and up."""
    veth, bridge = _link(cluster, host)
    subprocess.run(["ip", "link", "set", veth, "master", bridge], check=True, timeout=30)
    subprocess.run(["ip", "link", "set", veth, "up"], check=True, timeout=30)
