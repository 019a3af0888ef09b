"""The programs ``hora bench`` launches with ``hora run``: one module per benchmark.

Each is run as ``python -m hora.bench.workers.NAME ...`` on every rank and
reports through :func:`hora.bench.jobs.emit` event lines (``progress`` from
rank 0, one ``result`` per rank).  They import torch or the KVStore only
inside the job, never in the driver.
"""
