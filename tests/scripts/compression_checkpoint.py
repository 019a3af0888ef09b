"""Train with a stateful compressor, checkpointing mid-way; or resume from that checkpoint in a fresh process.

``--mode full`` trains all steps, saving each rank's model and optimizer
(with the compressor's state) after ``--save-at`` steps; ``--mode resume``
loads that checkpoint and trains the remaining steps.  Both write each
rank's final parameters, which the driver test compares.
"""

import argparse
from pathlib import Path

import torch

import hora.torch as hvd
from hora.core.compression import parse_spec

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["full", "resume"], required=True)
p.add_argument("--dir", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save-at", type=int, default=3)
p.add_argument("--compression", default="powersgd:2")
args = p.parse_args()

hvd.init()
rank = hvd.rank()
out = Path(args.dir)
torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 4))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=parse_spec(args.compression))
start = 0
if args.mode == "resume":
    saved = torch.load(out / f"ckpt.{rank}.pt")
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    start = saved["step"]
for step in range(start, args.steps):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(16, 20, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if args.mode == "full" and step + 1 == args.save_at:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1},
                   out / f"ckpt.{rank}.pt")
torch.save([p.detach().clone() for p in model.parameters()], out / f"{args.mode}.{rank}.pt")
hvd.shutdown()
