"""Driver of the multi-node Ray tests, run on emulated host h1: one JSON line per result on stdout.

    python ray_multinode_job.py static  HEAD_ADDRESS   placement of 3 hosts x 2 workers, then training that
                                                       must fail cleanly when the test kills a node
    python ray_multinode_job.py elastic HEAD_ADDRESS   elastic training that must go on when a node is killed

Rank 0 prints ``TRAINING`` (forwarded by Ray) once training runs, which is when the test kills a node.
"""

from __future__ import annotations

import json
import sys
import time

import ray

from hora.ray import RayExecutor


def placement() -> dict:
    import os

    import torch

    import hora.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(1), name="placement")
    return {"rank": hvd.rank(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "host": os.environ["HORA_HOSTNAME"],
            "ray_node_ip": ray.util.get_node_ip_address()}


def static_train(seconds: float) -> int:
    import torch

    import hora.torch as hvd

    hvd.init()
    start, step = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        hvd.allreduce(torch.ones(1000), name=f"grad.{step}")
        step += 1
        if step == 5 and hvd.rank() == 0:
            print("TRAINING", flush=True)
        time.sleep(0.05)
    return step


def elastic_train(steps: int) -> tuple[int, int, int]:
    import torch

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            optimizer.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            optimizer.step()
            state.step += 1
            if state.step == 5 and hvd.rank() == 0:
                print("TRAINING", flush=True)
            if state.step % 5 == 0:
                state.commit()
            time.sleep(0.1)
        return hvd.rank(), hvd.size(), state.step

    return train(state)


def main() -> int:
    mode, address = sys.argv[1], sys.argv[2]
    import logging

    logging.basicConfig(level=logging.INFO, format="driver %(name)s: %(message)s")  # the elastic driver's story
    ray.init(address=address)
    deadline = time.monotonic() + 300  # on a loaded machine a node may take minutes to join
    while sum(node["Alive"] for node in ray.nodes()) < 3:
        if time.monotonic() > deadline:
            print(json.dumps({"error": "nodes", "message": f"only {ray.nodes()} joined"}), flush=True)
            return 1
        time.sleep(1)
    if mode == "static":
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=3, num_workers_per_host=2)
        executor.start()
        print(json.dumps({"placement": executor.run(placement)}), flush=True)
        start = time.monotonic()
        try:
            executor.run(static_train, args=[600])
            outcome = {"error": None}
        except Exception as e:
            outcome = {"error": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None),
                       "node": getattr(e, "node", None)}
        outcome["seconds"] = time.monotonic() - start
        from ray._private import state

        deadline = time.monotonic() + 60  # the lost node's actors are dead once Ray declares the node dead
        while True:
            outcome["actors_left"] = sum(a["State"] != "DEAD" for a in state.actors().values())
            if outcome["actors_left"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        print(json.dumps(outcome), flush=True)
    else:
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=2, max_workers=6,
                               elastic_timeout=120, reset_limit=5)
        executor.start()
        start = time.monotonic()
        results = executor.run(elastic_train, args=[150])
        print(json.dumps({"results": results, "seconds": time.monotonic() - start}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
