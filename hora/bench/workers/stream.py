"""One TCP stream between two hosts, for calibrating an emulated cluster's links (no hora, no launcher).

``recv ADDR:PORT BYTES`` listens, prints ``ready``, takes one connection and
reads ``BYTES`` from it, then prints ``{"bytes": n, "seconds": t}``, timed
from the first byte to the last.  ``send ADDR:PORT BYTES`` connects and
writes ``BYTES`` of zeros in 1 MiB ``sendall`` calls.  Both give up after
``--timeout`` seconds.  :func:`hora.bench.emulate.calibrate` starts pairs of
them on emulated hosts.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

CHUNK = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``recv|send ADDR:PORT BYTES [--timeout S]``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("mode", choices=("recv", "send"))
    p.add_argument("address", help="ADDR:PORT")
    p.add_argument("bytes", type=int)
    p.add_argument("--timeout", type=float, default=60.0)
    return p.parse_args(argv)


def receive(host: str, port: int, nbytes: int, timeout: float) -> dict[str, float]:
    """Accept one connection and read ``nbytes``; the bytes read and the seconds from first to last byte."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, port))
        server.listen(1)
        server.settimeout(timeout)
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            buf = bytearray(CHUNK)
            got, first = 0, None
            while got < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                if first is None:
                    first = time.perf_counter()
                got += n
            return {"bytes": got, "seconds": time.perf_counter() - (first or time.perf_counter())}


def send(host: str, port: int, nbytes: int, timeout: float) -> None:
    """Connect and write ``nbytes`` of zeros."""
    payload = bytes(CHUNK)
    with socket.create_connection((host, port), timeout=timeout) as conn:
        sent = 0
        while sent < nbytes:
            conn.sendall(payload[:min(CHUNK, nbytes - sent)])
            sent += min(CHUNK, nbytes - sent)


def main(argv: list[str] | None = None) -> int:
    """Run one end of the stream."""
    args = parse_args(argv)
    host, _, port = args.address.rpartition(":")
    if args.mode == "recv":
        print(json.dumps(receive(host, int(port), args.bytes, args.timeout)), flush=True)
    else:
        send(host, int(port), args.bytes, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
