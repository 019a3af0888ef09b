"""``local`` and ``device``: a KVStore inside one process, over several devices.

MXNet's semantics:

* ``push(key, [v0, v1, ...])`` sums the values (one per device).  ``local``
  sums on the CPU; ``device`` sums on the first value's device, and the stored
  value moves there.
* With an optimizer (:meth:`LocalKVStore.set_optimizer`) the sum is the
  gradient and the stored value the weight, updated once per push.  Without
  one the sum replaces the stored value (MXNet's default ``ASSIGN`` updater).
* ``pull(key, out=[o0, o1, ...])`` copies the stored value into every out,
  on its own device.

A key keeps the dtype it was initialised with: pushed values are converted
to it and pulls convert from it.  Gradient compression is refused for
``local`` and implemented for ``device`` (each device's value is quantised
with its own residual, decoded and summed), as in MXNet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hora.errors import ConfigError
from hora.kvstore.arrays import Array, add_into, converted, copy_into, copy_of, device_of, numpy_of
from hora.kvstore.held import HeldKVStore


def check_work_load_list(work_load_list: Sequence[float]) -> list[float]:
    """``work_load_list`` as a list, after checking that it is a non-empty list of positive numbers."""
    loads = list(work_load_list) if isinstance(work_load_list, (list, tuple)) else []
    if not loads or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 for w in loads):
        raise ConfigError(f"work_load_list must be a non-empty list of positive numbers, got {work_load_list!r}")
    return loads


def split_input_slice(batch_size: int, work_load_list: Sequence[float]) -> list[slice]:
    """Split ``batch_size`` samples into one slice per device, proportional to ``work_load_list``.

    MXNet's ``_split_input_slice``: each share is ``round(load * batch / total)``
    (Python's rounding), the last one takes what rounding left over, and the
    slices are clipped to the batch.

    Raises:
        ConfigError: a load is not positive, or a slice would be empty (more
            devices than the batch can feed).
    """
    loads = check_work_load_list(work_load_list)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size must be a positive int, got {batch_size!r}")
    total = sum(loads)
    counts = [round(w * batch_size / total) for w in loads]
    if sum(counts) < batch_size:
        counts[-1] += batch_size - sum(counts)
    slices = []
    end = 0
    for i, count in enumerate(counts):
        begin = min(end, batch_size)
        end = min(begin + count, batch_size)
        if begin >= end:
            raise ConfigError(f"a batch of {batch_size} split by work_load_list {loads} leaves device {i} "
                              "no samples; use a larger batch or fewer devices")
        slices.append(slice(begin, end))
    return slices


class LocalKVStore(HeldKVStore):
    """The ``local`` / ``device`` store.  Create it with ``hora.kvstore.create('local')``.

    Args:
        kv_type: ``local`` or ``device``.
        work_load_list: relative speeds of the devices a batch is split over
            (see :meth:`split_batch`); None for an even split.
    """

    def __init__(self, kv_type: str = "local", work_load_list: Sequence[float] | None = None) -> None:
        if kv_type not in ("local", "device"):
            raise ConfigError(f"LocalKVStore serves 'local' and 'device', not {kv_type!r}")
        super().__init__(kv_type)
        self.work_load_list = None if work_load_list is None else check_work_load_list(work_load_list)

    # --- MXNet API ------------------------------------------------------------------------------
    def _set_updater(self, updater: Callable[[Any, Array, Array], None]) -> None:
        """Use a custom ``updater(key, merged, stored)`` (MXNet's ``_set_updater``); key as the user gave it."""
        if not callable(updater):
            raise ConfigError(f"updater must be callable, got {type(updater).__name__}")
        self._updater = updater

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """2-bit compression of each device's value before the sum (``device`` only, as in MXNet)."""
        if self._type == "local":
            raise ConfigError("gradient compression is not supported by the 'local' KVStore (MXNet neither); "
                              "use 'device' or a dist type")
        super().set_gradient_compression(compression_params)

    def split_batch(self, batch_size: int, num_devices: int | None = None) -> list[slice]:
        """Slices of a batch per device, by ``work_load_list`` (even when none was given)."""
        loads = self.work_load_list or [1] * (num_devices or 1)
        if num_devices is not None and len(loads) != num_devices:
            raise ConfigError(f"work_load_list has {len(loads)} entries but there are {num_devices} devices")
        return split_input_slice(batch_size, loads)

    # --- hooks ----------------------------------------------------------------------------------
    def _init(self, keys: list[str], values: list[Array]) -> None:
        for key in keys:
            if key in self._store:
                raise ConfigError(f"key {self._user_key(key)!r} is already initialised; init() each key once")
        for key, value in zip(keys, values, strict=True):
            self._store[key] = copy_of(value, device=None if self._type == "device" else "cpu")

    def _push(self, keys: list[str], values: list[list[Array]], priority: int) -> None:
        for key, vals in zip(keys, values, strict=True):
            stored = self._stored(key, "push")
            self._check_shapes(key, vals, stored, "pushed")
            self._apply(key, self._reduce(key, vals, stored), stored)

    def _pull(self, keys: list[str], outs: list[list[Array]], priority: int) -> None:
        for key, targets in zip(keys, outs, strict=True):
            stored = self._stored(key, "pull")
            self._check_shapes(key, targets, stored, "out")
            for out in targets:
                copy_into(out, stored)

    # --- internals --------------------------------------------------------------------------------
    def _reduce(self, key: str, vals: list[Array], stored: Array) -> Array:
        """The sum of ``vals`` as a fresh array of the key's dtype, on the CPU (``local``) or on
        the first value's device (``device``; a NumPy-initialised key always sums on the CPU)."""
        device = device_of(vals[0]) if self._type == "device" else "cpu"
        if self._compressor is not None:
            vals = [self._roundtrip(f"{key}@{i}", v) for i, v in enumerate(vals)]
        merged = copy_of(vals[0], like=stored, device=device)
        for v in vals[1:]:
            add_into(merged, v)
        return merged

    def _roundtrip(self, name: str, value: Array) -> Array:
        """What a compressed push of ``value`` delivers: quantised with the device's residual, decoded."""
        host = numpy_of(value)
        packed = self._compressor.compress(name, host)
        decoded = self._compressor.decompress(packed, host.size).reshape(host.shape)
        return decoded if device_of(value) == "cpu" else converted(decoded, value)


__all__ = ["LocalKVStore", "check_work_load_list", "split_input_slice"]
