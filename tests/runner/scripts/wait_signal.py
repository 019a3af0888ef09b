"""Say ready, then wait for a signal; record which one in argv[1]/got.<rank>."""

import os
import signal
import sys
import time

rank = os.environ.get("HORA_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))


def on_signal(signum, frame):
    name = signal.Signals(signum).name
    with open(os.path.join(sys.argv[1], f"got.{rank}"), "w") as f:
        f.write(name)
    print(f"rank {rank} got {name}", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
print(f"ready {rank}", flush=True)
time.sleep(60)
