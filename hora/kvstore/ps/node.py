"""``python -m hora.kvstore.ps.node``: run a scheduler or a server until the job ends.

The role and the job come from the environment, as in MXNet/ps-lite:
``DMLC_ROLE`` (``scheduler`` or ``server``), ``DMLC_PS_ROOT_URI``,
``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``,
``DMLC_INTERFACE``, plus ``HORA_SECRET`` (the ``HORA_PS_*`` names work too;
see :class:`hora.config.PSConfig`).  ``hora run -np W -s S`` starts the
scheduler and the servers exactly this way.  Workers are the training
processes: they join when they call ``hora.kvstore.create('dist_sync')``.

Exit status: 0 when every worker said goodbye, 1 when the job died (a node
was lost, the scheduler vanished, the job never started), 2 for a bad
configuration.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType

from hora.config import PSConfig
from hora.errors import ConfigError, HoraError


def run_role(config: PSConfig) -> int:
    """Run ``config.role`` (scheduler or server) in this process until the job ends; returns the exit code.

    Raises:
        ConfigError: the role is ``worker`` or the job is not configured.
    """
    if config.role == "scheduler":
        from hora.kvstore.ps.scheduler import Scheduler

        return Scheduler(config).run()
    if config.role == "server":
        from hora.kvstore.ps.server import Server

        return Server(config).run()
    raise ConfigError("DMLC_ROLE=worker: a worker is your training script; it joins the job when it calls "
                      "hora.kvstore.create('dist_sync'). Run this module with DMLC_ROLE=scheduler or server")


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the role's cleanup (its shared-memory segments)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m hora.kvstore.ps.node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        config = PSConfig.from_env()
        return run_role(config)
    except ConfigError as e:
        print(f"hora parameter server: configuration error: {e}", file=sys.stderr)
        return 2
    except HoraError as e:
        print(f"hora parameter server: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
