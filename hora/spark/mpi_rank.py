"""Under hora.spark's MPI mode, what mpirun starts for each rank: it becomes the program its Spark task prepared.

mpirun runs one command line for every rank, ``python -m
hora.runner.mpi_child -- python -m hora.spark.mpi_rank``; what differs
between ranks (the task's directory with the pickled function and the
partition of ``df=``, the rank variables, the GPUs) comes in
:data:`hora.spark.mpi.RANKS_VAR`, a table built by rank 0's task with one entry per rank.
This module looks up its rank (Open MPI's ``OMPI_COMM_WORLD_RANK``),
checks that mpirun started it on the host hora placed it on (the task's
directory exists here), sets the entry's variables and ``exec``\\ s the
entry's command, so the result file lands in that task's directory.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Sequence

from hora.runner.mpi_child import rank_from_env
from hora.spark.mpi import RANKS_VAR, decode_table


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m hora.spark.mpi_rank`` under mpirun; exec's this rank's own command."""
    rank = rank_from_env(os.environ)
    try:
        entries = decode_table(os.environ[RANKS_VAR])
    except (KeyError, ValueError, zlib.error) as e:
        sys.stderr.write(f"hora.spark: rank {rank} has no readable {RANKS_VAR} ({e}); it is set by hora.spark.run "
                         "with use_mpi=True only\n")
        return 2
    if not 0 <= rank < len(entries):
        sys.stderr.write(f"hora.spark: mpirun started rank {rank}, but the job has {len(entries)} ranks\n")
        return 2
    entry = entries[rank]
    if not os.path.isdir(entry["dir"]):
        sys.stderr.write(
            f"hora.spark: mpirun started rank {rank} on {os.uname().nodename}, but hora placed it with the Spark task "
            f"whose directory {entry['dir']} is not on this host: mpirun's rank mapping differs from hora's "
            "(remove --map-by/--rank-by/-H options from extra_mpi_args)\n")
        return 2
    env = {k: v for k, v in os.environ.items() if k != RANKS_VAR}
    env.update(entry["env"])
    argv_ = [str(a) for a in entry["argv"]]
    sys.stdout.flush()
    try:
        os.execve(argv_[0], argv_, env)
    except OSError as e:
        sys.stderr.write(f"hora.spark: rank {rank} cannot start {argv_[0]!r}: {e.strerror or e}\n")
    return 127


if __name__ == "__main__":
    sys.exit(main())
