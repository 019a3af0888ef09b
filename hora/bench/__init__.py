"""``hora bench``: measure allreduce, parameter servers and training, and compare with a cost model.

* :mod:`hora.bench.model`: the cost model (ring vs parameter server, scaling
  efficiency), and calibration of its CPU and loopback terms.
* :mod:`hora.bench.plan`, :mod:`.allreduce`, :mod:`.train`, :mod:`.kvstore`:
  one benchmark each; the measuring ones launch real ``hora run`` jobs of
  the programs in :mod:`hora.bench.workers`.
* :mod:`hora.bench.cli`: the ``hora bench`` command line.

It sits at the top layer beside :mod:`hora.runner`.  Importing it is light:
torch, matplotlib and the KVStore are imported only where they are used.
"""

from hora.bench.model import CostModel, Estimate, bus_bandwidth

__all__ = ["CostModel", "Estimate", "bus_bandwidth"]
