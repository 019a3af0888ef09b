"""Rank 1 fails on purpose while the others wait; argv[1] says how.

exit3: rank 1 writes to stderr and exits with code 3.
sigkill: rank 1 kills itself with SIGKILL.
stubborn: like exit3, but rank 0 ignores SIGTERM (the launcher must SIGKILL it).
"""

import os
import signal
import sys
import time

mode = sys.argv[1]
rank = int(next((os.environ[n] for n in ("HORA_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID") if n in os.environ), -1))
print(f"rank {rank} started", flush=True)
if rank == 1:
    time.sleep(0.3)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    print("rank 1 is failing on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(60)
print(f"rank {rank} was not stopped", flush=True)
