"""``hora bench``: flag parsing, plan output, JSON, and clear errors for bad input."""

from __future__ import annotations

import argparse
import json

import pytest

from hora.bench import cli
from hora.bench.emulate import Emulation
from hora.bench.options import RunOptions
from hora.errors import ConfigError


def parse(argv):
    parser = argparse.ArgumentParser(prog="hora bench")
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_plan_flags():
    args = parse(["plan", "--workers", "64", "--servers", "32", "--link", "25gbit", "--model-mb", "100"])
    assert (args.bench_command, args.workers, args.servers, args.link, args.model_mb) == ("plan", 64, 32, "25gbit",
                                                                                         100.0)
    assert args.json is None and args.compute_ms is None


def test_measuring_flags_and_defaults():
    args = parse(["allreduce", "--sizes", "4KiB,64KiB", "--iters", "3", "--json"])
    assert args.json == "-" and args.num_proc == [2] and args.backends == ["gloo", "mpi"] and args.iters == 3
    args = parse(["train", "-np", "1,2,4", "--strategy", "allreduce,ps", "-H", "a:2,b:2", "--json", "out.json"])
    assert args.num_proc == [1, 2, 4] and args.strategy == ["allreduce", "ps"] and args.hosts == "a:2,b:2"
    assert args.json == "out.json"
    args = parse(["kvstore", "--workers", "8", "--servers", "1,2,4,8", "--emulate-hosts", "16", "--link", "1gbit",
                  "--latency", "0.1ms", "--plot", "kv.png"])
    assert args.servers == [1, 2, 4, 8] and args.emulate_hosts == 16 and args.plot == "kv.png"
    options = RunOptions.from_args(args)
    assert options.emulation == Emulation(hosts=16, link="1gbit", latency="0.1ms")
    assert options.emulation.link_bps == 1e9 and options.emulation.latency_s == pytest.approx(1e-4)


def test_bad_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "-np", "1,two"])
    assert e.value.code == 2
    assert "comma-separated list of integers" in capsys.readouterr().err


def test_plan_prints_ring_and_servers(capsys):
    assert cli.main(["plan", "--workers", "64", "--servers", "32", "--link", "25gbit", "--model-mb", "100",
                     "--compute-ms", "200"]) == 0
    out = capsys.readouterr().out
    assert "64 workers" in out and "25 Gbit/s" in out
    assert "| ring allreduce" in out and "32 *" in out and "efficiency" in out
    ring_line = next(line for line in out.splitlines() if line.startswith("| ring allreduce"))
    assert "66.06 ms" in ring_line  # 2 * 63/64 * 100 MiB / 3.125 GB/s


def test_plan_json(capsys):
    assert cli.main(["plan", "--workers", "8", "--link", "10gbit", "--model-mb", "400", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert "| ring allreduce" in captured.err  # the table moves to stderr
    ring = doc["rows"][0]
    assert ring["strategy"] == "ring allreduce"
    ps = {r["servers"]: r["time_s"] for r in doc["rows"][1:]}
    assert ps[1] > ps[2] > ps[4] > ps[8] > ring["time_s"]
    assert doc["servers"] == 8
    # at best (k >= N) the PS moves S each way per worker, the ring 2(N-1)/N*S: 8/7 = 1.14x, not within 10%
    assert doc["servers_within_10pct_of_ring"] is None
    assert "at best 1.14x, from 8 servers on" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["plan", "--workers", "0", "--link", "1gbit"], "--workers 0"),
    (["plan", "--workers", "4", "--link", "fast"], "link rate"),
    (["plan", "--workers", "4", "--link", "1gbit", "--overlap", "2"], "--overlap"),
    (["plan", "--workers", "4", "--servers", "8", "--colocated", "--link", "1gbit"], "colocated"),
    (["allreduce", "--sizes", "6"], "multiple of 4"),
    (["allreduce", "--backends", "nccl,gloo"], "choose from gloo, mpi"),
    (["train", "--strategy", "magic"], "choose from allreduce, ps"),
    (["kvstore", "--emulate-hosts", "4"], "--link 1gbit"),
    (["kvstore", "--emulate-hosts", "4", "--link", "1gbit", "-H", "a:1"], "drop -H"),
    (["allreduce", "-H", "a:1", "--hostfile", "f"], "either -H or --hostfile"),
])
def test_bad_input_is_a_clear_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_no_benchmark_given(capsys):
    assert cli.main([]) == 2
    assert "choose a benchmark" in capsys.readouterr().err


def test_an_emulation_that_cannot_run_here_is_reported(capsys, monkeypatch):
    from hora.testing import emulate

    def unavailable(self):
        raise emulate.ClusterUnavailable("the emulated cluster needs root (network namespaces, veth links, tc)")

    monkeypatch.setattr(emulate.EmulatedCluster, "start", unavailable)
    assert cli.main(["allreduce", "--emulate-hosts", "2", "--link", "1gbit", "--no-cpu-term"]) == 1
    err = capsys.readouterr().err
    assert "cannot start 2 emulated hosts, 1 Gbit/s links" in err and "needs root" in err


def test_add_parser_mounts_bench_on_a_cli():
    parser = argparse.ArgumentParser(prog="hora")
    sub = parser.add_subparsers(dest="subcommand")
    cli.add_parser(sub)
    args = parser.parse_args(["bench", "plan", "--workers", "2", "--link", "1gbit"])
    assert args.handler is cli.run_command and args.bench_command == "plan"
    assert args.subparser.prog.endswith("bench plan")


def test_run_options_validation():
    with pytest.raises(ConfigError, match="timeout"):
        RunOptions(timeout_s=0)


def test_importing_the_cli_is_light():
    """``hora --help`` mounts this parser: it must not pull in torch, matplotlib or the KVStore."""
    import subprocess
    import sys

    code = ("import sys, hora.bench.cli; "
            "print(*[m in sys.modules for m in ('torch', 'matplotlib', 'hora.kvstore', 'tqdm')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.split() == ["False", "False", "False", "False"]
