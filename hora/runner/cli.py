"""The ``hora`` command line: argument parsing only.

``hora run`` turns its flags into a :class:`LaunchConfig` and calls
:func:`hora.runner.launch.launch`.  It accepts horovodrun's spellings
(``-np``, ``-H host:slots``, ``--hostfile``, ``--gloo``/``--mpi``, ``-p``,
``-i``, ``--network-interface``, tunables) and MXNet launch.py's (``-n``,
``-s``, ``--launcher``, ``-H hostfile``, ``--sync-dst-dir``, ``--env``), so
command lines from either world work with ``hora run`` in their place.
Where MXNet reads ``DMLC_NUM_SERVER`` and ``DMLC_INTERFACE``, so does
``hora run`` when ``-s`` / ``--network-interface`` are not given.

The ``hora`` command itself is :mod:`hora.cli`, which mounts ``run`` from
here beside ``bench``; :func:`build_parser` and :func:`main` take its table
of subcommands, and ``python -m hora.runner.cli run ...`` runs ``hora run``
alone (the launcher never imports :mod:`hora.bench`).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence

from hora import __version__, envvars
from hora.config import RunDefaults
from hora.errors import ConfigError, LaunchError
from hora.runner.hostlist import parse_hostfile, parse_hosts
from hora.runner.launch_config import LaunchConfig
from hora.runner.launchers.registry import launcher_help, launcher_names

#: A subcommand of ``hora``: its help line, what adds its flags to a parser, and its handler.
Subcommand = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[..., int]]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``hora run``."""
    size = parser.add_argument_group("job size and hosts")
    size.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N", help="number of processes")
    size.add_argument("-n", "--num-workers", dest="num_workers", type=int, metavar="N",
                      help="number of processes (MXNet launch.py spelling of -np)")
    size.add_argument("-s", "--num-servers", dest="num_servers", type=int, nargs="?", const=-1, metavar="N",
                      help="parameter servers (MXNet launch.py), started with one scheduler beside the workers; "
                           "-s alone means as many as workers (default: $DMLC_NUM_SERVER or 0)")
    size.add_argument("--server-hosts", dest="server_hosts", metavar="HOSTS",
                      help="host1,host2,...: run the parameter servers round-robin on these hosts, which may run "
                           "no worker, so no worker shares a server's link (default: round-robin over the "
                           "workers' hosts); the scheduler stays on rank 0's host")
    size.add_argument("-H", "--hosts", dest="hosts", metavar="HOSTS",
                      help="host1:slots,host2:slots (horovodrun), or a hostfile path (MXNet launch.py)")
    size.add_argument("--hostfile", dest="hostfile", metavar="FILE",
                      help="file with one 'host slots=N' or 'host:N' per line")

    how = parser.add_argument_group("how to launch")
    controller = how.add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="controller", action="store_const", const="gloo",
                            help="gloo controller, processes started by hora (the default with other hosts, "
                                 "parameter servers, or without MPI installed)")
    controller.add_argument("--mpi", dest="controller", action="store_const", const="mpi",
                            help="MPI controller, processes started by mpirun (the default on one machine when "
                                 "mpirun and mpi4py are installed, as with horovodrun)")
    how.add_argument("--launcher", choices=launcher_names(), metavar="LAUNCHER", help=launcher_help())
    how.add_argument("--mpi-args", dest="mpi_args", metavar="ARGS", help="extra arguments for mpirun, quoted")
    how.add_argument("--network-interface", dest="network_interface", metavar="IFACE",
                     help="network interface for rendezvous, gloo, MPI and the parameter servers "
                          "(default: $DMLC_INTERFACE)")
    how.add_argument("--env", dest="env", action="append", default=[], metavar="NAME=VALUE",
                     help="set an environment variable for every process (repeatable; NAME:VALUE works too)")
    how.add_argument("--start-timeout", dest="start_timeout", type=float, metavar="SECONDS",
                     help="how long the workers may take to rendezvous")
    how.add_argument("--output-filename", dest="output_filename", metavar="DIR",
                     help="also write each rank's output to DIR/rank.N/stdout and stderr")
    how.add_argument("--verbose", action="store_true", help="print the launch plan")
    how.add_argument("--log-level", dest="log_level", type=str.upper,
                     choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                     help="how much hora run itself logs (horovodrun's flag); --verbose implies INFO")

    remote = parser.add_argument_group("other hosts (ssh)")
    remote.add_argument("-p", "--ssh-port", dest="ssh_port", type=int, metavar="PORT", help="sshd port on the hosts")
    remote.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", metavar="FILE",
                        help="private key for ssh")
    remote.add_argument("--ssh-config-file", dest="ssh_config_file", metavar="FILE",
                        help="ssh client config for this job (ssh -F), e.g. with its own known_hosts")
    remote.add_argument("--ssh-connect-timeout", dest="ssh_connect_timeout", type=float, default=10.0,
                        metavar="SECONDS", help="how long to try to reach a host (default 10)")
    remote.add_argument("--sync-dst-dir", "--sync-dir", dest="sync_dst_dir", metavar="DIR",
                        help="copy the working directory to DIR on every host first (rsync, else scp), run there")

    grid = parser.add_argument_group("Sun / Son of Grid Engine (--launcher sge, submitting from outside a job)")
    grid.add_argument("--sge-pe", dest="sge_pe", metavar="PE",
                      help="parallel environment to submit to (qsub -pe; default hora); it needs control_slaves TRUE")
    grid.add_argument("--sge-queue", dest="sge_queue", metavar="QUEUE", help="queue to submit to (qsub -q)")

    tune = parser.add_argument_group("engine tunables")
    tune.add_argument("--fusion-threshold-mb", dest="fusion_threshold_mb", type=float, metavar="MB",
                      help="fusion buffer size in MiB (0 disables fusion)")
    tune.add_argument("--cycle-time-ms", dest="cycle_time_ms", type=float, metavar="MS",
                      help="engine cycle time in milliseconds")
    tune.add_argument("--timeline-filename", dest="timeline_filename", metavar="FILE",
                      help="write a timeline of engine activity to FILE (Chrome trace; summarize it with "
                           "`hora timeline FILE`)")
    tune.add_argument("--timeline-mark-cycles", dest="timeline_mark_cycles", action="store_true",
                      help="mark every engine cycle in the timeline (HORA_TIMELINE_MARK_CYCLES=1)")
    tune.add_argument("--autotune", action="store_true",
                      help="tune the fusion threshold, cycle time, direct threshold and overlap while the "
                           "job runs (HORA_AUTOTUNE=1)")
    tune.add_argument("--autotune-log-file", dest="autotune_log_file", metavar="FILE",
                      help="with --autotune: write every trial and the chosen settings to this CSV file")

    elastic = parser.add_argument_group("elastic training (workers join and leave; gloo only)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                         help="fewest processes to train with; below it the job waits up to --elastic-timeout "
                              "(default: -np). Any elastic flag makes the job elastic")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                         help="most processes (default: every free slot)")
    elastic.add_argument("--slots-per-host", "--slots", dest="slots_per_host", type=int, metavar="N",
                         help="slots of a discovered host whose line gives no count (default 1)")
    elastic.add_argument("--host-discovery-script", dest="host_discovery_script", metavar="SCRIPT",
                         help="executable printing the usable hosts, one 'host:slots' per line; run every second")
    elastic.add_argument("--elastic-timeout", dest="elastic_timeout", type=float, metavar="SECONDS",
                         help="how long the job may have fewer than --min-np processes before it fails "
                              "(default: $HOROVOD_ELASTIC_TIMEOUT or 600)")
    elastic.add_argument("--reset-limit", dest="reset_limit", type=int, metavar="N",
                         help="fail the job when the ring re-forms more than N times")
    elastic.add_argument("--blacklist-cooldown-range", dest="blacklist_cooldown_range", type=float, nargs=2,
                         metavar=("MIN", "MAX"),
                         help="a host whose worker failed may return after MIN*2^n seconds (n: its failures) "
                              "plus a random fraction of MIN, kept within MIN..MAX, as horovodrun "
                              "(default: blacklisted for good)")

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
        if getattr(args, "host_discovery_script", None) or getattr(args, "min_np", None):
            num_proc = args.min_np or 1
        elif hosts is None:
            raise ConfigError("the number of processes is missing: give -np N")
        else:
            num_proc = sum(h.slots for h in hosts)
    defaults = RunDefaults.from_env(
        num_servers=args.num_servers, network_interface=args.network_interface,
        elastic_timeout=getattr(args, "elastic_timeout", None),
    )
    return LaunchConfig(
        command=command,
        num_proc=num_proc,
        hosts=hosts,
        controller=args.controller,
        launcher=args.launcher,
        num_servers=defaults.num_servers,
        server_hosts=args.server_hosts,
        fusion_threshold_mb=args.fusion_threshold_mb,
        cycle_time_ms=args.cycle_time_ms,
        timeline_filename=args.timeline_filename,
        output_filename=args.output_filename,
        start_timeout=args.start_timeout,
        network_interface=defaults.network_interface,
        env={**_tuning_env(args), **parse_env_flags(args.env)},
        mpi_args=shlex.split(args.mpi_args) if args.mpi_args else (),
        verbose=args.verbose,
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        ssh_config_file=args.ssh_config_file,
        ssh_connect_timeout=args.ssh_connect_timeout,
        sync_dst_dir=args.sync_dst_dir,
        sge_queue=args.sge_queue,
        sge_pe=args.sge_pe,
        **_elastic_fields(args, defaults.elastic_timeout),
    )


def _elastic_fields(args: argparse.Namespace, timeout: float) -> dict[str, object]:
    """The elastic flags as :class:`LaunchConfig` fields (``timeout``: ``--elastic-timeout`` or its variable)."""
    cooldown = getattr(args, "blacklist_cooldown_range", None)
    return dict(
        min_np=getattr(args, "min_np", None),
        max_np=getattr(args, "max_np", None),
        slots_per_host=getattr(args, "slots_per_host", None),
        host_discovery_script=getattr(args, "host_discovery_script", None),
        elastic_timeout=timeout,
        reset_limit=getattr(args, "reset_limit", None),
        blacklist_cooldown_range=tuple(cooldown) if cooldown else None,
    )


def _tuning_env(args: argparse.Namespace) -> dict[str, str]:
    """The worker variables of the timeline and autotune flags."""
    env: dict[str, str] = {}
    if getattr(args, "timeline_mark_cycles", False):
        env[envvars.HORA_TIMELINE_MARK_CYCLES] = "1"
    if getattr(args, "autotune", False):
        env[envvars.HORA_AUTOTUNE] = "1"
    if getattr(args, "autotune_log_file", None):
        if not args.autotune:
            raise ConfigError("--autotune-log-file needs --autotune")
        env[envvars.HORA_AUTOTUNE_LOG] = os.path.abspath(args.autotune_log_file)
    return env


def parse_env_flags(items: Sequence[str]) -> dict[str, str]:
    """``--env NAME=VALUE`` (or MXNet's ``NAME:VALUE``) flags as a dictionary.

    Raises:
        ConfigError: an item has no separator or no name.
    """
    env: dict[str, str] = {}
    for item in items:
        positions = [i for i in (item.find("="), item.find(":")) if i > 0]
        if not positions:
            raise ConfigError(f"--env {item!r}: use NAME=VALUE")
        cut = min(positions)
        env[item[:cut]] = item[cut + 1:]
    return env


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hora run``: parse flags into a config and launch it."""
    try:
        config = config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))  # usage + message, exit code 2
    level = getattr(args, "log_level", None) or ("INFO" if config.verbose else None)
    if level is not None:
        logging.basicConfig(level=getattr(logging, level), format="hora run: %(message)s")
    from hora.runner.launch import launch  # keep `hora --help` fast

    try:
        return launch(config)
    except LaunchError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1


#: The subcommands the launcher provides (:mod:`hora.cli` adds ``bench``).
SUBCOMMANDS: dict[str, Subcommand] = {
    "run": ("launch a training job on N processes", add_run_arguments, run_command),
}


def build_parser(subcommands: Mapping[str, Subcommand] = SUBCOMMANDS) -> argparse.ArgumentParser:
    """The ``hora`` parser with one sub-parser per subcommand."""
    parser = argparse.ArgumentParser(prog="hora", description="hora: data-parallel training launcher",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"hora {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    for name, (help_text, add_arguments, handler) in subcommands.items():
        subparser = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        add_arguments(subparser)
        subparser.set_defaults(handler=handler, subparser=subparser)
    return parser


def bare_servers_flag(argv: Sequence[str]) -> list[str]:
    """Rewrite a bare ``-s`` (no count) to ``--num-servers=-1``, so the command after it is not taken as the count.

    Only the flags before the command are looked at: the scan stops at ``--``
    or at the first word that is neither a flag nor a flag's value.
    """
    args = list(argv)
    if not args or args[0] != "run":
        return args
    probe = argparse.ArgumentParser(add_help=False)
    add_run_arguments(probe)
    actions = {option: action for action in probe._actions for option in action.option_strings}
    i = 1
    while i < len(args):
        token = args[i]
        action = actions.get(token.split("=", 1)[0]) if token.startswith("-") else None
        if token == "--" or action is None:
            break
        if action.dest == "num_servers" and "=" not in token:
            following = args[i + 1] if i + 1 < len(args) else ""
            if not following.isdigit():
                args[i] = "--num-servers=-1"
            else:
                i += 1
        elif action.nargs is None and "=" not in token:
            i += 1  # the flag's value
        i += 1
    return args


def main(argv: Sequence[str] | None = None, subcommands: Mapping[str, Subcommand] = SUBCOMMANDS) -> int:
    """Parse ``argv`` (default: the process's arguments) and run the subcommand it names."""
    parser = build_parser(subcommands)
    argv = bare_servers_flag(sys.argv[1:] if argv is None else argv)
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
