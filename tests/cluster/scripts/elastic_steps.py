"""Elastic training that logs every step with its wall time (host-loss tests); ends when --stop-file appears.

Each rank appends ``{"time", "rank", "size", "step", "host"}`` to --logfile
after every step; at the end each rank appends its weights' digest to
--weights-file.
"""

import argparse
import hashlib
import json
import os
import socket
import time

import torch
import torch.nn.functional as F

import hora.torch as hvd

p = argparse.ArgumentParser()
p.add_argument("--logfile", required=True)
p.add_argument("--weights-file", required=True)
p.add_argument("--stop-file", required=True)
p.add_argument("--batch-wait", type=float, default=0.1)
args = p.parse_args()

hvd.init()
torch.manual_seed(1234)
data, target = torch.randn(32, 4), torch.randint(0, 2, (32,))
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())


@hvd.elastic.run
def train(state):
    while True:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        state.step += 1
        with open(args.logfile, "a") as f:
            f.write(json.dumps({"time": time.time(), "rank": hvd.rank(), "size": hvd.size(), "step": state.step,
                                "host": socket.gethostname()}) + "\n")
        state.commit()
        if hvd.broadcast_object(os.path.exists(args.stop_file), root_rank=0):
            return
        time.sleep(args.batch_wait)


state = hvd.elastic.TorchState(model, optimizer, step=0)
train(state)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
with open(args.weights_file, "a") as f:
    f.write(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(),
                        "digest": digest}) + "\n")
