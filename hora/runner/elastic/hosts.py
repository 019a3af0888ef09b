"""The elastic driver's view of the hosts: what discovery offers, which hosts are blacklisted, and until when.

A host whose worker failed is blacklisted.  Without a cool-down range the
blacklist is permanent (horovodrun's behaviour); with
``--blacklist-cooldown-range MIN MAX`` the host may be tried again after a
cool-down with horovodrun's schedule: after the n-th failure of that host,
``MIN * 2**n`` plus a random fraction of MIN (so hosts that failed together
do not return together), kept between MIN and MAX.  Time and the jitter are
injectable, so the bookkeeping is tested without waiting.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class HostRecord:
    """What the driver knows of one host.

    Attributes:
        failures: how many times a worker on it failed.
        blacklisted_until: monotonic time the blacklist ends; ``inf`` for
            good, None when not blacklisted.
    """

    failures: int = 0
    blacklisted_until: float | None = None


class HostManager:
    """Discovered hosts minus the blacklisted ones, in the order they were first seen.

    Args:
        cooldown_range: ``(min, max)`` seconds of the exponential cool-down,
            or None for a permanent blacklist.
        clock: monotonic seconds (tests pass a fake one).
        jitter: a number in [0, 1) per blacklisting (tests pass a fixed one).
    """

    def __init__(self, cooldown_range: tuple[float, float] | None = None,
                 clock: Callable[[], float] = time.monotonic, jitter: Callable[[], float] = random.random) -> None:
        self.cooldown_range = cooldown_range
        self.clock = clock
        self.jitter = jitter
        self.discovered: dict[str, int] = {}
        self.records: dict[str, HostRecord] = {}
        self._order: dict[str, int] = {}

    def update(self, hosts: Mapping[str, int]) -> bool:
        """Take the hosts discovery found now (name -> slots); True when that changed anything."""
        for host in hosts:
            self._order.setdefault(host, len(self._order))
        changed = dict(hosts) != self.discovered
        self.discovered = dict(hosts)
        return changed

    def blacklist(self, host: str) -> float:
        """Record a failure of ``host`` and blacklist it; returns the cool-down in seconds (``inf``: for good)."""
        record = self.records.setdefault(host, HostRecord())
        record.failures += 1
        if self.cooldown_range is None:
            cooldown = float("inf")
        else:
            low, high = self.cooldown_range
            cooldown = max(low, min(high, low * 2 ** record.failures + self.jitter() * low))
        record.blacklisted_until = self.clock() + cooldown
        log.warning("blacklisting host %s after %d failure(s)%s", host, record.failures,
                    "" if cooldown == float("inf") else f" for {cooldown:g} s")
        return cooldown

    def is_blacklisted(self, host: str) -> bool:
        """Whether ``host`` is blacklisted now; a host whose cool-down has passed is taken off the list."""
        record = self.records.get(host)
        if record is None or record.blacklisted_until is None:
            return False
        if self.clock() >= record.blacklisted_until:
            record.blacklisted_until = None
            log.info("host %s has cooled down; it may run workers again", host)
            return False
        return True

    def available(self) -> dict[str, int]:
        """Usable hosts now (discovered, not blacklisted) -> slots, in first-seen order."""
        usable = {h: s for h, s in self.discovered.items() if not self.is_blacklisted(h)}
        return dict(sorted(usable.items(), key=lambda item: self._order[item[0]]))

    def all_blacklisted_for_good(self) -> bool:
        """True when every discovered host is blacklisted permanently: nothing can ever run again."""
        return bool(self.discovered) and all(
            (r := self.records.get(h)) is not None and r.blacklisted_until == float("inf") for h in self.discovered)

    def next_return(self) -> float | None:
        """Seconds until the next blacklisted host cools down, None if none will."""
        now = self.clock()
        ends = [r.blacklisted_until - now for h, r in self.records.items()
                if h in self.discovered and r.blacklisted_until not in (None, float("inf"))]
        return max(0.0, min(ends)) if ends else None
