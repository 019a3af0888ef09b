"""An elastic worker's standing line to the driver, on which the driver says "leave the ring now".

After each rendezvous the worker opens one more authenticated connection to
the driver (:mod:`hora.elastic_wire`) and says which round it runs in.  The
driver watches each remote host with its own beat-only agent (a worker
cannot be the one to beat: while gloo connects it holds Python's GIL for
seconds).  When the driver decides a member of the round is gone (its host
stopped answering, or discovery dropped it) it sends the survivors ``{"abort": reason, "round",
"addrs"}`` on this line.  A collective blocked on a vanished peer would wait
for gloo's timeout (``HORA_ELASTIC_COLLECTIVE_TIMEOUT``); instead the worker
shuts down (``shutdown(2)``, the descriptors stay gloo's) its TCP
connections to the round's hosts, so gloo's next read sees the connection
end, the engine raises :class:`~hora.errors.InternalError`, and
``hvd.elastic.run`` restores and joins the next round.  The driver's own
connections and the round's rendezvous store are left alone.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from collections.abc import Collection

from hora import elastic_wire
from hora.config import ElasticConfig
from hora.errors import AuthError

log = logging.getLogger(__name__)


def shut_connections(addrs: Collection[str], keep_ports: Collection[int]) -> int:
    """Shut down this process's TCP connections to ``addrs``, except those on ``keep_ports``; returns how many.

    The descriptors stay open (they belong to whoever made them): only the
    connection ends, so a thread blocked reading it wakes up with an end of
    stream at once.  Linux only (``/proc/self/fd``); elsewhere nothing is done.
    """
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    count = 0
    for name in names:
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            peer, local = sock.getpeername(), sock.getsockname()
            if peer[0] in addrs and peer[1] not in keep_ports and local[1] not in keep_ports:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            continue  # not connected, or already gone
        finally:
            sock.close()  # the duplicate only
    return count


class DriverWatch:
    """The standing connection of one worker in one round (see the module docstring).

    Args:
        config: the worker's elastic config (driver address, id, secret).
        round_: the round this worker now runs in.
        keep_ports: ports whose connections an abort leaves open (the round's store).
    """

    def __init__(self, config: ElasticConfig, round_: int, keep_ports: Collection[int] = ()) -> None:
        self.config = config
        self.round = round_
        self.keep_ports = {int(config.driver_port or 0), *keep_ports}
        self.aborted: str | None = None
        self._stopped = threading.Event()
        self._channel = elastic_wire.connect(str(config.driver_addr), int(config.driver_port or 0),
                                             str(config.secret), timeout=30.0)
        self._channel.sock.settimeout(None)
        self._channel.send({"op": "watch", "worker": config.worker_id, "round": round_})
        threading.Thread(target=self._listen, name="hora-elastic-watch", daemon=True).start()

    def _listen(self) -> None:
        while not self._stopped.is_set():
            try:
                message = self._channel.recv()
            except (OSError, elastic_wire.WireError, AuthError):
                return
            if "abort" not in message or int(message.get("round", -1)) != self.round:
                continue
            # Under the lock, and only while this is still the running round's watch: once follow() has
            # replaced it, the next round's connections exist or are being made, and must not be cut.
            with _switch:
                if self._stopped.is_set():
                    return
                self.aborted = str(message["abort"])
                shut = shut_connections(set(message.get("addrs", ())), self.keep_ports)
            log.warning("elastic round %d aborted by the driver: %s; %d connection(s) shut down",
                        self.round, self.aborted, shut)

    def close(self) -> None:
        """Close the line (shut down first: the listener thread blocked in ``recv`` must not keep it open)."""
        self._stopped.set()
        try:
            self._channel.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._channel.close()


_watch: DriverWatch | None = None
#: Held while an abort shuts connections and while follow() retires the previous round's watch.
_switch = threading.Lock()


def follow(config: ElasticConfig, round_: int, store_port: int) -> None:
    """Replace the previous round's watch by one for ``round_``; a driver that cannot be reached is only logged.

    The watch is a fast path: without it a vanished peer is still given up
    after ``HORA_ELASTIC_COLLECTIVE_TIMEOUT``.
    """
    global _watch
    stop()
    try:
        _watch = DriverWatch(config, round_, keep_ports=(store_port,))
    except (OSError, elastic_wire.WireError, AuthError) as e:
        log.warning("no watch line to the elastic driver (%s): a lost host is given up only after "
                    "HORA_ELASTIC_COLLECTIVE_TIMEOUT", e)


def stop() -> None:
    """Close the current watch, if any."""
    global _watch
    with _switch:
        if _watch is not None:
            _watch.close()
            _watch = None
