"""Print 'ready <rank> <host> <pid>' and wait to be stopped (for the kill test)."""

import os
import socket
import sys
import time

rank = os.environ.get("HORA_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
print(f"ready {rank} {socket.gethostname()} {os.getpid()}", flush=True)
print(f"rank {rank} waits on stderr", file=sys.stderr, flush=True)
time.sleep(120)
print(f"rank {rank} was not stopped", flush=True)
