"""A self-check for a cluster: ``hora run -np N -H ... python -m hora.runner.check``.

Every rank joins the job with ``hora.torch.init()``, allreduces a small and a
1 MiB tensor whose correct sums it knows, gathers every rank's host, and
prints one line such as::

    hora check: rank 3 of 6 (local 1 of 2) on h2 10.231.0.2 controller gloo: allreduce ok, hosts h1,h1,h2,h2,h3,h3

A rank whose sums are wrong prints what it got and exits 1, so ``hora run``
reports it as the root cause.  Run it on a new cluster before training:
it exercises the launcher, the rendezvous and the backend over the network.
"""

from __future__ import annotations

import argparse
import socket
import sys


def _address() -> str:
    """This host's address towards the others (the first non-loopback IPv4 one), or ``-``."""
    try:
        import psutil

        for _name, addrs in sorted(psutil.net_if_addrs().items()):
            for addr in addrs:
                if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                    return addr.address
    except ImportError:
        pass
    return "-"


def main(argv: list[str] | None = None) -> int:
    """Run the check on this rank; 0 when every sum is right."""
    parser = argparse.ArgumentParser(prog="python -m hora.runner.check")
    parser.add_argument("--elements", type=int, default=262144, help="size of the large tensor (float32)")
    args = parser.parse_args(argv)

    import torch

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    small = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, name="check.small")
    large = hvd.allreduce(torch.full((args.elements,), float(rank)), op=hvd.Sum, name="check.large")
    hosts = hvd.allgather_object(socket.gethostname())
    expected_small, expected_large = size * (size + 1) / 2, size * (size - 1) / 2
    ok = float(small[0]) == expected_small and bool(torch.all(large == expected_large))
    verdict = "allreduce ok" if ok else (
        f"allreduce WRONG: small {float(small[0])} (expected {expected_small}), "
        f"large {float(large.min())}..{float(large.max())} (expected {expected_large})"
    )
    print(
        f"hora check: rank {rank} of {size} (local {hvd.local_rank()} of {hvd.local_size()}) on "
        f"{socket.gethostname()} {_address()} controller {'mpi' if hvd.mpi_enabled() else 'gloo'}: "
        f"{verdict}, hosts {','.join(hosts)}",
        flush=True,
    )
    hvd.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
