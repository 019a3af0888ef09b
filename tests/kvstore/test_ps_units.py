"""Single-process pieces of the parameter server: placement, state files, configuration."""

from __future__ import annotations

import numpy as np
import pytest

from hora.config import PSConfig
from hora.errors import ConfigError
from hora.kvstore.ps import states
from hora.kvstore.ps.placement import Shard, place, server_of


def test_small_keys_live_whole_on_one_stable_server():
    assert place("7", 10, 3, 100) == [Shard(1, 0, 10)]
    s = server_of("fc1.weight", 4)
    assert all(server_of("fc1.weight", 4) == s for _ in range(3)) and 0 <= s < 4
    spread = {server_of(f"layer{i}.weight", 4) for i in range(40)}
    assert spread == {0, 1, 2, 3}


def test_big_keys_split_into_contiguous_even_ranges():
    shards = place("w", 1001, 3, 1000)
    assert shards == [Shard(0, 0, 333), Shard(1, 333, 667), Shard(2, 667, 1001)]
    assert place("w", 1001, 1, 1000) == [Shard(0, 0, 1001)]
    assert place("w", 999, 3, 1000) == [Shard(server_of("w", 3), 0, 999)]
    assert place("w", 2, 3, 1) == [Shard(1, 0, 1), Shard(2, 1, 2)]  # no empty shards


def test_states_split_and_join_round_trip(tmp_path):
    shape = (10, 3)
    shards = place("w", 30, 2, 10)
    full = {"mom": np.arange(30, dtype=np.float32).reshape(shape), "num_update": np.array(4, np.int64)}
    parts = states.split(shape, shards, full)
    assert parts[0]["mom"].shape == (15,) and parts[1]["num_update"].shape == ()
    joined = states.join(shape, shards, parts)
    np.testing.assert_array_equal(joined["mom"], full["mom"])
    assert joined["num_update"] == 4
    states.write(str(tmp_path / "s.bin"), {"w": joined}, {"type": "sgd"})
    keys, spec = states.read(str(tmp_path / "s.bin"))
    assert spec == {"type": "sgd"}
    np.testing.assert_array_equal(keys["w"]["mom"], full["mom"])


def test_states_file_errors_are_clear(tmp_path):
    (tmp_path / "junk").write_bytes(b"\x00\x01")
    with pytest.raises(ConfigError, match="not a hora"):
        states.read(str(tmp_path / "junk"))
    with pytest.raises(ConfigError, match="cannot read"):
        states.read(str(tmp_path / "missing"))


def test_config_reads_dmlc_and_hora_names():
    env = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
           "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "4", "DMLC_INTERFACE": "eth1",
           "MXNET_KVSTORE_BIGARRAY_BOUND": "500", "HORA_PS_TIMEOUT": "8", "HORA_SECRET": "s"}
    cfg = PSConfig.from_env(env)
    assert (cfg.role, cfg.root_uri, cfg.root_port, cfg.num_servers, cfg.num_workers) == ("server", "10.0.0.1", 9000,
                                                                                        2, 4)
    assert (cfg.interface, cfg.bigarray_bound, cfg.timeout_s, cfg.heartbeat_s, cfg.secret) == ("eth1", 500, 8.0,
                                                                                               1.0, "s")
    assert PSConfig.from_env({**env, "HORA_PS_NUM_WORKER": "3", "HORA_PS_BIGARRAY_BOUND": "7"}).num_workers == 3
    assert PSConfig.from_env({"HORA_SIZE": "5"}).num_workers == 5


@pytest.mark.parametrize("env,match", [
    ({"DMLC_ROLE": "boss"}, "DMLC_ROLE"),
    ({"DMLC_PS_ROOT_PORT": "70000"}, "TCP port"),
    ({"DMLC_NUM_WORKER": "0"}, ">= 1"),
    ({"HORA_PS_TIMEOUT": "1", "HORA_PS_HEARTBEAT_INTERVAL": "1"}, "at most half"),
    ({"HORA_PS_BIGARRAY_BOUND": "x"}, "not an integer"),
])
def test_config_rejects_bad_values(env, match):
    with pytest.raises(ConfigError, match=match):
        PSConfig.from_env(env)


def test_missing_job_settings_name_the_variables():
    with pytest.raises(ConfigError, match="DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER, DMLC_NUM_WORKER"):
        PSConfig.from_env({}).require_job()


def test_node_refuses_the_worker_role():
    from hora.kvstore.ps.node import run_role

    with pytest.raises(ConfigError, match="training script"):
        run_role(PSConfig.from_env({"DMLC_ROLE": "worker"}))


def test_create_without_a_job_is_a_clear_error(monkeypatch):
    import hora.kvstore as kvs

    for name in ("DMLC_PS_ROOT_PORT", "HORA_PS_ROOT_PORT", "DMLC_NUM_SERVER", "DMLC_ROLE", "HORA_PS_ROLE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="hora run -np W -s S"):
        kvs.create("dist_sync")


def test_parts_cover_a_shard_in_bounded_messages():
    from hora.kvstore.ps.placement import PART_BYTES, parts

    step = PART_BYTES // 4
    assert parts(0, 4) == [(0, 0)]
    assert parts(10, 4) == [(0, 10)]
    assert parts(2 * step + 1, 4) == [(0, step), (step, step), (2 * step, 1)]
    assert parts(7, 8, part_bytes=16) == [(0, 2), (2, 2), (4, 2), (6, 1)]
