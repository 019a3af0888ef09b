"""``python -m hora.spark.rsh_agent AGENTS_FILE HOST COMMAND...``: the rsh agent mpirun runs in place of ssh.

The agent itself is :func:`hora.spark.rsh.main`; this module only starts it.
It lies outside what ``import hora.spark`` loads, so that ``python -m``
does not find it imported already (which makes Python warn on every start).
"""

from __future__ import annotations

import sys

from hora.spark.rsh import main

if __name__ == "__main__":
    sys.exit(main())
