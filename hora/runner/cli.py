"""The ``hora`` command line: argument parsing only.

``hora run`` turns its flags into a :class:`LaunchConfig` and calls
:func:`hora.runner.launch.launch`.  It accepts horovodrun's spellings
(``-np``, ``-H host:slots``, ``--gloo``/``--mpi``, tunables) and MXNet
launch.py's (``-n``, ``-s``, ``--launcher``, ``-H hostfile``), so command lines
from either world work with ``hora run`` in their place.

Subcommands live in :data:`SUBCOMMANDS`; ``bench`` and ``check`` are planned.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Callable, Sequence

from hora.errors import ConfigError, LaunchError
from hora.runner.config import AVAILABLE_LAUNCHERS, PLANNED_LAUNCHERS, LaunchConfig, parse_hostfile, parse_hosts

VERSION = "0.1.0"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``hora run``."""
    size = parser.add_argument_group("job size and hosts")
    size.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N", help="number of processes")
    size.add_argument("-n", "--num-workers", dest="num_workers", type=int, metavar="N",
                      help="number of processes (MXNet launch.py spelling of -np)")
    size.add_argument("-s", "--num-servers", dest="num_servers", type=int, default=0, metavar="N",
                      help="parameter servers (MXNet launch.py); not available yet")
    size.add_argument("-H", "--hosts", dest="hosts", metavar="HOSTS",
                      help="host1:slots,host2:slots (horovodrun), or a hostfile path (MXNet launch.py)")
    size.add_argument("--hostfile", dest="hostfile", metavar="FILE",
                      help="file with one 'host slots=N' or 'host:N' per line")

    how = parser.add_argument_group("how to launch")
    controller = how.add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="controller", action="store_const", const="gloo",
                            help="gloo controller, processes started by hora (default)")
    controller.add_argument("--mpi", dest="controller", action="store_const", const="mpi",
                            help="MPI controller, processes started by mpirun")
    how.add_argument("--launcher", choices=AVAILABLE_LAUNCHERS + PLANNED_LAUNCHERS,
                     help="local (default), mpi; ssh and slurm are not available yet")
    how.add_argument("--mpi-args", dest="mpi_args", metavar="ARGS", help="extra arguments for mpirun, quoted")
    how.add_argument("--network-interface", dest="network_interface", metavar="IFACE",
                     help="network interface for rendezvous and gloo (exported as GLOO_SOCKET_IFNAME)")
    how.add_argument("--start-timeout", dest="start_timeout", type=float, metavar="SECONDS",
                     help="how long the workers may take to rendezvous")
    how.add_argument("--output-filename", dest="output_filename", metavar="DIR",
                     help="also write each rank's output to DIR/rank.N/stdout and stderr")
    how.add_argument("--verbose", action="store_true", help="print the launch plan")

    tune = parser.add_argument_group("engine tunables")
    tune.add_argument("--fusion-threshold-mb", dest="fusion_threshold_mb", type=float, metavar="MB",
                      help="fusion buffer size in MiB (0 disables fusion)")
    tune.add_argument("--cycle-time-ms", dest="cycle_time_ms", type=float, metavar="MS",
                      help="engine cycle time in milliseconds")
    tune.add_argument("--timeline-filename", dest="timeline_filename", metavar="FILE",
                      help="write a timeline of engine activity to FILE")

    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments ('--' optional)")


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Build the :class:`LaunchConfig` for parsed ``hora run`` arguments.

    Raises:
        ConfigError: the flags contradict each other or have bad values.
    """
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command given: put it after the flags, e.g. 'hora run -np 2 python train.py'")
    hosts = None
    if args.hosts is not None and args.hostfile is not None:
        raise ConfigError("give either -H or --hostfile, not both")
    if args.hostfile is not None:
        hosts = parse_hostfile(args.hostfile)
    elif args.hosts is not None:
        hosts = parse_hostfile(args.hosts) if os.path.isfile(args.hosts) else parse_hosts(args.hosts)
    num_proc = args.num_proc
    if args.num_workers is not None:
        if num_proc is not None and num_proc != args.num_workers:
            raise ConfigError(f"-np {num_proc} and -n {args.num_workers} disagree; give one of them")
        num_proc = args.num_workers
    if num_proc is None:
        if hosts is None:
            raise ConfigError("the number of processes is missing: give -np N")
        num_proc = sum(h.slots for h in hosts)
    return LaunchConfig(
        command=command,
        num_proc=num_proc,
        hosts=hosts,
        controller=args.controller,
        launcher=args.launcher,
        num_servers=args.num_servers,
        fusion_threshold_mb=args.fusion_threshold_mb,
        cycle_time_ms=args.cycle_time_ms,
        timeline_filename=args.timeline_filename,
        output_filename=args.output_filename,
        start_timeout=args.start_timeout,
        network_interface=args.network_interface,
        mpi_args=shlex.split(args.mpi_args) if args.mpi_args else (),
        verbose=args.verbose,
    )


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hora run``: parse flags into a config and launch it."""
    try:
        config = config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))  # usage + message, exit code 2
    if config.verbose:
        logging.basicConfig(level=logging.INFO, format="hora run: %(message)s")
    from hora.runner.launch import launch  # keep `hora --help` fast

    try:
        return launch(config)
    except LaunchError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1


#: name -> (help, add_arguments, handler).  ``bench`` and ``check`` are planned.
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[..., int]]] = {
    "run": ("launch a training job on N processes", add_run_arguments, run_command),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``hora`` parser with one sub-parser per subcommand."""
    parser = argparse.ArgumentParser(prog="hora", description="hora: data-parallel training launcher",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"hora {VERSION}")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    for name, (help_text, add_arguments, handler) in SUBCOMMANDS.items():
        subparser = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        add_arguments(subparser)
        subparser.set_defaults(handler=handler, subparser=subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hora`` console script."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report it with the subcommand's usage, not the top-level one
        (args.subparser if args.subcommand else parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.subcommand is None:
        parser.print_usage(sys.stderr)
        print("hora: error: a command is required (run: hora run -np 2 python train.py)", file=sys.stderr)
        return 2
    return args.handler(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
