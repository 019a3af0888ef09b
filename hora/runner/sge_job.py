"""Inside a job that ``hora run --launcher sge`` submitted: run the ``hora run`` it encoded.

``python -m hora.runner.sge_job JOB`` is the command of that job (see
:func:`hora.runner.launchers.sge.submit`); ``JOB`` is the launch
configuration, base64-encoded JSON.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from hora.errors import ConfigError, LaunchError
from hora.runner.launch import launch
from hora.runner.launchers.sge import decode_config


def main(argv: Sequence[str] | None = None) -> int:
    """Run the encoded job; its exit status (2 when it cannot start, with the reason on stderr)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m hora.runner.sge_job JOB (the job hora run --launcher sge submits)", file=sys.stderr)
        return 2
    try:
        return launch(decode_config(args[0]))
    except (ConfigError, LaunchError) as e:
        print(f"hora run: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="hora run: %(message)s")
    raise SystemExit(main())
