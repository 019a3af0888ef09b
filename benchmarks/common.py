"""Shared plumbing of the benchmarks: the MPI world, a gloo group, timing, memory, tables.

Nothing here measures anything by itself.  The benchmark scripts run under
``mpirun -np N`` or ``hora run -np N --mpi``: the MPI world (mpi4py) is the
ground truth for rank and size, carries every barrier and result gather, and
lets rank 0 hand out the port of the TCPStore that the raw gloo group and DDP
rendezvous on.  ``mpi4py`` is imported lazily so that single-process helper
runs (the 1-process baselines) never start MPI.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import platform
import resource
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: Environment variables of a launcher; a child process must not see them or it would join the job.
LAUNCHER_ENV_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "OPAL_", "HORA_", "HOROVOD_", "MASTER_", "SLURM_",
                         "TORCHELASTIC_")
LAUNCHER_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK")


def load_example_models() -> ModuleType:
    """Import ``examples/torch/models.py`` (ResNet-18/50, MLP) without putting examples/ on sys.path."""
    path = REPO / "examples" / "torch" / "models.py"
    spec = importlib.util.spec_from_file_location("hora_example_models", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the example models from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- world


@dataclass(slots=True)
class World:
    """This process's place in the MPI job, on a private duplicate of ``COMM_WORLD``.

    The duplicate keeps the benchmark's own barriers and gathers off the
    communicator that hora's MPI engine may be using from its thread.
    """

    mpi: Any
    comm: Any
    rank: int
    size: int
    single_host: bool

    def barrier(self) -> None:
        """Blocking MPI barrier (spins; cheap on shared memory)."""
        self.comm.Barrier()

    def idle_barrier(self, poll_s: float = 0.01) -> None:
        """Barrier that sleeps while it waits, leaving the cores free for whoever is measuring."""
        req = self.comm.Ibarrier()
        while not req.Test():
            time.sleep(poll_s)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from ``root``."""
        return self.comm.bcast(obj, root=root)

    def gather(self, obj: Any) -> list[Any] | None:
        """Gather one object per rank on rank 0 (None elsewhere)."""
        return self.comm.gather(obj, root=0)

    def allmax(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over ranks: a collective lasts until its slowest rank is done."""
        buf = np.asarray(values, dtype=np.float64)
        out = np.empty_like(buf)
        self.comm.Allreduce(buf, out, op=self.mpi.MAX)
        return out.tolist()


def start_world() -> World:
    """Initialise MPI (thread level ``multiple``, as hora's engine thread needs) and describe the job.

    Raises:
        SystemExit: launched without MPI while a launcher says there are several ranks.
    """
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_size() == 1 and int(os.environ.get("HORA_SIZE", os.environ.get("WORLD_SIZE", "1"))) > 1:
        raise SystemExit("this benchmark needs an MPI world: launch it with `mpirun -np N python ...` "
                         "or `hora run -np N --mpi python ...`")
    hosts = comm.allgather(socket.gethostname())
    return World(mpi=MPI, comm=comm, rank=comm.Get_rank(), size=comm.Get_size(), single_host=len(set(hosts)) == 1)


def init_gloo(world: World, timeout_s: float = 120.0) -> None:
    """Create torch.distributed's default gloo group for the raw-gloo and DDP measurements.

    Rank 0 opens a TCPStore on a free port (port 0: the OS picks) and
    broadcasts the address and port over MPI; the others connect to it.  On
    one host everything goes over loopback.  hora's engine builds its own
    process groups, so it does not compete for the default group.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if world.single_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = None
    if world.rank == 0:
        addr = "127.0.0.1" if world.single_host else socket.gethostbyname(socket.gethostname())
        store = dist.TCPStore(addr, 0, world_size=world.size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        endpoint = (addr, store.port)
    else:
        endpoint = None
    addr, port = world.bcast(endpoint)
    if store is None:
        store = dist.TCPStore(addr, port, world_size=world.size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=world.rank, world_size=world.size, timeout=timeout)


def free_port_everywhere(world: World) -> tuple[str, int]:
    """An address and a currently free TCP port on rank 0, the same on every rank.

    The port is released before it is used, so another process could take it
    in between; on a quiet host that does not happen in practice.
    """
    endpoint = None
    if world.rank == 0:
        addr = "127.0.0.1" if world.single_host else socket.gethostbyname(socket.gethostname())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((addr, 0))
            endpoint = (addr, sock.getsockname()[1])
    return world.bcast(endpoint)


# --------------------------------------------------------------------------- timing


def time_repeats(world: World | None, fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    """Seconds per call of ``fn``, one entry per repeat, after ``warmup`` untimed calls.

    With a world, each repeat starts after a barrier and its time is the
    maximum over ranks, since a collective is only done when the last rank has
    its result.  Without one (a single process) the times are this process's.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if world is not None:
            world.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times if world is None else world.allmax(times)


def balanced_order(names: Sequence[str]) -> list[str]:
    """A cyclic order of ``names`` in which every case follows every other case exactly once.

    An Eulerian circuit of the complete directed graph on the cases (no
    self-loops), found with Hierholzer's algorithm: ``a b a c b c`` for three.
    Each case appears ``len(names) - 1`` times, once after each of the others,
    counting the wrap from the last entry back to the first.
    """
    names = list(names)
    if len(names) < 2:
        return names
    unused = {a: [b for b in reversed(names) if b != a] for a in names}
    stack, circuit = [names[0]], []
    while stack:
        here = stack[-1]
        if unused[here]:
            stack.append(unused[here].pop())
        else:
            circuit.append(stack.pop())
    circuit.reverse()
    return circuit[:-1]  # the circuit ends where it began


def time_interleaved(world: World, cases: dict[str, Callable[[], Any]], warmup: int,
                     repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each case, timed one call at a time in a balanced order, by cycle.

    Load drift on a shared host then hits every case alike, so ratios of
    paired values are steadier than ratios of cases timed one after another.
    What ran just before a call matters too: a 16 MiB MPI allreduce took
    11-15% longer right after a gloo allreduce than after another MPI one
    (caches, gloo's threads), and in a plain rotation of hora, raw MPI and
    raw gloo, hora followed gloo twice as often as raw MPI did, which put
    hora's paired 16 MiB ratio about 0.05 too high.  The calls here follow
    :func:`balanced_order`, in which every case follows every other case
    once per cycle, and each value returned is a case's mean over one cycle:
    value k of every case comes from the same cycle and the same mix of
    predecessors.  ``repeats`` calls per case make ``ceil(repeats / (n - 1))``
    cycles, at least two.
    """
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    order = balanced_order(list(cases))
    per_cycle = max(1, len(cases) - 1)
    cycles = max(2, -(-repeats // per_cycle))
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(cycles):
        cycle: dict[str, float] = {name: 0.0 for name in cases}
        for name in order:
            cycle[name] += time_repeats(world, cases[name], 0, 1)[0]
        for name in cases:
            times[name].append(cycle[name] / per_cycle)
    return times


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(values))


# --------------------------------------------------------------------------- memory


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set (``VmHWM``) to its current size.

    Writing ``5`` to ``/proc/self/clear_refs`` does this on Linux >= 4.0.
    Returns False where it is not possible; :func:`peak_rss_mib` then reports
    the lifetime peak.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mib() -> float:
    """Peak resident set of this process in MiB, since start or the last :func:`reset_peak_rss`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def current_rss_mib() -> float:
    """Current resident set of this process in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def foreign_cpu_load(world: World, seconds: float = 1.0) -> float:
    """Fraction of the host's CPU time used while every rank sleeps: other people's load.

    The benchmarks share their host with whatever else runs there; a busy
    host makes every number noisier, so the tables report this next to them.
    Rank 0 samples ``/proc/stat`` for ``seconds``; all ranks get the value.
    """
    def snapshot() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return idle, sum(fields[:8])  # guest time is already inside user time

    busy = float("nan")
    world.idle_barrier()
    if world.rank == 0:
        try:
            idle0, total0 = snapshot()
            time.sleep(seconds)
            idle1, total1 = snapshot()
            busy = 1.0 - (idle1 - idle0) / max(1, total1 - total0)
        except (OSError, ValueError, IndexError):
            pass
    else:
        time.sleep(seconds)
    world.idle_barrier()
    return world.bcast(busy)


def _host_busy_seconds() -> float:
    """CPU-seconds all processes on the host have run since boot: user + nice + system in ``/proc/stat``.

    Interrupt and softirq time is left out: loopback traffic of our own
    ranks lands there and cannot be told apart from anyone else's.
    """
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:4]]
    return sum(fields) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU-seconds used by this process (all threads) and its finished children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass(slots=True)
class CpuAccount:
    """Measures how much of the host's CPU other processes took while the benchmark ran.

    ``start()`` and ``foreign_share()`` are collective.  The foreign share is
    the host's busy CPU time minus all ranks' own CPU time, divided by the
    wall time times the number of cores.  Unlike a sample before and after,
    it also catches a job that ran in the middle.
    """

    world: World
    t0: float = 0.0
    host0: float = 0.0
    own0: float = 0.0

    def start(self) -> None:
        self.world.barrier()
        self.t0, self.host0, self.own0 = time.perf_counter(), _host_busy_seconds(), _own_cpu_seconds()

    def foreign_share(self) -> float:
        """Fraction of the host's total CPU capacity used by other processes since ``start()``."""
        own = self.world.comm.allreduce(_own_cpu_seconds() - self.own0)
        self.world.barrier()
        wall, host = time.perf_counter() - self.t0, _host_busy_seconds() - self.host0
        share = max(0.0, host - own) / max(1e-9, wall * (os.cpu_count() or 1))
        return self.world.bcast(share)


# --------------------------------------------------------------------------- allocator


def same_allocator_for_every_peer(tuned: bool = True) -> str:
    """Give this process (and, through the environment, its children) the malloc settings hora runs with.

    ``hvd.init()`` fixes glibc's mmap/trim thresholds (hora.core.allocator);
    the raw engines, DDP and the one-process baselines must run with the same
    allocator, or a ratio would measure malloc instead of the engines.  With
    ``tuned=False`` nobody tunes: ``HORA_MALLOC_TUNING=0`` reaches hora and the
    children.  Returns a line for the report.
    """
    from hora.core.allocator import tune_malloc, why_not_tune

    if not tuned or os.environ.get("HORA_MALLOC_TUNING") == "0":
        os.environ["HORA_MALLOC_TUNING"] = "0"
        return "malloc: glibc's dynamic thresholds for every peer (--no-malloc-tuning)"
    if tune_malloc(os.environ):
        return "malloc: every peer runs with hora's fixed glibc thresholds (hora.core.allocator)"
    return f"malloc: untouched for every peer ({why_not_tune(os.environ) or 'mallopt refused'})"


def release_free_memory() -> None:
    """Collect garbage and hand the heap's free pages back to the system (glibc ``malloc_trim``).

    With hora's fixed trim threshold a process keeps up to 64 MiB of freed
    heap; a benchmark phase that built throwaway models calls this so that the
    next phase's peak RSS is its own.
    """
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# --------------------------------------------------------------------------- child processes


def clean_child_env(threads: int) -> dict[str, str]:
    """This environment minus every launcher variable, with ``threads`` OpenMP/MKL threads."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_ENV_PREFIXES) and k not in LAUNCHER_ENV_NAMES}
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    if "HORA_MALLOC_TUNING" in os.environ:  # the allocator choice is every peer's, not a launcher's
        env["HORA_MALLOC_TUNING"] = os.environ["HORA_MALLOC_TUNING"]
    return env


def run_child(args: Sequence[str], threads: int, timeout_s: float) -> str:
    """Run a helper process outside the MPI job and return its stdout.

    Raises:
        RuntimeError: the child failed, with its exit status and the tail of its stderr.
    """
    proc = subprocess.run(list(args), env=clean_child_env(threads), capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"helper {' '.join(args)} exited with status {proc.returncode}:\n{tail}")
    return proc.stdout


# --------------------------------------------------------------------------- reporting


def fmt_bytes(n: int) -> str:
    """``4096`` -> ``4 KiB``; ``1 << 28`` -> ``256 MiB``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def fmt_seconds(s: float) -> str:
    """Seconds with a unit that keeps 3-4 significant digits."""
    if s != s:  # NaN
        return "—"
    if abs(s) < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if abs(s) < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def fmt_num(x: float | None, digits: int = 2) -> str:
    """A number with ``digits`` decimals, or an em dash for missing values."""
    if x is None or x != x:
        return "—"
    return f"{x:.{digits}f}"


def fmt_rate(x: float | None) -> str:
    """A bandwidth with 3 significant digits (``0.00412``, ``5.54``), or an em dash."""
    if x is None or x != x:
        return "—"
    return f"{x:.3g}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table; columns whose cells all start like numbers are right-aligned."""
    def numeric(col: int) -> bool:
        return bool(rows) and all(row[col][:1] in "0123456789-—" for row in rows)

    align = ["---:" if numeric(i) else ":---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(slots=True)
class MachineInfo:
    """Where and with what a benchmark ran; goes into the JSON and the table headers."""

    date: str
    hostname: str
    cpu_model: str
    nproc: int
    mem_gib: float
    python: str
    torch: str
    mpi_library: str
    ranks: int
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One-paragraph markdown description."""
        return (f"{self.date} on `{self.hostname}`: {self.cpu_model}, {self.nproc} cores (`nproc`), "
                f"{self.mem_gib:.0f} GiB RAM; Python {self.python}, torch {self.torch}, {self.mpi_library}; "
                f"{self.ranks} ranks, 1 torch thread per rank.")


def machine_info(world: World) -> MachineInfo:
    """Collect :class:`MachineInfo` for this host."""
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    lib = world.mpi.Get_library_version().strip().splitlines()[0].split(",")[0]
    return MachineInfo(
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        hostname=socket.gethostname(), cpu_model=cpu, nproc=os.cpu_count() or 0, mem_gib=mem,
        python=platform.python_version(), torch=torch.__version__, mpi_library=lib, ranks=world.size,
        extra={"rank0_cpu_affinity": sorted(os.sched_getaffinity(0))},
    )
