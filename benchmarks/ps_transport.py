"""What the parameter server's transport security costs, measured below the job level (issue 19).

Two micro-benchmarks, each in this one process, each ``--repeat`` times
(minimum and every value printed):

* **link**: DEALER to ROUTER over TCP loopback, 4 MiB messages, with the
  transports of ``hora.kvstore.ps.secure``: none (plain ZeroMQ, as before
  issue 19), PLAIN with hora's token (the default) and CURVE
  (``HORA_PS_ENCRYPT=1``).  GB/s of one connection.
* **receive**: CPU time per received message (header, 4 MiB payload, MAC)
  of pyzmq's ``recv_multipart`` (before) and of
  :class:`hora.kvstore.ps.net.Receiver` (after), over inproc.

The full push+pull comparison is ``benchmarks/kvstore.py --transports``::

    python benchmarks/ps_transport.py --repeat 3
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hora.kvstore.ps import secure  # noqa: E402
from hora.kvstore.ps.net import DropLog, Receiver  # noqa: E402

PART = 4 << 20  # one part of a push (HORA_PS_PART_BYTES)


def link_gbps(mode: str, messages: int) -> float:
    """GB/s of ``messages`` 4 MiB messages over one authenticated (or not: ``none``) TCP connection."""
    ctx = zmq.Context(io_threads=2)
    try:
        creds = secure.credentials(b"benchmark secret", mode == "curve")
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        if mode != "none":
            secure.secure_listener(router, creds)
            secure.Authenticator(ctx, creds, "bench", router)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        if mode == "none":
            dealer.connect(f"tcp://127.0.0.1:{port}")
        else:
            secure.secure_connect(dealer, creds, f"tcp://127.0.0.1:{port}")
        payload = np.ones(PART // 4, np.float32)
        dealer.send_multipart([b"h", payload])
        router.recv_multipart()

        def send() -> None:
            for _ in range(messages):
                dealer.send_multipart([b"h", payload], copy=False)

        t0 = time.perf_counter()
        sender = threading.Thread(target=send)
        sender.start()
        for _ in range(messages):
            router.recv_multipart(copy=False)
        sender.join()
        seconds = time.perf_counter() - t0
        for sock in (dealer, router):
            sock.close(linger=0)
        return PART * messages / seconds / 1e9
    finally:
        ctx.term()


def receive_cpu_us(how: str, messages: int) -> float:
    """CPU microseconds per received 3-frame message (4 MiB payload), ``recv_multipart`` or ``Receiver``."""
    ctx = zmq.Context()
    try:
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        router.setsockopt(zmq.RCVHWM, 0)
        dealer.setsockopt(zmq.SNDHWM, 0)
        router.bind("inproc://bench")
        dealer.connect("inproc://bench")
        payload = np.ones(PART // 4, np.float32)
        for _ in range(messages):
            dealer.send_multipart([b"h" * 200, payload, b"m" * 32], copy=False)
        time.sleep(0.2)
        t0 = time.process_time()
        if how == "recv_multipart":
            for _ in range(messages):
                router.recv_multipart(copy=False)
        else:
            receiver, n = Receiver(router, 1 << 16, DropLog("bench")), 0
            while n < messages:
                n += sum(1 for _ in receiver.messages(1 << 16))
        cpu = time.process_time() - t0
        for sock in (dealer, router):
            sock.close(linger=0)
        return cpu / messages * 1e6
    finally:
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    """Run both micro-benchmarks and print their tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--repeat", type=int, default=3, help="runs of each case")
    p.add_argument("--messages", type=int, default=64, help="4 MiB messages per link run")
    args = p.parse_args(argv)
    print("| link (one TCP connection, 4 MiB messages) | GB/s (best) | every run |\n|---|---:|---|")
    for mode in ("none", "plain", "curve"):
        runs = [link_gbps(mode, args.messages) for _ in range(args.repeat)]
        print(f"| {mode} | {max(runs):.2f} | {', '.join(f'{x:.2f}' for x in runs)} |")
    print("\n| receive (inproc, header + 4 MiB + MAC) | CPU µs per message (best) | every run |\n|---|---:|---|")
    for how in ("recv_multipart", "Receiver"):
        runs = [receive_cpu_us(how, 2000) for _ in range(args.repeat)]
        print(f"| {how} | {min(runs):.1f} | {', '.join(f'{x:.1f}' for x in runs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
