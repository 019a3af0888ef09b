"""Print this rank's launcher-provided environment as one JSON line."""

import json
import os
import sys

NAMES = [
    "HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_CROSS_RANK", "HORA_CROSS_SIZE",
    "HORA_HOSTNAME", "HORA_RENDEZVOUS_ADDR", "HORA_RENDEZVOUS_PORT", "HORA_SECRET", "HORA_CONTROLLER",
    "HORA_FUSION_THRESHOLD", "HORA_FUSION_THRESHOLD_MB", "HORA_CYCLE_TIME", "HORA_TIMELINE",
    "HORA_START_TIMEOUT", "HORA_NETWORK_INTERFACE", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED", "OMPI_COMM_WORLD_RANK", "HORA_TEST_EXTRA",
]
print("ENV " + json.dumps({name: os.environ.get(name) for name in NAMES}))
rank = os.environ.get("HORA_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
print(f"hello from rank {rank} on stderr", file=sys.stderr)
