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
    sampler.num_replicas, sampler.rank = 1, 0
    assert list(sampler) == list(range(10)) and len(sampler) == 10


def test_sampler_repartitions_only_what_was_not_processed():
    from hora.torch.elastic import ElasticSampler

    sampler = ElasticSampler(list(range(12)), shuffle=True, seed=3)
    sampler.set_epoch(2)
    order = list(sampler)
    sampler.record_batch(0, 4)  # the first 4 of this rank's order
    sampler.record_batch(2, 2)  # indices 4:6 of the order
    done = set(order[:6])
    assert sampler.processed_indices == done
    state = sampler.state_dict()
    assert state == {"epoch": 2, "processed_indices": sorted(done)}

    # a new ring of 3 ranks: together they see exactly the 6 remaining samples, padded to 6
    parts = []
    for rank in range(3):
        s = ElasticSampler(list(range(12)), shuffle=True, seed=3)
        s.load_state_dict(state)
        s.num_replicas, s.rank = 3, rank
        s.remaining_indices = [i for i in range(12) if i not in s.processed_indices]
        s.num_samples = 2
        s.total_size = 6
        parts.append(list(s))
    seen = [i for part in parts for i in part]
    assert sorted(seen) == sorted(set(range(12)) - done)
    assert all(len(part) == 2 for part in parts)


def test_sampler_pads_uneven_remainders_and_new_epoch_forgets_progress():
    from hora.torch.elastic import ElasticSampler

    sampler = ElasticSampler(list(range(5)), shuffle=False)
    sampler.record_indices([0, 1])
    sampler.num_replicas, sampler.rank = 2, 1
    sampler.remaining_indices = [2, 3, 4]
    sampler.num_samples, sampler.total_size = 2, 4
    assert list(sampler) == [3, 2]  # [2, 3, 4, 2][1::2]: padded with the first remaining index
    sampler.set_epoch(1)
    assert sampler.processed_indices == set() and sampler.epoch == 1


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
    clock = FakeClock()
    hosts = HostManager(cooldown_range=(1.0, 5.0), clock=clock)
    hosts.update({"a": 1, "b": 1})
    assert [hosts.blacklist("a") for _ in range(4)] == [1.0, 2.0, 4.0, 5.0]
    hosts.records["a"].failures = 1
    assert hosts.blacklist("a") == 2.0
    assert hosts.available() == {"b": 1}
    assert hosts.next_return() == pytest.approx(2.0)
    clock.now += 1.9
    assert "a" not in hosts.available()
    clock.now += 0.2
    assert hosts.available() == {"a": 1, "b": 1}  # back, in first-seen order


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


def test_driver_answers_an_authenticated_poll(driver):
    channel = elastic_wire.connect("127.0.0.1", driver.port, "job-secret", timeout=10)
    channel.send({"op": "poll", "worker": "h-0", "round": 0})
    assert channel.recv() == {"updated": False}
    channel.close()


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
