"""The environment variables between launchers and workers, named once.

``hora run`` (and every launcher under it) tells a worker everything through
the environment; :mod:`hora.core.topology` and :mod:`hora.config` read it
back.  Both sides use the constants below, so a name cannot drift on one side
only (``tests/unit/test_env_contract.py`` checks that what each launcher sets
is what a worker reads).  Each constant is spelled as the variable it names.

What a worker of ``hora run`` gets (the rank variables are added per worker,
see :meth:`hora.placement.Placement.env`):

==========================  ==================================================
``HORA_RANK`` ...           rank, size, local/cross rank and size, hostname
                            (:data:`WORKER_PLACEMENT`; with the ``HOROVOD_*``
                            copies horovodrun sets).  Not set under mpirun or
                            srun, whose own variables serve.
``HORA_CONTROLLER``         ``gloo`` or ``mpi``
``HORA_RENDEZVOUS_ADDR``    where rank 0 hosts the rendezvous store
``HORA_RENDEZVOUS_PORT``    a TCP port that was free when the launcher started
``HORA_SECRET``             random per-job secret (hex)
``HORA_FUSION_THRESHOLD``   bytes, only if ``--fusion-threshold-mb`` was given
``HORA_CYCLE_TIME``         ms, only if ``--cycle-time-ms`` was given
``HORA_TIMELINE``           only if ``--timeline-filename`` was given
``HORA_START_TIMEOUT``      seconds, only if ``--start-timeout`` was given
``HORA_NETWORK_INTERFACE``  and ``GLOO_SOCKET_IFNAME``, ``DMLC_INTERFACE``, with
                            ``--network-interface``
``OMP_NUM_THREADS``         cpus // local_size unless the user set it
``PYTHONUNBUFFERED``        ``1``, so output arrives line by line
``DMLC_*``                  with parameter servers (``-s S``, S > 0):
                            ``DMLC_ROLE`` (``worker`` here; servers and the
                            scheduler override it), ``DMLC_PS_ROOT_URI`` and
                            ``DMLC_PS_ROOT_PORT`` (the scheduler),
                            ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``;
                            ``DMLC_NODE_HOST`` per host on multi-host jobs;
                            ``HORA_PS_SERVER_INDEX`` for each server
==========================  ==================================================

On other hosts (ssh launcher, mpirun across hosts) a process gets the
variables with the prefixes of :data:`FORWARDED_PREFIXES` and the names of
:data:`FORWARDED_NAMES` from the launcher, and the rest from its own login
environment.

The knobs a user may set (engine, rendezvous, parameter server) are here too,
with the ``HOROVOD_*``, MXNet and ps-lite names hora accepts in their place,
and the variables of the other launchers whose jobs ``hvd.init()`` joins
(Open MPI, MPICH/Hydra, torchrun, srun).
"""

from __future__ import annotations

# -- where a worker sits: set per worker by hora run --------------------------------------------

HORA_RANK = "HORA_RANK"
HORA_SIZE = "HORA_SIZE"
HORA_LOCAL_RANK = "HORA_LOCAL_RANK"
HORA_LOCAL_SIZE = "HORA_LOCAL_SIZE"
HORA_CROSS_RANK = "HORA_CROSS_RANK"
HORA_CROSS_SIZE = "HORA_CROSS_SIZE"
HORA_HOSTNAME = "HORA_HOSTNAME"

#: The per-worker variables, in the order rank, size, local rank/size, cross rank/size, hostname.
WORKER_PLACEMENT = (
    HORA_RANK, HORA_SIZE, HORA_LOCAL_RANK, HORA_LOCAL_SIZE, HORA_CROSS_RANK, HORA_CROSS_SIZE, HORA_HOSTNAME,
)
#: horovodrun's names for the same values, set beside them for scripts and test suites written for Horovod.
HOROVOD_PLACEMENT = tuple(name.replace("HORA_", "HOROVOD_", 1) for name in WORKER_PLACEMENT)

# -- the job: set once for every process by hora run -------------------------------------------

HORA_CONTROLLER = "HORA_CONTROLLER"
HORA_RENDEZVOUS_ADDR = "HORA_RENDEZVOUS_ADDR"
HORA_RENDEZVOUS_PORT = "HORA_RENDEZVOUS_PORT"
HORA_SECRET = "HORA_SECRET"
HORA_NETWORK_INTERFACE = "HORA_NETWORK_INTERFACE"

# -- elastic jobs (hora run --host-discovery-script / --min-np / --max-np): set by the elastic driver --------

#: where the elastic driver (inside hora run) listens; the worker's ``init()`` asks it for a rank
HORA_ELASTIC_DRIVER_ADDR = "HORA_ELASTIC_DRIVER_ADDR"
HORA_ELASTIC_DRIVER_PORT = "HORA_ELASTIC_DRIVER_PORT"
#: the driver's name for one worker process, stable across its rendezvous rounds
HORA_ELASTIC_WORKER_ID = "HORA_ELASTIC_WORKER_ID"
#: the rendezvous round the worker's current ring belongs to (set in the worker by ``init()``)
HORA_ELASTIC_ROUND = "HORA_ELASTIC_ROUND"
#: seconds a worker waits for its next round, and the driver for --min-np slots (``--elastic-timeout``)
HORA_ELASTIC_TIMEOUT = "HORA_ELASTIC_TIMEOUT"
HOROVOD_ELASTIC_TIMEOUT = "HOROVOD_ELASTIC_TIMEOUT"
#: gloo's per-collective timeout in elastic jobs (seconds): how long a rank waits on a peer that
#: neither answers nor closes its connections (a host that vanished) before it raises
HORA_ELASTIC_COLLECTIVE_TIMEOUT = "HORA_ELASTIC_COLLECTIVE_TIMEOUT"

#: host-loss heartbeats (the launchers' per-host agents over ssh): seconds between beats, and the
#: silence after which a host counts as lost (see :class:`hora.config.HeartbeatConfig`)
HORA_HEARTBEAT_INTERVAL = "HORA_HEARTBEAT_INTERVAL"
HORA_HEARTBEAT_TIMEOUT = "HORA_HEARTBEAT_TIMEOUT"

#: What the elastic driver sets for each worker, beside :data:`JOB`.
ELASTIC_WORKER = (HORA_ELASTIC_DRIVER_ADDR, HORA_ELASTIC_DRIVER_PORT, HORA_ELASTIC_WORKER_ID)

#: What every process of a hora run job gets, whichever launcher started it.
JOB = (HORA_CONTROLLER, HORA_RENDEZVOUS_ADDR, HORA_RENDEZVOUS_PORT, HORA_SECRET)
#: What a worker started by hora's own processes (local, ssh) gets; under mpirun and srun
#: the tool's own rank variables take the place of :data:`WORKER_PLACEMENT`.
WORKER_ENV = WORKER_PLACEMENT + JOB

# -- engine knobs (the launcher sets the first four from its flags) ------------------------------

HORA_FUSION_THRESHOLD = "HORA_FUSION_THRESHOLD"
HORA_FUSION_THRESHOLD_MB = "HORA_FUSION_THRESHOLD_MB"
HORA_CYCLE_TIME = "HORA_CYCLE_TIME"
HORA_TIMELINE = "HORA_TIMELINE"
HORA_START_TIMEOUT = "HORA_START_TIMEOUT"
HORA_DIRECT_THRESHOLD = "HORA_DIRECT_THRESHOLD"
HORA_CACHE_CAPACITY = "HORA_CACHE_CAPACITY"
HORA_STALL_CHECK_DISABLE = "HORA_STALL_CHECK_DISABLE"
HORA_STALL_CHECK_TIME_SECONDS = "HORA_STALL_CHECK_TIME_SECONDS"
HORA_STALL_SHUTDOWN_TIME_SECONDS = "HORA_STALL_SHUTDOWN_TIME_SECONDS"
HORA_MPI_THREADS_DISABLE = "HORA_MPI_THREADS_DISABLE"
#: float16/bfloat16 on MPI's wire: 16-bit with hora's own reduction (1), as float32 (0), or 16-bit only when
#: the job spans hosts (auto, the default)
HORA_MPI_HALF_OPS = "HORA_MPI_HALF_OPS"
HORA_OVERLAP = "HORA_OVERLAP"
HORA_MALLOC_TUNING = "HORA_MALLOC_TUNING"
HORA_GLOO_DEVICES = "HORA_GLOO_DEVICES"
HORA_TIMELINE_MARK_CYCLES = "HORA_TIMELINE_MARK_CYCLES"
HORA_TIMELINE_MAX_MB = "HORA_TIMELINE_MAX_MB"
HORA_TIMELINE_ROTATE = "HORA_TIMELINE_ROTATE"
HORA_TIMELINE_ALL_RANKS = "HORA_TIMELINE_ALL_RANKS"
HORA_TIMELINE_QUEUE = "HORA_TIMELINE_QUEUE"
HORA_AUTOTUNE = "HORA_AUTOTUNE"
HORA_AUTOTUNE_LOG = "HORA_AUTOTUNE_LOG"
HORA_AUTOTUNE_WARMUP_SAMPLES = "HORA_AUTOTUNE_WARMUP_SAMPLES"
HORA_AUTOTUNE_STEPS_PER_SAMPLE = "HORA_AUTOTUNE_STEPS_PER_SAMPLE"
HORA_AUTOTUNE_MAX_SAMPLES = "HORA_AUTOTUNE_MAX_SAMPLES"
HORA_AUTOTUNE_SPACE = "HORA_AUTOTUNE_SPACE"

#: Horovod's names, accepted where hora's is not set.
HOROVOD_CONTROLLER = "HOROVOD_CONTROLLER"
HOROVOD_FUSION_THRESHOLD = "HOROVOD_FUSION_THRESHOLD"
HOROVOD_CYCLE_TIME = "HOROVOD_CYCLE_TIME"
HOROVOD_CACHE_CAPACITY = "HOROVOD_CACHE_CAPACITY"
HOROVOD_STALL_CHECK_DISABLE = "HOROVOD_STALL_CHECK_DISABLE"
HOROVOD_STALL_CHECK_TIME_SECONDS = "HOROVOD_STALL_CHECK_TIME_SECONDS"
HOROVOD_STALL_SHUTDOWN_TIME_SECONDS = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
HOROVOD_GLOO_TIMEOUT_SECONDS = "HOROVOD_GLOO_TIMEOUT_SECONDS"
HOROVOD_TIMELINE = "HOROVOD_TIMELINE"
HOROVOD_TIMELINE_MARK_CYCLES = "HOROVOD_TIMELINE_MARK_CYCLES"
HOROVOD_AUTOTUNE = "HOROVOD_AUTOTUNE"
HOROVOD_AUTOTUNE_LOG = "HOROVOD_AUTOTUNE_LOG"
HOROVOD_AUTOTUNE_WARMUP_SAMPLES = "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"
HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE = "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"
HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES = "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"
HOROVOD_MPI_THREADS_DISABLE = "HOROVOD_MPI_THREADS_DISABLE"
HOROVOD_GLOO_IFACE = "HOROVOD_GLOO_IFACE"

# -- gloo and torch.distributed -----------------------------------------------------------------

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

# -- the parameter server: MXNet / ps-lite names, which hora run sets, and hora's own ------------

DMLC_ROLE = "DMLC_ROLE"
DMLC_PS_ROOT_URI = "DMLC_PS_ROOT_URI"
DMLC_PS_ROOT_PORT = "DMLC_PS_ROOT_PORT"
DMLC_NUM_SERVER = "DMLC_NUM_SERVER"
DMLC_NUM_WORKER = "DMLC_NUM_WORKER"
DMLC_NODE_HOST = "DMLC_NODE_HOST"
DMLC_INTERFACE = "DMLC_INTERFACE"
DMLC_WORKER_ID = "DMLC_WORKER_ID"

#: The parameter-server job's variables: a nested launch must not inherit an outer job's.
PS_JOB = (DMLC_ROLE, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER, DMLC_NUM_WORKER, DMLC_NODE_HOST)

HORA_PS_ROLE = "HORA_PS_ROLE"
HORA_PS_ROOT_URI = "HORA_PS_ROOT_URI"
HORA_PS_ROOT_PORT = "HORA_PS_ROOT_PORT"
HORA_PS_NUM_SERVER = "HORA_PS_NUM_SERVER"
HORA_PS_NUM_WORKER = "HORA_PS_NUM_WORKER"
HORA_PS_INTERFACE = "HORA_PS_INTERFACE"
HORA_PS_NODE_HOST = "HORA_PS_NODE_HOST"
HORA_PS_SERVER_INDEX = "HORA_PS_SERVER_INDEX"
HORA_PS_BIGARRAY_BOUND = "HORA_PS_BIGARRAY_BOUND"
HORA_PS_PART_BYTES = "HORA_PS_PART_BYTES"
HORA_PS_RESEND_TIMEOUT_MS = "HORA_PS_RESEND_TIMEOUT_MS"
HORA_PS_TIMEOUT = "HORA_PS_TIMEOUT"
HORA_PS_HEARTBEAT_INTERVAL = "HORA_PS_HEARTBEAT_INTERVAL"
HORA_PS_START_TIMEOUT = "HORA_PS_START_TIMEOUT"
HORA_PS_SERVER_THREADS = "HORA_PS_SERVER_THREADS"
HORA_PS_TEST_DROP_REPLY_EVERY = "HORA_PS_TEST_DROP_REPLY_EVERY"
HORA_PS_SHM = "HORA_PS_SHM"
HORA_PS_SHM_MIN_BYTES = "HORA_PS_SHM_MIN_BYTES"
HORA_PS_ENCRYPT = "HORA_PS_ENCRYPT"
HORA_PS_MAX_FRAME_BYTES = "HORA_PS_MAX_FRAME_BYTES"
HORA_PS_OPTIMIZER_MODULES = "HORA_PS_OPTIMIZER_MODULES"
#: ``0`` turns off the fused C loops of the server optimizers (hora/kvstore/optimizer/fused.py)
HORA_PS_FUSED = "HORA_PS_FUSED"

#: hora.spark: the directory of a rank's spilled ``df=`` partition (set by its Spark task), and the
#: JSON manifest of row ranges when the ranks read a plain Parquet scan's files themselves.
HORA_SPARK_DATA = "HORA_SPARK_DATA"
HORA_SPARK_FILES = "HORA_SPARK_FILES"
MXNET_KVSTORE_BIGARRAY_BOUND = "MXNET_KVSTORE_BIGARRAY_BOUND"
PS_RESEND_TIMEOUT = "PS_RESEND_TIMEOUT"
PS_HEARTBEAT_TIMEOUT = "PS_HEARTBEAT_TIMEOUT"
PS_HEARTBEAT_INTERVAL = "PS_HEARTBEAT_INTERVAL"

# -- other launchers' variables, read so hvd.init() joins their jobs ----------------------------

OMPI_COMM_WORLD_RANK = "OMPI_COMM_WORLD_RANK"
OMPI_COMM_WORLD_SIZE = "OMPI_COMM_WORLD_SIZE"
OMPI_COMM_WORLD_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
OMPI_COMM_WORLD_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"
OMPI_COMM_WORLD_NODE_RANK = "OMPI_COMM_WORLD_NODE_RANK"
PMIX_RANK = "PMIX_RANK"
PMI_RANK = "PMI_RANK"
PMI_SIZE = "PMI_SIZE"
MPI_LOCALRANKID = "MPI_LOCALRANKID"
MPI_LOCALNRANKS = "MPI_LOCALNRANKS"
TORCHRUN_RANK = "RANK"
TORCHRUN_WORLD_SIZE = "WORLD_SIZE"
TORCHRUN_LOCAL_RANK = "LOCAL_RANK"
TORCHRUN_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
TORCHRUN_GROUP_RANK = "GROUP_RANK"
SLURM_PROCID = "SLURM_PROCID"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_LOCALID = "SLURM_LOCALID"
SLURM_NODEID = "SLURM_NODEID"
SLURM_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_NODELIST = "SLURM_NODELIST"
#: What the grid engine (SGE) sets in a parallel job: the granted hosts and slots, the job id, the PE's name.
PE_HOSTFILE = "PE_HOSTFILE"
JOB_ID = "JOB_ID"
PE = "PE"

#: Where the per-rank wrapper under mpirun or srun finds its rank; Open MPI first, because
#: mpirun inside a Slurm allocation inherits the batch step's ``SLURM_PROCID``.
MPI_RANK_VARIABLES = (OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK, SLURM_PROCID)

# -- the process -------------------------------------------------------------------------------

OMP_NUM_THREADS = "OMP_NUM_THREADS"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"

#: Variables with these prefixes travel to processes on other hosts (mpirun ``-x``, the ssh launcher).
FORWARDED_PREFIXES = ("HORA_", "HOROVOD_", "DMLC_", "GLOO_", "NCCL_")
#: ...and so do these, when set.
FORWARDED_NAMES = (OMP_NUM_THREADS, PYTHONUNBUFFERED, "PYTHONPATH", "PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
