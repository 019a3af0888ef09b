"""Per-rank output: prefix each line, keep a tail for the root-cause report, log to files.

Workers' lines reach the launcher's own stdout/stderr as
``[rank]<stdout>:text`` / ``[rank]<stderr>:text`` (Horovod's format);
parameter servers' and the scheduler's as ``[server 0]<stdout>:text`` and
``[scheduler]<stdout>:text``.  Each
line is written with one call under a lock, so lines of different ranks never
interleave.  Bytes are passed through unchanged where the stream allows it, so
a worker's non-UTF-8 output survives.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
from typing import IO, BinaryIO, TextIO

from hora.runner.keys import Key, parse_key

logger = logging.getLogger(__name__)

STREAMS = ("stdout", "stderr")
#: Lines of each rank's stderr kept for the root-cause report.
TAIL_LINES = 20
#: Parses a line that already carries a prefix (the mpi wrapper and the ssh agent write these).
PREFIXED_LINE = re.compile(rb"^\[(\d+|server \d+|scheduler)\]<(stdout|stderr)>:")


def prefix(key: Key, stream: str) -> bytes:
    """The prefix of a process's line, e.g. ``b"[1]<stderr>:"`` or ``b"[server 0]<stdout>:"``."""
    return f"[{key}]<{stream}>:".encode()


def split_prefixed(line: bytes) -> tuple[Key, str, bytes] | None:
    """``(key, stream, payload)`` of a prefixed line, or None if it has no prefix."""
    match = PREFIXED_LINE.match(line)
    if match is None:
        return None
    return parse_key(match.group(1).decode()), match.group(2).decode(), line[match.end():]


def log_directory(key: Key) -> str:
    """The ``--output-filename`` subdirectory of a process: ``rank.3``, ``server.0``, ``scheduler``."""
    return f"rank.{key}" if isinstance(key, int) else str(key).replace(" ", ".")


def write_bytes(stream: TextIO | IO[str], data: bytes) -> None:
    """Write raw bytes to a text stream, through its binary buffer when it has one."""
    buffer: BinaryIO | None = getattr(stream, "buffer", None)
    if buffer is not None:
        stream.flush()  # keep order with text already written to the stream
        buffer.write(data)
        buffer.flush()
    else:
        stream.write(data.decode("utf-8", errors="replace"))
        stream.flush()


class OutputSink:
    """Where every worker line goes: the launcher's streams, a tail, a log file.

    Args:
        stdout: the launcher's stdout (workers' stdout lines go there).
        stderr: the launcher's stderr.
        log_dir: if set, raw lines are also written to ``log_dir/rank.N/stdout``
            and ``.../stderr``.
    """

    def __init__(self, stdout: TextIO, stderr: TextIO, log_dir: str | None = None) -> None:
        self._targets = {"stdout": stdout, "stderr": stderr}
        self._lock = threading.Lock()
        self._tails: dict[Key, collections.deque[str]] = {}
        self._log_dir = log_dir
        self._logs: dict[tuple[Key, str], BinaryIO] = {}
        self._broken = False

    def emit(self, rank: Key, stream: str, payload: bytes) -> None:
        """Print one line of process ``rank``'s ``stream`` (``payload`` without prefix)."""
        if not payload.endswith(b"\n"):
            payload += b"\n"
        with self._lock:
            if stream == "stderr":
                tail = self._tails.setdefault(rank, collections.deque(maxlen=TAIL_LINES))
                tail.append(payload.decode("utf-8", errors="replace").rstrip("\r\n"))
            if self._log_dir is not None:
                self._log(rank, stream, payload)
            self._write(stream, prefix(rank, stream) + payload)

    def emit_raw(self, stream: str, line: bytes) -> None:
        """Print a line that belongs to no rank (e.g. mpirun's own messages) unchanged."""
        if not line.endswith(b"\n"):
            line += b"\n"
        with self._lock:
            self._write(stream, line)

    def tail(self, rank: Key) -> list[str]:
        """The last :data:`TAIL_LINES` lines process ``rank`` wrote to stderr."""
        with self._lock:
            return list(self._tails.get(rank, ()))

    def close(self) -> None:
        """Close the per-rank log files."""
        with self._lock:
            for f in self._logs.values():
                f.close()
            self._logs.clear()

    def _write(self, stream: str, data: bytes) -> None:
        if self._broken:
            return
        try:
            write_bytes(self._targets[stream], data)
        except (BrokenPipeError, ValueError):
            # Our reader went away (``hora run ... | head``) or the stream was
            # closed: keep draining the workers' pipes so they never block.
            self._broken = True

    def _log(self, rank: Key, stream: str, payload: bytes) -> None:
        f = self._logs.get((rank, stream))
        if f is None:
            directory = os.path.join(self._log_dir, log_directory(rank))  # type: ignore[arg-type]
            os.makedirs(directory, exist_ok=True)
            f = self._logs[(rank, stream)] = open(os.path.join(directory, stream), "ab")
        f.write(payload)
        f.flush()


def pump(pipe: BinaryIO, on_line) -> threading.Thread:
    """Start a daemon thread that calls ``on_line(bytes)`` for each line of ``pipe``."""

    def run() -> None:
        try:
            for line in iter(pipe.readline, b""):
                on_line(line)
        except (OSError, ValueError) as e:  # pipe closed under us at shutdown
            logger.debug("output pump stopped: %s", e)
        finally:
            pipe.close()

    thread = threading.Thread(target=run, name="hora-output", daemon=True)
    thread.start()
    return thread
