"""The ``hora`` command: mounts ``hora run``, ``hora bench`` and ``hora timeline``.

Each subcommand owns its flags and its handler; this module only puts them
side by side (:mod:`hora.runner`, :mod:`hora.bench`, :mod:`hora.timeline_cli`),
so the launcher never imports the benchmarks.  A new subcommand is one more
row of :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hora import timeline_cli
from hora.bench import cli as bench_cli
from hora.runner import cli as runner_cli

#: name -> (help, add_arguments, handler), in the order ``hora --help`` lists them.
SUBCOMMANDS: dict[str, runner_cli.Subcommand] = {
    **runner_cli.SUBCOMMANDS,
    "bench": (bench_cli.HELP, bench_cli.add_arguments, bench_cli.run_command),
    "timeline": (timeline_cli.HELP, timeline_cli.add_arguments, timeline_cli.run_command),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hora`` console script."""
    return runner_cli.main(argv, SUBCOMMANDS)


if __name__ == "__main__":
    sys.exit(main())
