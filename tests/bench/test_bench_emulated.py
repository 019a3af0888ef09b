"""Running benchmarks on an emulated cluster: where each job's workers and servers go, calibration, repeats.

The placement and merging logic is checked without starting anything; the
calibration test starts a real 2-host cluster (needs root and ``ip netns``,
skipped otherwise).
"""

from __future__ import annotations

import math

import pytest

from hora.bench.emulate import Emulation, LinkCalibration, Placement, calibrate
from hora.bench.jobs import JobSpec
from hora.bench.kvstore import KVStoreConfig, add_comparisons, layout
from hora.bench.model import CostModel
from hora.bench.options import RunOptions, calibrated
from hora.bench.report import median_rows, with_runs
from hora.errors import ConfigError

NAMES = tuple(f"h{i}" for i in range(1, 7))


def test_workers_take_the_first_hosts_and_servers_the_rest():
    placement = Placement(hosts="h1:1,h2:1", names=NAMES)
    assert placement.for_job(4, 2) == ("h1:1,h2:1,h3:1,h4:1", ("h5", "h6"))
    assert placement.for_job(4, 0) == ("h1:1,h2:1,h3:1,h4:1", ())  # no servers: no --server-hosts
    assert placement.for_job(6, 6) == (",".join(f"{n}:1" for n in NAMES), ())  # no host to spare: shared
    with pytest.raises(ConfigError, match=r"-np 7 needs one emulated host per rank: raise --emulate-hosts 6"):
        placement.for_job(7, 0)
    # off the emulated cluster, -H passes through and the launcher places the servers
    assert Placement(hosts="a:2,b:2").for_job(4, 2) == ("a:2,b:2", ())


def test_jobs_carry_server_hosts_to_hora_run_and_to_the_model():
    options = RunOptions()
    spec = options.job("kvstore", ["--sizes", "4096"], num_proc=2, num_servers=3,
                       placement=Placement(names=NAMES[:4]))
    cmd = spec.command()
    assert cmd[cmd.index("-s"):cmd.index("-s") + 4] == ["-s", "3", "--server-hosts", "h3,h4"]
    assert cmd[cmd.index("-H") + 1] == "h1:1,h2:1"
    # the model sees the placement hora run's planner gives: servers round-robin over h3, h4
    assert layout(spec) == (["h1", "h2"], ["h3", "h4", "h3"])
    assert "--server-hosts" not in JobSpec(worker="kvstore", num_servers=0, server_hosts=("x",)).command()
    assert layout(JobSpec(worker="kvstore", num_proc=2, num_servers=1)) is None  # localhost: no host list


def test_calibration_replaces_the_nominal_link_and_adds_the_machine():
    base = CostModel(bandwidth_bps=1e9, reduce_bytes_per_s=1e10)
    cal = LinkCalibration(goodput_bps=0.94e9, machine_bytes_per_s=1.2e9, pairs=4)
    model = calibrated(base, cal)
    assert (model.bandwidth_bps, model.machine_bytes_per_s, model.reduce_bytes_per_s) == (0.94e9, 1.2e9, 1e10)
    assert calibrated(base, cal, cpu_term=False).machine_bytes_per_s == math.inf
    assert calibrated(base, None) is base
    assert "940 Mbit/s" in cal.describe() and "1.2 GB/s" in cal.describe()


def test_repeats_keep_each_rows_median_run():
    runs = [[{"np": 2, "time_s": t, "predicted_s": p}, {"np": 4, "time_s": 2 * t, "predicted_s": p}]
            for t, p in ((3.0, 30), (1.0, 10), (2.0, 20))]
    rows = median_rows(runs, "time_s", ("np",))
    assert [(r["np"], r["time_s"], r["predicted_s"], r["runs_s"]) for r in rows] == [
        (2, 2.0, 20, [3.0, 1.0, 2.0]), (4, 4.0, 20, [6.0, 2.0, 4.0])]  # the median run's own prediction
    assert median_rows([[{"np": 2, "time_s": 1.0}], [{"np": 2, "time_s": 3.0}]], "time_s", ("np",))[0][
        "time_s"] == 1.0  # even count: the lower middle
    headers, body = with_runs(["ranks"], [["2"], ["4"]], rows)
    assert headers == ["ranks", "runs (min–max)"] and body == [["2", "1–3 s"], ["4", "2–6 s"]]
    assert with_runs(["ranks"], [["2"]], [{"runs_s": [1.0]}]) == (["ranks"], [["2"]])


def test_several_worker_counts_compare_within_each_count():
    assert KVStoreConfig(sizes=[4096], workers=[2, 4]).worker_counts == (2, 4)
    assert KVStoreConfig(sizes=[4096], workers=8).worker_counts == (8,)
    with pytest.raises(ConfigError, match="every worker count must be >= 1"):
        KVStoreConfig(sizes=[4096], workers=[2, 0])
    rows = [{"system": "hora dist_sync", "kvstore": "dist_sync", "workers": w, "servers": 1, "bytes": 64,
             "time_s": t} for w, t in ((2, 4.0), (4, 8.0))]
    rows += [{"system": "hora dist_sync_allreduce", "kvstore": "dist_sync_allreduce", "workers": w, "servers": 0,
              "bytes": 64, "time_s": t} for w, t in ((2, 1.0), (4, 2.0))]
    add_comparisons(rows)
    assert [r["vs_allreduce"] for r in rows] == [4.0, 4.0, 1.0, 1.0]


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_calibrating_a_real_emulated_cluster():
    from hora.testing import emulate
    emulation = Emulation(hosts=2, link="100mbit")
    try:
        cluster = emulate.EmulatedCluster(2, link="100mbit").start()
    except emulate.ClusterUnavailable as e:
        pytest.skip(f"no emulated cluster on this machine: {e}")
    try:
        cal = calibrate(cluster, emulation, timeout_s=60)
        # TCP/IP and Ethernet headers take ~5% of a shaped link; the unshaped machine is far faster
        assert 80e6 < cal.goodput_bps < 100e6
        assert cal.machine_bytes_per_s > 5 * cal.goodput_bps / 8 and cal.pairs == 1
        # the shaping is back: a second goodput measurement still sees the 100 Mbit/s link
        assert calibrate(cluster, emulation, timeout_s=60).goodput_bps < 100e6
    finally:
        cluster.close()


def test_plots_against_the_number_of_workers(tmp_path):
    pytest.importorskip("matplotlib")
    from hora.bench import report

    kv_rows = [{"system": "hora dist_sync", "workers": n, "servers": 1, "bytes": 16 << 20, "time_s": 0.3 * n,
                "predicted_s": 0.29 * n} for n in (2, 4, 8)]
    kv_rows += [{"system": "hora dist_sync_allreduce", "workers": n, "servers": 0, "bytes": 16 << 20,
                 "time_s": 0.2, "predicted_s": 0.25 * (n - 1) / n} for n in (2, 4, 8)]
    ar_rows = [{"backend": "gloo", "np": n, "bytes": 16 << 20, "time_s": 0.2, "predicted_s": 0.25 * (n - 1) / n,
                "busbw": 1e8} for n in (2, 4, 8)]
    report.plot_kvstore(kv_rows, str(tmp_path / "kv.png"), "kvstore against W")
    report.plot_allreduce(ar_rows, str(tmp_path / "ar.png"), "ring against N")
    for name in ("kv.png", "ar.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
