"""A rendezvous store whose values only the job can write: torch's TCPStore, signed by the job secret.

torch's ``TCPStore`` has no authentication: whoever reaches its port can
list, read, write and delete keys.  :class:`SignedStore` wraps it so that

* every value carries an HMAC-SHA256 of (key, value), keyed by the job
  secret, and a value that does not verify is never returned: the reader
  waits for a valid one (a legitimate writer overwrites a planted value)
  and fails with an error naming the key when none comes in time;
* keys live under a prefix derived from the secret, apart from anything
  else in the store;
* the hosting rank writes a signed job token, and every other rank checks
  it before joining (:func:`check_token`): a store that is not this job's
  (something else took the port first) is a clear error, not a hang.

What it cannot stop: an outsider who reaches the port can still delete or
overwrite keys (making the job fail with that error), or increment the
counters of ``add``, which it passes through unsigned.  docs/security.md
says what this means for ``--gloo`` jobs.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import time

import torch.distributed as dist

from hora.errors import BackendError

log = logging.getLogger(__name__)

_MAC = 32
_TOKEN_KEY = "hora/job"


def _key(secret: str, what: bytes) -> bytes:
    return hmac.new(secret.encode(), b"hora-store/" + what, hashlib.sha256).digest()


def prefix(secret: str) -> str:
    """The key prefix of the job whose secret is ``secret``."""
    return "hora-" + _key(secret, b"prefix")[:8].hex()


class SignedStore(dist.Store):
    """``inner`` (prefixed), with every value signed on write and verified on read."""

    def __init__(self, inner: dist.Store, secret: str, timeout_s: float) -> None:
        super().__init__()
        self._inner = dist.PrefixStore(prefix(secret), inner)
        self._mac_key = _key(secret, b"values")
        self._timeout_s = timeout_s
        self._warned: set[str] = set()

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._mac_key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def _seal(self, key: str, value: str | bytes) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return self._mac(key, data) + data

    def _open(self, key: str, raw: bytes) -> bytes | None:
        data = bytes(raw)
        if len(data) >= _MAC and hmac.compare_digest(data[:_MAC], self._mac(key, data[_MAC:])):
            return data[_MAC:]
        if key not in self._warned:
            self._warned.add(key)
            log.warning("rendezvous store: key %r holds a value this job did not sign (someone who can reach the "
                        "store wrote it); ignoring it and waiting for the job's own", key)
        return None

    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, self._seal(key, value))

    def get(self, key: str) -> bytes:
        """The value of ``key`` once a verified one is there.

        Raises:
            BackendError: only unsigned values appeared within the store timeout.
        """
        deadline = time.monotonic() + self._timeout_s
        while True:
            value = self._open(key, self._inner.get(key))
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise BackendError(f"rendezvous store: key {key!r} still holds a value not signed with this job's "
                                   f"HORA_SECRET after {self._timeout_s:g} s: something outside the job keeps "
                                   "writing it. Restrict access to the rendezvous port (see docs/security.md)")
            time.sleep(0.05)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        raw = self._inner.compare_set(key, self._seal(key, exp) if exp else b"", self._seal(key, desired))
        value = self._open(key, raw)
        return value if value is not None else b""

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)


def write_token(store: SignedStore) -> None:
    """Mark the store as this job's (the hosting rank, once)."""
    store.set(_TOKEN_KEY, b"hora job store")


def check_token(store: SignedStore, where: str) -> None:
    """Wait for the hosting rank's signed job token.

    Raises:
        BackendError: the store at ``where`` is not this job's, or rank 0 never marked it.
    """
    try:
        store.wait([_TOKEN_KEY])
        store.get(_TOKEN_KEY)
    except BackendError as e:
        raise BackendError(f"the rendezvous store at {where} is not this job's: {e}") from e
    except Exception as e:  # torch raises a bare RuntimeError on a store timeout
        raise BackendError(f"rank 0 did not mark the rendezvous store at {where} as this job's in time ({e}); "
                           "is rank 0 running with the same HORA_SECRET?") from e
