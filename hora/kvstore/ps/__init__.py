"""hora's parameter server, after ps-lite: a scheduler, servers and workers over ZeroMQ.

* :mod:`~hora.kvstore.ps.wire`: the message format (msgpack header, raw array
  frames, HMAC-SHA256 keyed by the job secret).
* :mod:`~hora.kvstore.ps.secure`: who may connect: authentication at the
  ZeroMQ handshake (PLAIN with an address-bound token, or CURVE), keyed by
  the job secret; see docs/security.md.
* :mod:`~hora.kvstore.ps.shm`: the shared-memory data path between peers on
  one host (headers still signed; payloads skip the socket and the hashing).
* :mod:`~hora.kvstore.ps.scheduler`: membership, barriers, failure detection.
* :mod:`~hora.kvstore.ps.server` and :mod:`~hora.kvstore.ps.keys`: a server
  and its per-key state machines.
* :mod:`~hora.kvstore.ps.client`: the worker's connection, used by
  :class:`hora.kvstore.dist.DistKVStore`.
* :mod:`~hora.kvstore.ps.node`: ``python -m hora.kvstore.ps.node`` runs a
  scheduler or a server from the ``DMLC_*`` environment.
"""
