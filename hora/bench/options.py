"""What every measuring ``hora bench`` command shares: where to run, and the cost model to compare with.

:class:`RunOptions` carries the launcher pass-through (``-H``/``--hostfile``,
extra ``hora run`` flags, a timeout) and the optional emulation;
:func:`cost_model` picks the link the predictions assume: the emulated
link, the ``--link`` given, or, on a plain localhost run, one TCP stream over
loopback measured on the spot (``--link auto``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shlex
from collections.abc import Iterator, Sequence
from typing import Any

from hora.bench.emulate import Emulation, LinkCalibration, Placement, emulated_hosts
from hora.bench.jobs import JobSpec
from hora.bench.model import CostModel, measure_loopback_latency, measure_loopback_rate, measure_reduce_rate
from hora.bench.units import parse_duration, parse_rate
from hora.errors import ConfigError


@dataclasses.dataclass(kw_only=True, slots=True)
class RunOptions:
    """Where and how the jobs of one ``hora bench`` command run.

    Attributes:
        hosts: ``-H`` passed to ``hora run`` (None: localhost).
        hostfile: ``--hostfile`` passed to ``hora run``.
        run_args: extra ``hora run`` flags.
        timeout_s: limit for each job.
        emulation: run on an emulated cluster instead (``--emulate-hosts``).
        progress: show progress bars.
        calibrate: measure the emulated links and machine once for the cost
            model (``--no-calibrate`` keeps the nominal link rate).
    """

    hosts: str | None = None
    hostfile: str | None = None
    run_args: Sequence[str] = ()
    timeout_s: float = 600.0
    emulation: Emulation | None = None
    progress: bool = True
    calibrate: bool = True

    def __post_init__(self) -> None:
        if self.hosts is not None and self.hostfile is not None:
            raise ConfigError("give either -H or --hostfile, not both")
        if self.emulation is not None and (self.hosts or self.hostfile):
            raise ConfigError("--emulate-hosts makes its own hosts: drop -H/--hostfile")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout {self.timeout_s} must be > 0 seconds")

    @classmethod
    def from_args(cls, args: Any) -> RunOptions:
        """Build from parsed ``hora bench`` arguments (see :func:`hora.bench.cli.add_run_options`)."""
        return cls(hosts=args.hosts, hostfile=args.hostfile,
                   run_args=shlex.split(args.hora_run_args) if args.hora_run_args else (),
                   timeout_s=args.timeout,
                   emulation=Emulation.from_args(args.emulate_hosts, args.link, args.latency),
                   progress=not args.no_progress, calibrate=not getattr(args, "no_calibrate", False))

    def job(self, worker: str, args: Sequence[str], *, num_proc: int, controller: str = "gloo",
            num_servers: int = 0, placement: Placement | None = None) -> JobSpec:
        """A :class:`JobSpec` with this command's launcher options, run where ``placement`` says."""
        placement = placement or Placement(hosts=self.hosts)
        hosts, server_hosts = placement.for_job(num_proc, num_servers)
        return JobSpec(worker=worker, args=list(args), num_proc=num_proc, controller=controller,
                       num_servers=num_servers, server_hosts=server_hosts, hosts=hosts, hostfile=self.hostfile,
                       run_args=[*placement.run_args, *self.run_args], timeout_s=self.timeout_s,
                       prefix=list(placement.prefix))

    @contextlib.contextmanager
    def placement(self, given: Placement | None = None) -> Iterator[Placement]:
        """Where the jobs run: ``given``, else the emulated cluster while it is up, else ``-H`` (or localhost)."""
        if given is not None:
            yield given
            return
        if self.emulation is None:
            yield Placement(hosts=self.hosts)
            return
        with emulated_hosts(self.emulation, calibrate_links=self.calibrate) as placement:
            yield placement

    @property
    def where(self) -> str:
        """A few words for table titles."""
        if self.emulation is not None:
            return self.emulation.describe()
        if self.hosts or self.hostfile:
            return f"hosts {self.hosts or self.hostfile}"
        return "localhost"


def cost_model(link: str | None, latency: str | None, options: RunOptions, cpu_term: bool = True,
               overhead: str | None = None) -> CostModel:
    """The model the measured rows are compared with.

    ``--link auto`` (the default) on localhost measures one loopback TCP
    stream, and, unless ``--latency`` is given, half a loopback round trip;
    with emulation the emulated link is used; on real hosts a ``--link`` must
    be given.  The CPU reduction rate is measured here unless ``cpu_term`` is
    False; ``overhead`` is a fixed software cost per operation (default 0).

    Raises:
        ConfigError: ``--link auto`` with -H/--hostfile (the rate of real links
            cannot be guessed).
    """
    reduce_rate = measure_reduce_rate() if cpu_term else float("inf")
    overhead_s = parse_duration(overhead or "0")
    if options.emulation is not None:
        return CostModel(bandwidth_bps=options.emulation.link_bps, latency_s=options.emulation.latency_s,
                         reduce_bytes_per_s=reduce_rate, overhead_s=overhead_s)
    if link is None or link == "auto":
        if options.hosts or options.hostfile:
            raise ConfigError("with -H/--hostfile give the hosts' link rate for the cost model: --link 10gbit")
        bps = measure_loopback_rate()
        latency_s = measure_loopback_latency() if latency is None else parse_duration(latency)
    else:
        bps, latency_s = parse_rate(link), parse_duration(latency or "0")
    return CostModel(bandwidth_bps=bps, latency_s=latency_s, reduce_bytes_per_s=reduce_rate, overhead_s=overhead_s)


def calibrated(model: CostModel, calibration: LinkCalibration | None, cpu_term: bool = True) -> CostModel:
    """``model`` with an emulated cluster's measured link goodput and, with ``cpu_term``, the machine's rate.

    Both are measured once per cluster (:func:`hora.bench.emulate.calibrate`),
    never fitted to a measured row.
    """
    if calibration is None:
        return model
    machine = calibration.machine_bytes_per_s if cpu_term else math.inf
    return dataclasses.replace(model, bandwidth_bps=calibration.goodput_bps, machine_bytes_per_s=machine)


def model_doc(model: CostModel) -> dict[str, float]:
    """The model's parameters for the JSON document."""
    return {"bandwidth_bps": model.bandwidth_bps, "latency_s": model.latency_s,
            "reduce_bytes_per_s": model.reduce_bytes_per_s, "overhead_s": model.overhead_s,
            "machine_bytes_per_s": model.machine_bytes_per_s}


def ratio(measured: float | None, predicted: float | None) -> float | None:
    """``measured / predicted``, None when either is missing or the prediction is zero."""
    if measured is None or not predicted:
        return None
    return measured / predicted
