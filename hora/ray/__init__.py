"""Run hora jobs on a Ray cluster: ``RayExecutor``, Horovod's ``horovod.ray`` interface.

Ray places the workers (one actor per rank, in a placement group); hora's own
rendezvous and collectives run between them, as in ``hora run --gloo``::

    import ray
    from hora.ray import RayExecutor

    ray.init(address="auto")
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=4)
    executor.start()
    results = executor.run(train, kwargs={"epochs": 5})   # one per rank, in rank order
    executor.shutdown()

Ray itself is imported only when an executor starts; ``pip install 'hora[ray]'`` installs it.
"""

from __future__ import annotations

from hora.ray.executor import RayExecutor
from hora.ray.plan import RaySettings
from hora.ray.worker import Worker

#: Horovod's name for the worker actor's class.
BaseHorovodWorker = Worker

__all__ = ["BaseHorovodWorker", "RayExecutor", "RaySettings", "Worker"]
