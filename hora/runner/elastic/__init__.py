"""Elastic jobs of ``hora run``: a driver that polls host discovery, starts and retires workers, and forms rounds.

:func:`run_elastic` is what :func:`hora.runner.launch.run_job` calls when a
:class:`~hora.runner.launch_config.LaunchConfig` is elastic.  The parts:
:mod:`.hosts` (discovered hosts, blacklist, cool-down), :mod:`.discovery`
(the script or the fixed ``-H`` list), :mod:`.workers` (local and ssh worker
processes) and :mod:`.driver` (the rounds and the job's end).  Workers talk
to the driver through :mod:`hora.elastic_wire`; their side is
:mod:`hora.core.elastic`.
"""

from __future__ import annotations

import logging
from typing import TextIO

from hora import envvars
from hora.runner.elastic.discovery import FixedHosts, ScriptDiscovery
from hora.runner.elastic.driver import ElasticDriver, ElasticSettings, route_address
from hora.runner.elastic.hosts import HostManager
from hora.runner.elastic.workers import Spawner
from hora.runner.env import build_env, interface_address
from hora.runner.hostlist import is_local_host
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.base import JobResult
from hora.runner.output import OutputSink

log = logging.getLogger(__name__)

__all__ = ["ElasticDriver", "ElasticSettings", "HostManager", "run_elastic"]


def run_elastic(config: LaunchConfig, stdout: TextIO, stderr: TextIO, interrupt) -> JobResult:
    """Run an elastic job until it finishes or fails; returns its outcome (the caller prints the report)."""
    discovery = (ScriptDiscovery(config.host_discovery_script, config.slots_per_host)
                 if config.host_discovery_script else FixedHosts(config.host_list))
    env, notice = build_env(config, local_size=max(1, config.slots_per_host or config.num_proc))
    # The rendezvous variables of a fixed job mean nothing here: each round brings its own store.
    env.pop(envvars.HORA_RENDEZVOUS_ADDR, None)
    env.pop(envvars.HORA_RENDEZVOUS_PORT, None)
    if notice:
        print(notice, file=stderr, flush=True)
    remote_possible = config.host_discovery_script is not None or any(
        not is_local_host(h.host) for h in config.host_list)
    local_addr = interface_address(config.network_interface) if config.network_interface else "127.0.0.1"
    bind = "0.0.0.0" if remote_possible and not config.network_interface else local_addr
    sink = OutputSink(stdout, stderr, config.output_filename)
    spawner = Spawner(config, env, sink)
    settings = ElasticSettings(num_proc=config.num_proc, min_np=int(config.min_np or config.num_proc),
                               max_np=config.max_np, timeout_s=config.elastic_timeout,
                               reset_limit=config.reset_limit)
    hosts = HostManager(config.blacklist_cooldown_range)
    driver = ElasticDriver(settings, hosts, discovery, spawner, env[envvars.HORA_SECRET], sink, interrupt,
                           bind_addr=bind, advertise=lambda host: route_address(host, local_addr))
    try:
        return driver.run()
    finally:
        sink.close()
