"""Run hora jobs on Spark: ``hora.spark.run``, Horovod's ``horovod.spark.run`` interface, fed from DataFrames.

One barrier-mode Spark job places the ranks; each task starts its rank as a
child process with hora's environment, and the ranks meet through hora's own
rendezvous and gloo, as in ``hora run --gloo``; with ``use_mpi=True`` rank 0's
task runs mpirun over the tasks instead (:mod:`hora.spark.mpi`)::

    import hora.spark

    def train(epochs):
        import hora.torch as hvd
        hvd.init()
        part = hora.spark.data()          # this rank's share of df=
        for epoch in range(epochs):
            for batch in part.batches(256, shuffle=True, epoch=epoch):
                ...
        return hvd.rank()

    results = hora.spark.run(train, kwargs={"epochs": 5}, num_proc=4, df=df)  # one per rank, in rank order

Spark itself is imported only when a job starts; ``pip install 'hora[spark]'`` installs it.
"""

from __future__ import annotations

from hora.spark.driver import run
from hora.spark.partition import PartitionData
from hora.spark.share import data

__all__ = ["PartitionData", "data", "run"]
