"""A job where one setting is clearly best: 200 tiny named allreduces per step, fused or not.

tests/test_autotune_job.py runs it with HORA_AUTOTUNE=1 and a small candidate space; every rank checks
every result, and at the end the ranks compare the settings they run with.
"""

from __future__ import annotations

import sys

import torch

import hora.torch as hvd
from hora.core import runtime


def main() -> None:
    steps = int(sys.argv[1])
    hvd.init()
    tensors = [torch.zeros(16) for _ in range(200)]
    for step in range(steps):
        for i, t in enumerate(tensors):
            t.fill_(float(hvd.rank() + i + step))
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"tiny.{i}") for i, t in enumerate(tensors)]
        for i, h in enumerate(handles):
            out = hvd.synchronize(h)
            expected = sum(r + i + step for r in range(hvd.size()))
            assert float(out[0]) == expected, (step, i, float(out[0]), expected)
    engine = runtime.current().engine
    mine = torch.tensor([engine.config.fusion_threshold_bytes, engine.config.cycle_time_ms * 1000, engine.overlap],
                        dtype=torch.float64)
    every = hvd.allgather(mine.unsqueeze(0), name="settings")
    assert all(torch.equal(every[0], row) for row in every), every
    if hvd.rank() == 0:
        print(f"settings everywhere: fusion={int(every[0][0])} cycle_us={int(every[0][1])} overlap={int(every[0][2])}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
