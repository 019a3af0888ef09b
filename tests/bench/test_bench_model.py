"""The cost model: known values, monotonicity, and the shape of the seeds' tables."""

from __future__ import annotations

import math

import pytest

from hora.bench.model import (
    CostModel,
    bus_bandwidth,
    measure_loopback_latency,
    measure_loopback_rate,
    measure_reduce_rate,
)
from hora.errors import ConfigError

GB = 1e9


def model(link: str = "8gbit", latency: str = "0", **kw) -> CostModel:
    return CostModel.from_strings(link, latency, **kw)


def test_ring_known_values():
    m = model("8gbit")  # 1e9 bytes/s
    assert m.ring_allreduce(GB, 2).total == pytest.approx(1.0)  # 2 * 1/2 * 1 s
    assert m.ring_allreduce(GB, 4).total == pytest.approx(1.5)  # 2 * 3/4
    assert m.ring_allreduce(GB, 1).total == 0.0
    lat = model("8gbit", "1ms").ring_allreduce(GB, 4)
    assert lat.latency == pytest.approx(2 * 3 * 1e-3)
    assert lat.total == pytest.approx(1.5 + 6e-3)


def test_ring_cpu_term():
    m = model("8gbit", reduce_bytes_per_s=2 * GB, overhead_s=1e-3)
    est = m.ring_allreduce(GB, 4)
    assert est.cpu == pytest.approx(0.75 / 2 + 1e-3)  # (N-1)/N * S / R + overhead
    assert est.total == pytest.approx(1.5 + 0.375 + 1e-3)


def test_ps_known_values_mpi_proposal_case():
    """400 MB, 8 workers, 10GbE: 1 server moves 8x the payload through one link, twice."""
    m = model("10gbit")
    s = 400e6
    assert m.ps_push_pull(s, 8, 1).total == pytest.approx(2 * 8 * s / 1.25e9)  # 5.12 s
    assert m.ps_push_pull(s, 8, 2).total == pytest.approx(2.56)
    assert m.ps_push_pull(s, 8, 8).total == pytest.approx(0.64)
    assert m.ps_push_pull(s, 8, 16).total == pytest.approx(0.64)  # the workers' own links bind
    assert model("10gbit", "1ms").ps_push_pull(s, 8, 8).latency == pytest.approx(4e-3)


def test_seed_ordering_and_ratio_shape():
    """The seed measured 6.5 : 3.4 : 2.0 : 1.2 : 1.0 (PS with 1/2/4/8 servers : MPI allreduce)."""
    m = model("10gbit", "0.1ms")
    s, n = 400e6, 8
    ps = [m.ps_push_pull(s, n, k).total for k in (1, 2, 4, 8)]
    ring = m.ring_allreduce(s, n).total
    assert ps == sorted(ps, reverse=True) and ps[-1] > ring  # same ordering as the seed
    for a, b in zip(ps[:-1], ps[1:], strict=True):  # doubling the servers about halves the time while N/k >= 1
        assert a / b == pytest.approx(2.0, rel=0.01)
    assert ps[-1] / ring == pytest.approx(8 / 7, rel=0.01)  # 1.14, the seed's 1.2
    assert 5 < ps[0] / ring < 10  # the seed's 6.5; the model says 9.1 (no CPU or protocol costs)


def test_ring_flat_ps_linear_in_workers():
    m = model("1gbit")
    s = 64e6
    rings = [m.ring_allreduce(s, n).total for n in (2, 4, 8, 16, 64)]
    assert rings == sorted(rings)
    assert rings[-1] <= 2 * rings[0] and rings[-1] < 2 * s / m.bytes_per_s  # bounded by 2S/B
    # 2(N-1)/N: 1 at N=2, 1.75 at N=8 -- the bandwidth term is bounded, not constant; from N=4 on it is flat
    # within 1.17x.  (Issue 5's target "ring at 8 hosts <= 1.3x at 2 hosts" is stricter than this model.)
    assert m.ring_allreduce(s, 8).total / m.ring_allreduce(s, 2).total == pytest.approx(1.75)
    assert m.ring_allreduce(s, 8).total / m.ring_allreduce(s, 4).total == pytest.approx(7 / 6)
    one_server = [m.ps_push_pull(s, n, 1).total for n in (2, 4, 8)]
    assert one_server[1] == pytest.approx(2 * one_server[0]) and one_server[2] == pytest.approx(4 * one_server[0])


def test_ps_monotone_in_servers_and_bandwidth():
    s, n = 100e6, 16
    m = model("10gbit")
    times = [m.ps_push_pull(s, n, k).total for k in range(1, 40)]
    assert all(a >= b for a, b in zip(times[:-1], times[1:], strict=True))
    assert model("25gbit").ps_push_pull(s, n, 4).total < m.ps_push_pull(s, n, 4).total
    assert model("25gbit").ring_allreduce(s, n).total < m.ring_allreduce(s, n).total


def test_colocated_servers():
    s, n = 1e9, 4
    m = model("8gbit")
    # one server per worker host: each host sends and receives (N-1)/N of S per phase, like the ring
    assert m.ps_phase_bytes(s, n, n, colocated=True) == pytest.approx(s * 3 / 4)
    assert m.ps_push_pull(s, n, n, colocated=True).bandwidth == pytest.approx(m.ring_allreduce(s, n).bandwidth)
    # one server on one of 4 hosts receives from the 3 others
    assert m.ps_phase_bytes(s, n, 1, colocated=True) == pytest.approx(3 * s)
    with pytest.raises(ConfigError, match="do not fit"):
        m.ps_phase_bytes(s, n, 8, colocated=True)


def test_servers_to_match_ring_64_gpu_case():
    m = model("25gbit")
    s = 100 * 2**20
    k = m.servers_to_match_ring(s, 64, tolerance=1.1)
    assert k is not None and 32 < k <= 64
    assert m.ps_push_pull(s, 64, k).total <= 1.1 * m.ring_allreduce(s, 64).total
    assert m.ps_push_pull(s, 64, k - 1).total > 1.1 * m.ring_allreduce(s, 64).total
    assert m.servers_to_match_ring(s, 64, tolerance=0.5) is None


def test_scaling_efficiency_and_throughput():
    assert CostModel.scaling_efficiency(0.3, 0.1) == pytest.approx(0.75)
    assert CostModel.scaling_efficiency(0.3, 0.1, overlap=1.0) == 1.0
    assert CostModel.scaling_efficiency(0.2, 0.3, overlap=0.5) == pytest.approx(0.2 / 0.4)
    assert CostModel.throughput(32, 4, 0.3, 0.1) == pytest.approx(4 * 32 / 0.4)
    with pytest.raises(ConfigError, match="compute time"):
        CostModel.scaling_efficiency(0.0, 0.1)
    with pytest.raises(ConfigError, match="overlap"):
        CostModel.scaling_efficiency(0.1, 0.1, overlap=1.5)


def test_bus_bandwidth():
    assert bus_bandwidth(10.0, 2) == pytest.approx(10.0)
    assert bus_bandwidth(10.0, 8) == pytest.approx(17.5)
    assert bus_bandwidth(10.0, 1) == 0.0


@pytest.mark.parametrize("kwargs, match", [
    ({"bandwidth_bps": 0.0}, "bandwidth"),
    ({"bandwidth_bps": math.inf}, "bandwidth"),
    ({"bandwidth_bps": 1e9, "latency_s": -1.0}, "latency"),
    ({"bandwidth_bps": 1e9, "reduce_bytes_per_s": 0.0}, "reduction"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        CostModel(**kwargs)


def test_bad_workload():
    m = model()
    with pytest.raises(ConfigError, match="workers"):
        m.ring_allreduce(1e6, 0)
    with pytest.raises(ConfigError, match="payload"):
        m.ring_allreduce(-1, 2)
    with pytest.raises(ConfigError, match="at least 1 server"):
        m.ps_push_pull(1e6, 2, 0)


def test_calibration_gives_plausible_rates():
    assert 1e8 < measure_reduce_rate(nbytes=1 << 20, repeats=2) < 1e12
    assert 1e8 < measure_loopback_rate(nbytes=8 << 20) < 1e13
    assert 0 < measure_loopback_latency(rounds=20) < 0.05


def test_placed_servers_match_the_closed_forms():
    s, m = 1e9, model("8gbit")
    workers = ["h1", "h2", "h3", "h4"]
    # servers on hosts of their own: max(S, N*S/k)
    for k in (1, 2, 4, 8):
        own = [f"s{j}" for j in range(k)]
        assert m.ps_phase_bytes_placed(s, workers, own) == pytest.approx(m.ps_phase_bytes(s, 4, k))
    # servers on the first k worker hosts: the colocated form
    for k in (1, 2, 4):
        assert m.ps_phase_bytes_placed(s, workers, workers[:k]) == pytest.approx(
            m.ps_phase_bytes(s, 4, k, colocated=True))
    # everything on one host crosses no link
    assert m.ps_push_pull_placed(s, ["a", "a"], ["a"]).bandwidth == 0.0
    # two workers on one host share its link
    assert m.ps_phase_bytes_placed(s, ["a", "a"], ["b"]) == pytest.approx(2 * s)


def test_shared_machine_term_is_a_roofline_beside_the_link():
    s = 1e9
    shared = model("8gbit", machine_bytes_per_s=4 * GB)  # links 1e9 B/s; the machine moves 4e9 B/s in all
    ring = shared.ring_allreduce(s, 8)
    assert ring.shared == pytest.approx(2 * 7 * s / (4 * GB))  # 2(N-1)*S bytes cross links in all
    assert ring.bandwidth == pytest.approx(1.75)
    assert (ring.bound, ring.total) == ("cpu", pytest.approx(3.5))  # max, not the sum
    ps = shared.ps_push_pull(s, 8, 8)
    assert ps.shared == pytest.approx(2 * 8 * s / (4 * GB)) and ps.total == pytest.approx(4.0)
    one = shared.ps_push_pull(s, 8, 1)
    assert (one.bound, one.total) == ("link", pytest.approx(16.0))  # one server's link still binds
    # colocated servers keep one worker's worth of each phase off the links
    assert shared.ps_push_pull(s, 8, 8, colocated=True).shared == pytest.approx(2 * 7 * s / (4 * GB))
    placed = shared.ps_push_pull_placed(s, ["h1", "h2"], ["h1", "h3"])
    assert placed.shared == pytest.approx(2 * 1.5 * s / (4 * GB))  # h1's half to its own server stays local
    # without a shared machine (real hosts, hora bench plan) the term is zero and nothing changes
    plain = model("8gbit").ring_allreduce(s, 8)
    assert (plain.shared, plain.bound, plain.total) == (0.0, "link", pytest.approx(1.75))
    with pytest.raises(ConfigError, match="machine transfer rate"):
        model("8gbit", machine_bytes_per_s=0)
