"""TensorFlow's thread pools, sized for the ranks that share a host.

TensorFlow sizes its intra-op and inter-op pools for the whole machine, so N
ranks on one host oversubscribe its cores N times over, as torch's pools did.
Unless the user chose (``TF_NUM_INTRAOP_THREADS``/``TF_NUM_INTEROP_THREADS``,
or ``tf.config.threading`` before ``init()``), each rank gets cores / local
ranks threads in each pool, and hora says so once.
"""

from __future__ import annotations

import logging
import os

import tensorflow as tf

from hora.config import environ

log = logging.getLogger(__name__)

INTRA_ENV = "TF_NUM_INTRAOP_THREADS"
INTER_ENV = "TF_NUM_INTEROP_THREADS"
_done = False


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def threads_per_rank(local_size: int) -> int:
    """Cores available to this process divided by the ranks on this host (at least 1)."""
    return max(1, _cpus() // max(1, local_size))


def configure_threads(local_size: int) -> int | None:
    """Give TensorFlow ``threads_per_rank(local_size)`` threads per pool unless the user chose.

    Returns:
        The number of threads set, or None when the user's choice (or an
        already-running TensorFlow) was left alone.
    """
    global _done
    if _done:
        return None
    _done = True
    env = environ()
    if env.get(INTRA_ENV) or env.get(INTER_ENV):
        return None
    if (tf.config.threading.get_intra_op_parallelism_threads() or
            tf.config.threading.get_inter_op_parallelism_threads()):
        return None
    n = threads_per_rank(local_size)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(n)
        tf.config.threading.set_inter_op_parallelism_threads(n)
    except RuntimeError:
        log.warning("hora: TensorFlow was already running when hvd.init() was called, so its thread pools keep "
                    "their size for the whole machine; call hvd.init() before creating tensors, or set %s and %s",
                    INTRA_ENV, INTER_ENV)
        return None
    log.info("hora: TensorFlow gets %d intra-op and %d inter-op thread(s) per process (%d CPUs / %d local "
             "rank(s)); set %s/%s to choose", n, n, _cpus(), local_size, INTRA_ENV, INTER_ENV)
    return n
