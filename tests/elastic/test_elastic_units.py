"""Unit tests of elastic training: State commit/restore/sync, ElasticSampler, the driver's hosts and rounds."""

from __future__ import annotations

import socket
import threading

import pytest

from hora import elastic_wire
from hora.core.elastic import ObjectState, run_fn
from hora.errors import AuthError, HostsUpdatedInterrupt, InternalError
from hora.runner.elastic.discovery import parse_discovery_output
from hora.runner.elastic.driver import Worker, assign
from hora.runner.elastic.hosts import HostManager

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _state(**kwargs):
    rank0_values = {}

    def bcast(obj, root_rank=0):
        return rank0_values.get("state", obj)

    state = ObjectState(bcast_object=bcast, get_rank=lambda: 0, **kwargs)
    return state, rank0_values


# ------------------------------------------------------------------ State


@pytest.fixture
def elastic_env(monkeypatch):
    from hora import envvars

    monkeypatch.setenv(envvars.HORA_ELASTIC_DRIVER_ADDR, "127.0.0.1")
    monkeypatch.setenv(envvars.HORA_ELASTIC_DRIVER_PORT, "1")
    monkeypatch.setenv(envvars.HORA_ELASTIC_WORKER_ID, "h-0")


def test_host_messages_raise_at_commit_only_when_newer_than_the_last(elastic_env):
    from hora.core.elastic import HostUpdateResult

    state, _ = _state(epoch=0)
    state.commit()  # no message: nothing to do
    state.on_hosts_updated(10.0, HostUpdateResult.added)
    state.on_hosts_updated(12.0, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    assert state._host_messages.empty() and state._last_updated_timestamp == 12.0
    state.on_hosts_updated(11.0, HostUpdateResult.added)  # older than what was acted on: ignored
    state.commit()
    # Horovod's scenario script: forget the last timestamp, so that any message counts again
    state._last_updated_timestamp = 0
    state.on_hosts_updated(11.0, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    state.on_hosts_updated(20.0, HostUpdateResult.added)
    state.on_reset()  # a reset drops the old round's messages
    assert state._host_messages.empty()
    state.commit()


def test_every_rank_follows_rank_zero_s_host_messages(elastic_env):
    from hora.core.elastic import HostUpdateResult

    state, rank0 = _state(epoch=0)
    rank0["state"] = (0, 5.0, int(HostUpdateResult.added))  # what rank 0 broadcasts: it saw a message
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()  # this rank's own queue is empty
    assert state._last_updated_timestamp == 5.0


def test_commit_then_restore_goes_back_to_the_commit():
    state, _ = _state(epoch=0, batch=0, history=[])
    state.epoch, state.batch = 2, 7
    state.history.append("a")
    state.commit()
    state.epoch, state.batch = 3, 1
    state.history.append("b")
    state.restore()
    assert (state.epoch, state.batch, state.history) == (2, 7, ["a"])


def test_restore_without_commit_returns_the_initial_values():
    state, _ = _state(epoch=5)
    state.epoch = 9
    state.restore()
    assert state.epoch == 5


def test_saved_state_is_a_copy_not_an_alias():
    state, _ = _state(weights=[1, 2])
    state.commit()
    state.weights[0] = 99  # mutate in place after the commit
    state.restore()
    assert state.weights == [1, 2]


def test_sync_takes_rank0s_committed_values():
    state, rank0 = _state(epoch=0, batch=0)
    rank0["state"] = {"epoch": 4, "batch": 3}
    state.sync()
    assert (state.epoch, state.batch) == (4, 3)


def test_reset_callbacks_run_after_every_reset_in_order():
    state, _ = _state(epoch=0)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(1), lambda: calls.append(2)])
    state.on_reset()
    state.on_reset()
    assert calls == [1, 2, 1, 2]


def test_check_host_updates_is_silent_outside_elastic_jobs(monkeypatch):
    monkeypatch.delenv("HORA_ELASTIC_DRIVER_ADDR", raising=False)
    state, _ = _state(epoch=0)
    state.check_host_updates()  # no driver, no collective, no exception


def test_run_restores_on_internal_error_and_keeps_state_on_hosts_updated():
    state, _ = _state(epoch=0)
    resets = []
    seen = []

    def train(s):
        seen.append(s.epoch)
        if len(seen) == 1:
            s.epoch = 1
            s.commit()
            s.epoch = 2  # not committed: lost with the peer
            raise InternalError("peer lost")
        if len(seen) == 2:
            s.epoch = 3
            s.commit()
            raise HostsUpdatedInterrupt()
        return s.epoch

    result = run_fn(train, lambda: resets.append(1))(state)
    assert seen == [0, 1, 3]  # restored to the commit, then kept across the interrupt
    assert result == 3 and len(resets) == 2


def test_run_lets_other_errors_through():
    state, _ = _state(epoch=0)

    def train(s):
        raise KeyError("user bug")

    with pytest.raises(KeyError):
        run_fn(train, lambda: None)(state)


# ------------------------------------------------------------- sampler

torch = pytest.importorskip("torch")


def test_sampler_partitions_an_epoch_over_ranks():
    from hora.torch.elastic import ElasticSampler

    sampler = ElasticSampler(list(range(10)), shuffle=False)
    assert list(sampler) == list(range(10)) and len(sampler) == 10
    assert (sampler.processed_num, sampler.num_samples, sampler.total_size) == (0, 10, 10)
    assert sampler.remaining_indices == list(range(10)) and sampler.processed_indices == set()


def test_sampler_counts_the_ring_s_batches_and_resumes_after_them():
    """processed_num counts every rank's batch; the epoch's order resumes after it, at any ring size."""
    import random

    from hora.torch.elastic import ElasticSampler

    sampler = ElasticSampler(list(range(12)), shuffle=True, seed=3)
    sampler.set_epoch(2)
    order = list(range(12))
    random.Random(3 + 2).shuffle(order)  # the epoch's order is a seeded shuffle of every index
    assert sampler.remaining_indices == order and list(sampler) == order
    sampler.num_replicas = 2  # as in a ring of 2: each record_batch covers a batch on both ranks
    sampler.record_batch(0, 2)
    sampler.record_batch(1, 2)
    assert sampler.processed_num == 8
    assert sampler.processed_indices == set(order[:8])
    state = sampler.state_dict()
    assert state == {"epoch": 2, "processed_num": 8}

    # a new ring of 3 ranks: rank r takes every 3rd of the 4 remaining samples, padded to 6
    parts = []
    for rank in range(3):
        s = ElasticSampler(list(range(12)), shuffle=True, seed=3)
        s.load_state_dict(state)
        assert (s.epoch, s.processed_num, s.remaining_indices) == (2, 8, order[8:])
        s.num_replicas, s.rank = 3, rank
        s.num_samples, s.total_size = 2, 6  # what reset() computes in a ring of 3
        parts.append(list(s))
    assert parts == [[order[8], order[11]], [order[9], order[8]], [order[10], order[9]]]


def test_sampler_new_epoch_forgets_progress_and_reshuffles():
    from hora.torch.elastic import ElasticSampler

    sampler = ElasticSampler(list(range(5)), shuffle=False)
    sampler.record_batch(0, 2)
    sampler.reset()
    assert (sampler.remaining_indices, sampler.num_samples, sampler.total_size) == ([2, 3, 4], 3, 3)
    sampler.set_epoch(1)
    assert (sampler.processed_num, sampler.epoch, sampler.remaining_indices) == (0, 1, [0, 1, 2, 3, 4])


def test_sampler_shuffle_is_the_same_on_every_rank_and_changes_by_epoch():
    from hora.torch.elastic import ElasticSampler

    a, b = ElasticSampler(range(50), seed=7), ElasticSampler(range(50), seed=7)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == sorted(first)


def test_torch_state_commits_restores_model_and_optimizer():
    from hora.torch.elastic import TorchState

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    state = TorchState(model, opt, epoch=1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state.epoch = 2
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state.epoch = 3
    state.restore()
    assert state.epoch == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, committed[k])
    assert opt.state_dict()["state"]  # momentum buffers came back with the commit


# ------------------------------------------------------------- driver


def test_blacklist_is_permanent_without_a_cooldown_range():
    clock = FakeClock()
    hosts = HostManager(clock=clock)
    hosts.update({"a": 2, "b": 2})
    hosts.blacklist("a")
    clock.now += 1e6
    assert hosts.available() == {"b": 2}
    assert not hosts.all_blacklisted_for_good()
    hosts.blacklist("b")
    assert hosts.available() == {} and hosts.all_blacklisted_for_good()


def test_cooldown_doubles_per_failure_up_to_the_maximum():
    """horovodrun's schedule: MIN * 2**failures plus a fraction of MIN, between MIN and MAX."""
    clock = FakeClock()
    hosts = HostManager(cooldown_range=(1.0, 10.0), clock=clock, jitter=lambda: 0.5)
    hosts.update({"a": 1, "b": 1})
    assert [hosts.blacklist("a") for _ in range(4)] == [2.5, 4.5, 8.5, 10.0]
    hosts.records["a"].failures = 0
    assert hosts.blacklist("a") == 2.5
    assert hosts.available() == {"b": 1}
    assert hosts.next_return() == pytest.approx(2.5)
    clock.now += 2.4
    assert "a" not in hosts.available()
    clock.now += 0.2
    assert hosts.available() == {"a": 1, "b": 1}  # back, in first-seen order
    assert HostManager(cooldown_range=(1.0, 2.0), jitter=lambda: 0.0).blacklist("a") == 2.0  # capped at MAX
    assert HostManager(cooldown_range=(3.0, 3.0), jitter=lambda: 0.0).blacklist("a") == 3.0


def test_hosts_keep_first_seen_order_and_report_changes():
    hosts = HostManager()
    assert hosts.update({"b": 1, "a": 2})
    assert not hosts.update({"a": 2, "b": 1})
    assert hosts.update({"a": 2, "c": 1, "b": 1})
    assert list(hosts.available()) == ["b", "a", "c"]


def test_discovery_output_parsing():
    assert parse_discovery_output("a:2\n\n# c\nb\n", None) == {"a": 2, "b": 1}
    assert parse_discovery_output("a\nb:3\n", 4) == {"a": 4, "b": 3}
    from hora.errors import ConfigError

    with pytest.raises(ConfigError, match="slot count"):
        parse_discovery_output("a:0\n", None)
    with pytest.raises(ConfigError, match="malformed"):
        parse_discovery_output("a b:1\n", None)


def test_assign_orders_ranks_by_start_and_numbers_hosts():
    members = [Worker(2, "x"), Worker(3, "x"), Worker(5, "y"), Worker(7, "x")]
    stores = {2: ("10.0.0.1", 5000), 3: ("10.0.0.1", 5001), 5: ("10.0.0.2", 6000), 7: ("10.0.0.1", 5002)}
    placement = assign(members, stores, 4)
    assert [placement[s]["rank"] for s in (2, 3, 5, 7)] == [0, 1, 2, 3]
    assert [placement[s]["local_rank"] for s in (2, 3, 5, 7)] == [0, 1, 0, 2]
    assert placement[5]["cross_rank"] == 1 and placement[5]["local_size"] == 1 and placement[7]["local_size"] == 3
    assert all(p["store_addr"] == "10.0.0.1" and p["store_port"] == 5000 and p["round"] == 4
               for p in placement.values())


# ------------------------------------------------------------- wire


def _pair(secret_a: str, secret_b: str):
    server, client = socket.socketpair()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("s", elastic_wire.Channel(server, secret_a, server=True)))
    t.start()
    c = elastic_wire.Channel(client, secret_b, server=False)
    t.join()
    return out["s"], c


def test_wire_round_trip_and_wrong_secret_is_refused():
    s, c = _pair("k", "k")
    c.send({"op": "poll", "round": 3})
    assert s.recv() == {"op": "poll", "round": 3}
    s.send({"updated": True})
    assert c.recv() == {"updated": True}
    s, c = _pair("k", "other")
    c.send({"op": "join"})
    with pytest.raises(AuthError):
        s.recv()


def test_wire_refuses_a_replayed_frame():
    s, c = _pair("k", "k")
    captured = []

    class Recording:
        def __init__(self, sock):
            self.sock = sock

        def sendall(self, data):
            captured.append(data)
            self.sock.sendall(data)

    raw = c.sock
    c.sock = Recording(raw)
    c.send({"op": "poll", "round": 1})
    assert s.recv()["round"] == 1
    raw.sendall(captured[0])  # the same bytes again: sequence number 0 is spent
    with pytest.raises(AuthError):
        s.recv()


# ------------------------------------------------------------- the driver's socket


@pytest.fixture
def driver():
    from hora.runner.elastic.driver import ElasticDriver, ElasticSettings

    class NoSpawner:
        import queue

        exits = queue.Queue()

    d = ElasticDriver(ElasticSettings(num_proc=1, min_np=1), HostManager(), discovery=None, spawner=NoSpawner(),
                      secret="job-secret", sink=None, interrupt=None)
    yield d
    d.close()


def _worker_config(driver):
    from hora.config import ElasticConfig

    return ElasticConfig(driver_addr="127.0.0.1", driver_port=driver.port, worker_id="h-0", secret="job-secret")


def test_driver_answers_events_requests_as_the_round_s_events_happen(driver, monkeypatch):
    import time

    from hora.core.elastic import worker
    from hora.runner.elastic import driver as driver_module

    monkeypatch.setattr(driver_module, "EVENTS_WAIT_SECONDS", 0.5)
    config = _worker_config(driver)
    t0 = time.monotonic()
    assert worker.host_events(config, 0, -1, timeout=5) == []  # nothing happened: answered empty at the driver's limit
    assert 0.4 < time.monotonic() - t0 < 4
    monkeypatch.setattr(driver_module, "EVENTS_WAIT_SECONDS", 20.0)
    timer = threading.Timer(0.3, driver._note, args=(elastic_wire.HOSTS_ADDED,))
    timer.start()
    t0 = time.monotonic()
    events = worker.host_events(config, 0, -1, timeout=30)  # waits for the event, answered as it happens
    assert time.monotonic() - t0 < 5
    assert [(seq, update) for seq, _, update in events] == [(0, elastic_wire.HOSTS_ADDED)]
    driver._note(elastic_wire.HOSTS_REMOVED)
    later = worker.host_events(config, 0, 0, timeout=5)  # only what came after the event already seen
    assert [(seq, update) for seq, _, update in later] == [(1, elastic_wire.HOSTS_REMOVED)]
    assert later[0][1] > events[0][1]  # timestamps increase
    monkeypatch.setattr(driver_module, "EVENTS_WAIT_SECONDS", 0.2)
    assert worker.host_events(config, 5, -1, timeout=5) == []  # another round's events are not this round's


def test_driver_drops_a_join_with_the_wrong_secret(driver):
    channel = elastic_wire.connect("127.0.0.1", driver.port, "not-the-secret", timeout=10)
    channel.send({"op": "join", "worker": "h-0", "after": 0, "addr": "127.0.0.1", "port": 1})
    channel.sock.settimeout(10)
    assert channel.sock.recv(1) == b""  # closed without an answer
    assert driver._requests.empty()


def test_driver_bounds_connections_that_never_authenticate(driver):
    from hora.runner.elastic.driver import MAX_UNAUTHENTICATED

    idle = [socket.create_connection(("127.0.0.1", driver.port)) for _ in range(MAX_UNAUTHENTICATED)]
    for s in idle:
        assert len(s.recv(16)) == 16  # each got its nonce and holds a slot
    extra = socket.create_connection(("127.0.0.1", driver.port))
    extra.settimeout(10)
    assert extra.recv(16) == b""  # no slot left: closed at once, no thread started
    for s in idle:
        s.close()
    extra.close()


def test_a_retired_worker_leaves_with_status_0():
    from hora.core.elastic.worker import WorkerRetired

    state, _ = _state(epoch=0)

    def train(s):
        raise HostsUpdatedInterrupt()

    def reset():
        raise WorkerRetired("its host left the job")

    with pytest.raises(SystemExit) as info:
        run_fn(train, reset)(state)
    assert info.value.code == 0 and "host left" in str(info.value)


def test_workers_of_one_host_failing_together_count_as_one_failure(driver):
    driver.hosts.cooldown_range = (1.0, 8.0)
    driver.hosts.update({"a": 2, "b": 1})
    for seq, host in ((0, "a"), (1, "a"), (2, "b")):
        driver.workers[seq] = Worker(seq, host)
    driver.sink = type("Sink", (), {"tail": staticmethod(lambda key: [])})()
    driver.spawner.exits.put((0, -9))
    driver.spawner.exits.put((1, 255))
    driver._reap()
    assert driver.hosts.records["a"].failures == 1  # one event: the host went down
    assert [f.rank for f in driver.failures] == [0, 1] and "b" not in driver.hosts.records
