"""A job that records timelines; tests/test_timeline_job.py runs it under `hora run` and reads the files.

Modes:
  spans DIR      named allreduces, allgathers and broadcasts for a few steps; the timeline comes from
                 --timeline-filename / HORA_TIMELINE, and is closed by the normal exit.
  startstop DIR  hvd.start_timeline / stop_timeline three times, into DIR/run{1,2,3}.json.
  sigterm DIR    steps forever; after 5 steps rank 0 sends itself SIGTERM.
  forever DIR    steps until the launcher is interrupted; rank 0 touches DIR/started after 5 steps.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

import hora.torch as hvd


def step(i: int) -> None:
    handles = [hvd.allreduce_async(torch.full((8,), float(i)), name=f"grad.{k}") for k in range(3)]
    handles.append(hvd.allreduce_async(torch.ones(300_000), name="grad.big"))
    for h in handles:
        hvd.synchronize(h)
    gathered = hvd.allgather(torch.full((2, 2), float(hvd.rank())), name="gathered")
    assert gathered.shape == (2 * hvd.size(), 2)
    out = hvd.broadcast(torch.full((3,), float(hvd.rank())), root_rank=0, name="weights")
    assert float(out[0]) == 0.0


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    hvd.init()
    if mode == "spans":
        for i in range(3):
            step(i)
    elif mode == "startstop":
        for n, cycles in ((1, False), (2, True), (3, False)):
            hvd.start_timeline(str(out / f"run{n}.json"), mark_cycles=cycles)
            step(n)
            hvd.stop_timeline()
            step(10 + n)  # not recorded
    elif mode in ("sigterm", "forever"):
        i = 0
        while True:
            step(i)
            i += 1
            if i == 5 and hvd.rank() == 0:
                if mode == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                else:
                    (out / "started").touch()
    hvd.shutdown()


if __name__ == "__main__":
    main()
