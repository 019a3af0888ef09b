"""A small elastic training job for the tests: logs rank/size per epoch, fails on schedule, waits for host changes.

Rank 0 appends one JSON line per epoch to --logfile and writes the next
epoch number to --epoch-file, which the tests' discovery scripts read to
change the host list by epoch.  --exit-schedule maps "epoch,batch" to the
start ranks (HORA_RANK at spawn) that fail there, by exception or SIGKILL.
At the end every rank appends a digest of its weights to --weights-file.
With --samples N the state holds an ElasticSampler over N samples, each
batch records --batch-size per rank, and every rank appends the sampler's
public values to --sampler-log whenever train() (re)starts.
"""

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import hora.torch as hvd
from hora.core.compression import parse_spec

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--batches-per-epoch", type=int, default=10)
p.add_argument("--batches-per-commit", type=int, default=1)
p.add_argument("--logfile", required=True)
p.add_argument("--epoch-file")
p.add_argument("--weights-file")
p.add_argument("--exit-schedule", default="{}")
p.add_argument("--exit-mode", default="exception", choices=["exception", "kill"])
p.add_argument("--wait-for-hosts", default="", help="comma-separated epochs after which the host set changes")
p.add_argument("--wait-mode", default="commit", choices=["commit", "notification"],
               help="commit: check_host_updates() until it raises; notification: rank 0 waits for the driver's "
                    "message in state._host_messages, as Horovod's own elastic scenario script does")
p.add_argument("--epoch-wait", type=float, default=0.0)
p.add_argument("--batch-wait", type=float, default=0.0)
p.add_argument("--compression", default="none", help="a hora.core.compression spec: none, fp16+ef, powersgd:1")
p.add_argument("--stop-file", help="the job ends after the epoch in which this file appears")
p.add_argument("--kill-stamp", help="the failing rank writes the time it fails here; survivors append how long "
                                    "their blocked collective took to raise")
p.add_argument("--samples", type=int, default=0, help="put an ElasticSampler over this many samples in the state")
p.add_argument("--batch-size", type=int, default=4, help="samples per rank and batch, for the sampler")
p.add_argument("--sampler-log")
args = p.parse_args()

hvd.init()
torch.manual_seed(1234)
data = torch.randn(32, 4)
target = torch.randint(0, 2, (32,))
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
lr = 0.01
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                     named_parameters=model.named_parameters(),
                                     compression=parse_spec(args.compression))
start_rank = int(os.environ.get("HOROVOD_RANK", "0"))
hostname = os.environ.get("HOROVOD_HOSTNAME")
exit_schedule = {tuple(int(x) for x in k.split(",")): v for k, v in json.loads(args.exit_schedule).items()}
wait_after = {int(e) for e in args.wait_for_hosts.split(",") if e}


def maybe_fail(epoch, batch):
    if start_rank in exit_schedule.get((epoch, batch), ()):
        if args.kill_stamp:
            with open(args.kill_stamp, "w") as f:
                f.write(str(time.time()))
        if args.exit_mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"scheduled failure at epoch {epoch} batch {batch}, start rank {start_rank}")


sampler = hvd.elastic.ElasticSampler(range(args.samples), shuffle=True, seed=5) if args.samples else None


def log_sampler():
    if sampler is None or not args.sampler_log:
        return
    values = {"rank": hvd.rank(), "size": hvd.size(), "rendezvous": state.rendezvous, "epoch": sampler.epoch,
              "batch": state.batch, "processed_num": sampler.processed_num, "num_samples": sampler.num_samples,
              "total_size": sampler.total_size, "remaining": sampler.remaining_indices,
              "processed": sorted(sampler.processed_indices), "mine": list(sampler)}
    with open(args.sampler_log, "a") as f:
        f.write(json.dumps(values) + "\n")


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    log_sampler()
    while state.epoch < args.epochs:
        while state.batch < args.batches_per_epoch:
            maybe_fail(state.epoch, state.batch)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            try:
                optimizer.step()
            except hvd.HorovodInternalError:
                if args.kill_stamp and os.path.exists(args.kill_stamp):
                    with open(args.kill_stamp) as f:
                        waited = time.time() - float(f.read() or "nan")
                    with open(args.kill_stamp + ".survivors", "a") as f:
                        f.write(f"{waited}\n")
                raise
            state.batch += 1
            if sampler is not None:
                sampler.record_batch(state.batch - 1, args.batch_size)
            if args.batch_wait:
                time.sleep(args.batch_wait)
            if state.batch % args.batches_per_commit == 0:
                state.commit()
        if hvd.rank() == 0:
            with open(args.logfile, "a") as f:
                f.write(json.dumps({"epoch": state.epoch, "rank": hvd.rank(), "size": hvd.size(),
                                    "start_rank": start_rank, "hostname": hostname,
                                    "rendezvous": state.rendezvous}) + "\n")
            if args.epoch_file:
                with open(args.epoch_file + ".tmp", "w") as f:
                    f.write(str(state.epoch + 1))
                os.replace(args.epoch_file + ".tmp", args.epoch_file)
        if args.epoch_wait:
            time.sleep(args.epoch_wait)
        finished = state.epoch
        state.epoch += 1
        if args.stop_file and hvd.broadcast_object(os.path.exists(args.stop_file), root_rank=0):
            state.epoch = args.epochs
        state.batch = 0
        if sampler is not None:
            sampler.set_epoch(state.epoch)
        if args.wait_mode == "notification" and finished in wait_after and hvd.rank() == 0:
            state._last_updated_timestamp = 0  # any message counts, however the clocks compare
            deadline = time.monotonic() + 20
            while state._host_messages.empty():
                if time.monotonic() > deadline:
                    raise TimeoutError("no host-update message from the driver")
                time.sleep(0.1)
        state.commit()
        if finished in wait_after and state.epoch < args.epochs:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # until the driver has seen the new hosts
                time.sleep(0.2)
                state.check_host_updates()
            raise TimeoutError("the driver reported no host change")


def on_reset():
    for group in optimizer.param_groups:
        group["lr"] = lr * hvd.size()


extra = {"sampler": sampler} if sampler is not None else {}
state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0, rendezvous=0, **extra)
state.register_reset_callbacks([on_reset])
train(state)
if args.weights_file:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    with open(args.weights_file, "a") as f:
        f.write(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "digest": digest}) + "\n")
hvd.shutdown()
