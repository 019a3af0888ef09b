"""A dist_sync worker that pushes and pulls until it fails; prints 'pushing <rank>' once, then the error it got."""

import socket
import sys
import time

import numpy as np

import hora.kvstore as kvs
from hora.errors import PeerLostError

kv = kvs.create("dist_sync")
kv.init("w", np.zeros(1000, dtype=np.float32))
out = np.empty(1000, dtype=np.float32)
print(f"pushing {kv.rank} {socket.gethostname()}", flush=True)
last = time.time()
try:
    while True:
        kv.push("w", np.ones(1000, dtype=np.float32))
        kv.pull("w", out=out)
        last = time.time()
        time.sleep(0.05)
except PeerLostError as e:
    print(f"lost at {time.time():.3f} (last pull {last:.3f}): {e}", flush=True)
    sys.exit(3)
