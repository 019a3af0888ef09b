"""Worker scripts of the parameter-server tests: ``python ps_workers.py SCENARIO ARGS``.

Each scenario is a real training-style worker: it creates a dist store, which
joins the job that :mod:`ps_cluster` started by hand, checks what it pulls
against values it computes itself, and prints ``CHECKED <n>`` (the number of
comparisons that passed) or ``RAISED <class>: <message>`` lines for the test
to assert on.  A failed comparison raises, so the process exits non-zero.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import hora.kvstore as kvs
from hora.errors import HoraError


def _keys(kind: str) -> list:
    return [3, 7, 11] if kind == "int" else ["weight", "bias", "big"]


def _shape(i: int) -> tuple[int, ...]:
    return [(3, 4), (50,), (2501,)][i]


def _grad(i: int, rank: int, it: int, dtype: str) -> np.ndarray:
    n = int(np.prod(_shape(i)))
    return ((np.arange(n) % 7) + 10 * rank + it + i).astype(dtype).reshape(_shape(i))


def sums(kv_type: str, dtype: str, kind: str, iters: str) -> None:
    """dist_sync without an optimizer: every pull returns the exact sum of the round's pushes."""
    kv = kvs.create(kv_type)
    rank, workers = kv.rank, kv.num_workers
    keys = _keys(kind)
    kv.init(keys, [np.full(_shape(i), -1, dtype=dtype) for i in range(3)])
    checked = 0
    for it in range(int(iters)):
        for i, key in enumerate(keys):
            g = _grad(i, rank, it, dtype)
            if i == 1:  # one value per "device", summed by the worker first
                kv.push(key, [g - 1, np.ones_like(g)])
            elif i == 2 and it % 2:
                kv.pushpull(key, g.copy(), out=np.empty_like(g))  # the pull is checked below
            else:
                kv.push(key, g)
        outs = [np.empty(_shape(i), dtype=dtype) for i in range(3)]
        kv.pull(keys, out=outs)
        for i, out in enumerate(outs):
            want = sum(_grad(i, r, it, dtype) for r in range(workers))
            np.testing.assert_array_equal(out, want, err_msg=f"key {keys[i]} iteration {it}")
            assert out.dtype == np.dtype(dtype)
            checked += 1
    # a strided numpy view is filled in place too
    strided = np.zeros((2501, 2), dtype=dtype)[:, 0]
    kv.pull(keys[2], out=strided)
    np.testing.assert_array_equal(strided, sum(_grad(2, r, int(iters) - 1, dtype) for r in range(workers)))
    kv.barrier()
    kv.close()
    print("CHECKED", checked + 1, flush=True)


def tickets() -> None:
    """pushpull_async: the ticket's on_ready fires, finish gives the round's sum; misuse raises clearly."""
    import threading

    from hora.errors import ConfigError, PSError
    kv = kvs.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    kv.init("w", np.zeros(50, np.float32))
    checked = 0
    for it in range(3):
        ready = threading.Event()
        ticket = kv.pushpull_async("w", np.full(50, rank + it, np.float32))
        ticket.on_ready(ready.set)
        assert ready.wait(30), "on_ready was not called within 30 s"
        out = np.empty(50, np.float32)
        ticket.finish([out])
        np.testing.assert_array_equal(out, sum(r + it for r in range(workers)))
        checked += 1
        try:
            ticket.finish([out])
        except PSError as e:
            print(f"RAISED {type(e).__name__}: {e}", flush=True)
    ticket = kv.pushpull_async("w", np.zeros(50, np.float32))
    try:
        ticket.finish([np.empty(50, np.float32), np.empty(50, np.float32)])  # one key, two outs
    except ConfigError as e:
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
    ticket.cancel()  # after a failed finish: nothing left to do
    kv.barrier()
    kv.close()
    print("CHECKED", checked, flush=True)


def async_once(iters: str) -> None:
    """dist_async through SGD(lr=1): the value ends at -(every push), each applied exactly once."""
    from hora.kvstore.optimizer import SGD

    kv = kvs.create("dist_async")
    rank, workers = kv.rank, kv.num_workers
    kv.set_optimizer(SGD(learning_rate=1.0))
    keys = ["small", "big"]
    shapes = [(10,), (2501,)]
    kv.init(keys, [np.zeros(s, np.float64) for s in shapes])
    checked = 0
    for it in range(int(iters)):
        for key, shape in zip(keys, shapes, strict=True):
            kv.push(key, np.full(shape, rank + 1.0))
        out = np.empty(shapes[0])
        kv.pull(keys[0], out=out)  # my own pushes so far are in
        assert out.max() <= -(it + 1) * (rank + 1.0), (it, out)
        checked += 1
    kv.barrier()
    total = -int(iters) * sum(r + 1.0 for r in range(workers))
    for key, shape in zip(keys, shapes, strict=True):
        out = np.empty(shape)
        kv.pull(key, out=out)
        np.testing.assert_array_equal(out, np.full(shape, total), err_msg=key)
        checked += 1
    kv.close()
    print("CHECKED", checked, flush=True)


def optimizer(name: str, iters: str, states_file: str) -> None:
    """A server optimizer equals the same optimizer run locally on the summed gradients."""
    from hora.kvstore.lr_scheduler import FactorScheduler
    from hora.kvstore.optimizer import SGD, Adam, create, create_updater

    if name == "sgd":
        opt = SGD(learning_rate=0.1, momentum=0.9, wd=1e-3, rescale_grad=0.5)
    elif name == "adam":
        opt = Adam(learning_rate=0.01, wd=1e-4, lr_scheduler=FactorScheduler(step=2, factor=0.5, base_lr=0.01))
    elif name == "lbsgd":  # integer counters and an accumulated gradient in its per-key state
        opt = create("lbsgd", learning_rate=0.1, momentum=0.9, batch_scale=2, warmup_epochs=1, updates_per_epoch=3)
    else:
        opt = create(name, learning_rate=0.01, wd=1e-4)
    kv = kvs.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    keys = ["a", "b", "big"]
    shapes = [(4, 5), (7,), (3001,)]
    init = [np.random.default_rng(i).standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)]
    kv.init(keys, init)
    kv.set_optimizer(opt)
    local = create_updater(opt.spec())
    weights = [w.copy() for w in init]

    def grads(r: int, it: int) -> list[np.ndarray]:
        rng = np.random.default_rng(1000 * r + it)
        return [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def step(it: int) -> None:
        kv.push(keys, grads(rank, it))
        for i, key in enumerate(keys):
            total = grads(0, it)[i]
            for r in range(1, workers):
                total = total + grads(r, it)[i]
            local(key, total, weights[i])
        outs = [np.empty(s, np.float32) for s in shapes]
        kv.pull(keys, out=outs)
        for i, out in enumerate(outs):
            np.testing.assert_allclose(out, weights[i], rtol=1e-5, atol=1e-6, err_msg=f"{keys[i]} step {it}")

    n = int(iters)
    for it in range(n):
        step(it)
    kv.barrier()
    if rank == 0:
        kv.save_optimizer_states(states_file, dump_optimizer=True)
        from hora.kvstore.ps import states

        saved, spec = states.read(states_file)
        assert spec == opt.spec(), spec
        for key in keys:
            want = local.key_states(key)
            assert set(saved[key]) == set(want), (saved[key].keys(), want.keys())
            for state, value in want.items():
                np.testing.assert_allclose(saved[key][state], value.reshape(saved[key][state].shape), rtol=1e-5,
                                           atol=1e-6, err_msg=f"{key}/{state}")
    kv.barrier()
    # wipe the servers' states with a fresh optimizer, restore them from the file, and go on in step
    kv.set_optimizer(opt)
    kv.load_optimizer_states(states_file)
    kv.barrier()
    step(n)
    kv.close()
    print("CHECKED", n + 1, flush=True)


def compression(iters: str) -> None:
    """2-bit compression: each pull equals the sum of every worker's quantised gradient (error feedback on)."""
    from hora.kvstore.compression import create_compressor

    params = {"type": "2bit", "threshold": 0.5}
    kv = kvs.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    kv.set_gradient_compression(params)
    shapes = {"w": (37,), "big": (2501,), "count": (5,)}
    kv.init(list(shapes), [np.zeros(shapes["w"], np.float32), np.zeros(shapes["big"], np.float32),
                           np.zeros(shapes["count"], np.int64)])
    mirrors = [create_compressor(params) for _ in range(workers)]  # every worker's residuals, replayed here
    checked = 0
    for it in range(int(iters)):
        grads = {r: {k: np.random.default_rng(100 * r + it + len(k)).standard_normal(s).astype(np.float32) * 0.7
                     for k, s in shapes.items() if k != "count"} for r in range(workers)}
        kv.push(["w", "big", "count"], [grads[rank]["w"], grads[rank]["big"], np.full(5, rank + it, np.int64)])
        for key in ("w", "big"):
            want = np.zeros(shapes[key], np.float32)
            for r in range(workers):
                packed = mirrors[r].compress(key, grads[r][key])
                want += mirrors[r].decompress(packed, want.size)
            out = np.empty(shapes[key], np.float32)
            kv.pull(key, out=out)
            np.testing.assert_array_equal(out, want, err_msg=f"{key} iteration {it}")
            assert set(np.unique(out)) <= {np.float32(0.5 * k) for k in range(-workers, workers + 1)}
            checked += 1
        out = np.empty(5, np.int64)
        kv.pull("count", out=out)
        np.testing.assert_array_equal(out, np.full(5, sum(r + it for r in range(workers))))
        checked += 1
    kv.close()
    print("CHECKED", checked, flush=True)


def torch_values(kv_type: str) -> None:
    """Torch tensors in and out (CPU, or CUDA when present): summed per worker, then across workers."""
    import torch

    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    devices += ["cpu"] * (2 - len(devices))  # at least two "devices"; a GPU and the CPU mix too
    kv = kvs.create(kv_type)
    rank, workers = kv.rank, kv.num_workers
    kv.init(["w", "b"], [torch.zeros(6, 4), torch.zeros(3, dtype=torch.float64)])
    checked = 0
    for it in range(3):
        grads = [torch.full((6, 4), float(rank + it + d), device=dev) for d, dev in enumerate(devices)]
        kv.push("w", grads)  # one value per device
        kv.push("b", torch.arange(3, dtype=torch.float64) * (rank + 1))
        outs = [torch.empty(6, 4, device=dev) for dev in devices]
        kv.pull("w", out=outs)
        want = sum(float(r + it + d) for r in range(workers) for d in range(len(devices)))
        for out in outs:
            assert torch.equal(out.cpu(), torch.full((6, 4), want)), (out, want)
            checked += 1
        b = torch.empty(3, dtype=torch.float64)
        kv.pull("b", out=b)
        assert torch.equal(b, torch.arange(3, dtype=torch.float64) * sum(range(1, workers + 1)))
        checked += 1
    transposed = torch.zeros(4, 6).t()  # not contiguous
    kv.pull("w", out=transposed)
    assert torch.equal(transposed, outs[0].cpu())
    kv.close()
    print("CHECKED", checked + 1, flush=True)


def big_rounds(mib: str, keys: str, rounds: str) -> None:
    """dist_sync rounds on large keys (for the memory and speed checks): prints the time per push+pull."""
    kv = kvs.create("dist_sync")
    n = int(float(mib) * 2**20) // 4
    names = [f"k{i}" for i in range(int(keys))]
    kv.init(names, [np.zeros(n, np.float32) for _ in names])
    grads = [np.full(n, kv.rank + 1.0, np.float32) for _ in names]
    outs = [np.empty(n, np.float32) for _ in names]
    times = []
    for _ in range(int(rounds)):
        t0 = time.perf_counter()
        kv.push(names, grads)
        kv.pull(names, out=outs)
        times.append(time.perf_counter() - t0)
    want = sum(r + 1.0 for r in range(kv.num_workers))
    assert all(float(o[0]) == want and float(o[-1]) == want for o in outs)
    kv.close()
    print("TIMES", " ".join(f"{t * 1000:.1f}" for t in times), flush=True)
    print("CHECKED", len(names), flush=True)


def _expect_failure(kv, what: str) -> None:
    """Push and pull until the job fails; print what was raised and how long after the first try."""
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            kv.push("k", np.ones(4, np.float32))
            kv.pull("k", out=np.empty(4, np.float32))
            time.sleep(0.05)
        print("NO ERROR", flush=True)
    except HoraError as e:
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
        print(f"AFTER {time.monotonic() - t0:.2f}", flush=True)
    kv.close()


def dead_worker() -> None:
    """Rank 1 dies without a goodbye; rank 0's pull of the round it never joins must fail, not hang."""
    kv = kvs.create("dist_sync")
    kv.init("k", np.zeros(4, np.float32))
    if kv.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _expect_failure(kv, "worker 1")


def fault_loop() -> None:
    """Announce readiness, then push and pull until the test kills a node."""
    kv = kvs.create("dist_sync")
    kv.init("k", np.zeros(4, np.float32))
    kv.init("big", np.zeros(3000, np.float32))  # on every server
    kv.push("big", np.ones(3000, np.float32))
    kv.pull("big", out=np.empty(3000, np.float32))
    print("READY", flush=True)
    _expect_failure(kv, "a node")


def leave_early() -> None:
    """Rank 1 closes its store after init; rank 0's round can never complete and must fail clearly."""
    kv = kvs.create("dist_sync")
    kv.init("k", np.zeros(4, np.float32))
    if kv.rank == 1:
        kv.close()
        print("LEFT", flush=True)
        return
    time.sleep(0.5)
    kv.push("k", np.ones(4, np.float32))
    try:
        kv.pull("k", out=np.empty(4, np.float32))
        print("NO ERROR", flush=True)
    except HoraError as e:
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
    try:
        kv.barrier()
        print("NO ERROR", flush=True)
    except HoraError as e:
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
    kv.close()


def shm_hold() -> None:
    """Hold named shared-memory segments until the job fails: the server's value of a key nobody pulled
    yet, and a push buffer on every worker that is never sent (the test kills a role meanwhile)."""
    kv = kvs.create("dist_sync")
    n = 1 << 16
    kv.init("k", np.zeros(n, np.float32))
    client = kv._client
    assert client.shm_ok == [True] * kv.num_servers, client.shm_ok
    held = client.push_buffer(0, "held", n, np.float32)
    assert held is not None
    print("READY", flush=True)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 60:
            kv.barrier()
            time.sleep(0.05)
        print("NO ERROR", flush=True)
    except HoraError as e:
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
    kv.close()


def shm_status() -> None:
    """Print which servers share memory with this worker, then run one exact round on a big key."""
    kv = kvs.create("dist_sync")
    print("SHM", " ".join(str(int(ok)) for ok in kv._client.shm_ok), flush=True)
    n = 300_000
    kv.init("big", np.zeros(n, np.float32))
    kv.push("big", np.arange(n, dtype=np.float32) * (kv.rank + 1))
    out = np.empty(n, np.float32)
    kv.pull("big", out=out)
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) * sum(range(1, kv.num_workers + 1)))
    kv.close()
    print("CHECKED 1", flush=True)


def steady(stop_file: str, min_rounds: str, max_s: str) -> None:
    """Exact dist_sync rounds until ``stop_file`` exists (at least ``min_rounds``, at most ``max_s`` seconds):
    every pull is the exact sum of the round's pushes, and a key nobody pushes keeps its initial value.
    Rank 0 decides when to stop and the workers agree through a key, so all run the same rounds.  The
    attack tests run hostile peers meanwhile."""
    kv = kvs.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    sizes = {"small": 50, "big": 3000}
    kv.init(list(sizes), [np.zeros(n, np.float32) for n in sizes.values()])
    frozen = np.arange(700, dtype=np.float32) * 0.5
    kv.init("frozen", frozen)
    kv.init("stop", np.zeros(1, np.float32))
    print("READY", flush=True)
    checked, rounds, t0 = 0, 0, time.monotonic()
    while True:
        if time.monotonic() - t0 > float(max_s):
            raise AssertionError(f"{stop_file} did not appear within {max_s} s")
        stop = rank == 0 and rounds >= int(min_rounds) and os.path.exists(stop_file)
        kv.push("stop", np.full(1, float(stop), np.float32))
        flag = np.empty(1, np.float32)
        kv.pull("stop", out=flag)
        if flag[0] > 0:
            break
        for key, n in sizes.items():
            kv.push(key, np.arange(n, dtype=np.float32) + 100 * rank + rounds)
        for key, n in sizes.items():
            out = np.empty(n, np.float32)
            kv.pull(key, out=out)
            want = sum(np.arange(n, dtype=np.float32) + 100 * r + rounds for r in range(workers))
            np.testing.assert_array_equal(out, want, err_msg=f"key {key} round {rounds}")
            checked += 1
        out = np.empty(700, np.float32)
        kv.pull("frozen", out=out)
        np.testing.assert_array_equal(out, frozen, err_msg=f"key frozen round {rounds}")
        checked += 1
        rounds += 1
        time.sleep(0.01)
    kv.barrier()
    kv.close()
    print("ROUNDS", rounds, flush=True)
    print("CHECKED", checked, flush=True)


def join_only() -> None:
    """Try to join; print what creating the store raised."""
    t0 = time.monotonic()
    try:
        kv = kvs.create("dist_sync")
        print("JOINED", kv.rank, flush=True)
        kv.close()
    except HoraError as e:
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
    print(f"AFTER {time.monotonic() - t0:.2f}", flush=True)


if __name__ == "__main__":
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung worker's stacks, for debugging a test
    if sys.argv[1] == "fuzz":
        from ps_fuzz import fuzz

        fuzz(*sys.argv[2:])
    else:
        globals()[sys.argv[1]](*sys.argv[2:])
