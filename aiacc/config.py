"""All of aiacc's runtime options, read from ``AIACC_*`` environment variables.

This module is the only reader of ``AIACC_*`` variables (and of the few MPI
launcher variables aiacc looks at). Everything else receives a
:class:`Config`. Each option has one environment variable and one
``aiaccrun`` flag, both listed in :data:`OPTIONS`; the README's table is made
from the same list (``python -m aiacc.config --markdown``).

A bad value is a :class:`~aiacc.exceptions.ConfigError` that names the
variable and what it accepts; an unknown ``AIACC_*`` variable is an error too,
so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Callable, FrozenSet, Mapping, Optional, Tuple

from .exceptions import ConfigError

__all__ = ["Config", "Option", "OPTIONS", "from_env", "parse_bytes", "mpi_world_size_hint", "launched_as"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
}


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def parse_bytes(text: str) -> int:
    """``"64MiB"``, ``"4M"``, ``"1048576"`` -> bytes (binary units for *iB, decimal otherwise)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError("expected a size in bytes such as 67108864, 64MiB or 4MB")
    value = float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    if value < 0:
        raise ValueError("expected a size >= 0")
    if 0 < value < 1:  # (it was 0: the setting turned off -- fusion, partitions, the credit bound -- without a word)
        raise ValueError("expected 0 or a size of at least one byte")
    if value != int(value):  # (2.5 was 2 bytes without a word)
        raise ValueError(f"expected a whole number of bytes (got {value:g})")
    return int(value)


def _pos_bytes(text: str) -> int:
    v = parse_bytes(text)
    if v <= 0:
        raise ValueError("expected a size in bytes > 0 such as 26214400 or 25MiB")
    return v


MAX_SECONDS = 1e9  # ~31 years; 1e10 passed and overflowed a timed wait (the start timeout's watchdog died)


def _seconds(text: str) -> float:
    v = float(text)
    if not 0 <= v <= MAX_SECONDS:
        raise ValueError(f"expected a number of seconds from 0 to {MAX_SECONDS:g}")
    return v


def _pos_float(text: str) -> float:
    v = float(text)
    if not v > 0 or v == float("inf"):
        raise ValueError("expected a finite number > 0")
    return v


MAX_CYCLE_TIME_MS = 60_000.0  # a minute; beyond ~1e19 ms a timed wait overflows (the engine thread died)
MAX_CACHE_CAPACITY = 1 << 20  # held up front: ~50 B per entry; 1e12 was a MemoryError deep in the engine


def _cycle_ms(text: str) -> float:
    v = float(text)
    if not 0 < v <= MAX_CYCLE_TIME_MS:
        raise ValueError(f"expected a number of milliseconds > 0 and at most {MAX_CYCLE_TIME_MS:.0f}")
    return v


def _cache_capacity(text: str) -> int:
    v = int(text)
    if not 0 <= v <= MAX_CACHE_CAPACITY:
        raise ValueError(f"expected a whole number from 0 to {MAX_CACHE_CAPACITY}")
    return v


MAX_WHOLE = 2 ** 31 - 1  # (a larger one passed, and the ranks' start-up shell could not compare it)


def _pos_int(text: str) -> int:
    v = int(text)
    if not 0 < v <= MAX_WHOLE:
        raise ValueError(f"expected a whole number from 1 to {MAX_WHOLE}")
    return v


def _nonneg_int(text: str) -> int:
    v = int(text)
    if not 0 <= v <= MAX_WHOLE:
        raise ValueError(f"expected a whole number from 0 to {MAX_WHOLE}")
    return v


def _log_level(text: str) -> str:
    t = text.strip().upper()
    t = {"TRACE": "DEBUG", "FATAL": "ERROR"}.get(t, t)  # Horovod's names for its levels
    if t not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise ValueError("expected one of debug, info, warning, error, critical (or Horovod's trace, fatal)")
    return t


def _path(text: str) -> str:
    return text.strip()


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: its field in :class:`Config`, its variable, its flag."""

    field: str
    env: str
    flag: str
    parse: Callable[[str], object]
    accepts: str
    default_text: str
    help: str
    # aiaccrun flags that take a value in another unit convert it here into
    # the variable's own text (e.g. --fusion-threshold-mb 64 -> 67108864).
    flag_to_env: Optional[Callable[[str], str]] = None
    flag_takes_value: bool = True


@dataclasses.dataclass(frozen=True)
class Config:
    """aiacc's runtime configuration (immutable; built by :func:`from_env`)."""

    enable: bool = False
    """Use the engine at all. Off: ``init()`` gives rank 0 of 1, MPI is not
    started, collectives return their input and ``DistributedOptimizer``
    returns the user's own optimizer. ``aiaccrun`` sets it to 1."""

    fusion_threshold: int = 64 << 20
    """Largest fusion buffer in bytes; 0 disables fusion (one collective per tensor)."""

    bucket_cap: int = 25 << 20
    """Largest gradient bucket in bytes (DDP's ``bucket_cap_mb``). An optimizer wrapper assigns its
    parameters to buckets once, in the order their gradients arrive; each bucket is reduced as one
    buffer when its last gradient is ready. The first bucket (the last layers) holds at most
    1 MiB, so communication starts early in backward."""

    cycle_time_ms: float = 1.0
    """Time between two negotiation cycles of the background thread."""

    cache_capacity: int = 1024
    """Tensors remembered by the response cache; once agreed, a cached tensor is
    negotiated by one bit of a bitwise-AND allreduce. 0 disables the cache."""

    timeline: str = ""
    """Write a Chrome/Perfetto trace of every tensor's phases to this file."""

    timeline_mark_cycles: bool = False
    """Mark every cycle's start in the timeline (a ``CYCLE_START`` instant event)."""

    timeline_all_ranks: bool = False
    """Write a timeline on every rank (``FILE`` becomes ``FILE.rank<N>``), not only rank 0."""

    summary: bool = False
    """Rank 0 prints what its engine did (``aiacc.summary()``) when aiacc shuts down."""

    stall_check_seconds: float = 60.0
    """Warn, naming the missing ranks, about tensors that some ranks submitted and
    others did not within this many seconds; 0 disables the check."""

    stall_shutdown_seconds: float = 1800.0
    """End every rank with a StallError naming the tensor and the ranks once a tensor has stalled this
    long (by default 30 minutes: a job never waits forever); 0 = wait forever."""

    start_timeout: float = 120.0
    """How long a rank waits in MPI's start-up for every other rank of the job (horovodrun's
    ``--start-timeout``): a rank that exits or hangs before ``init()`` ends the job with an error instead of
    a hang; 0 waits forever."""

    partition_bytes: int = 0
    """Split allreduces larger than this into partitions scheduled separately
    (so urgent tensors do not wait behind a big one); 0 = no partitioning."""

    priority: bool = True
    """Send the tensors the next forward pass needs first (by the priority
    adapters give: layers near the input first)."""

    overlap_forward: bool = False
    """PyTorch: apply each parameter's update in the forward pre-hook of its module, so the
    next forward pass starts while later layers' gradients are still being averaged."""

    check_same_start: bool = True
    """Optimizer wrappers compare the parameters' values across the ranks once, at the second optimizer step
    (one small collective), and warn on every rank, naming the parameters and the ranks, when they differ:
    the broadcast of rank 0's parameters was forgotten and each rank trains a model of its own. 0 = no check."""

    caller_cycles: bool = True
    """A thread that waits for a handle runs the engine's cycles itself while no cycle is running
    (no hand-off to the engine thread and back); 0 leaves every cycle to the engine thread."""

    credit_bytes: int = 0
    """Bytes of allreduces the scheduler posts per cycle before it looks again for more urgent
    tensors; with a credit, allreduces fly while the next cycle negotiates (at most two cycles'
    worth in flight). 0 = everything agreed is sent at once, one blocking collective at a time."""

    autotune: bool = False
    """Tune fusion threshold, cycle time and partition size online."""

    autotune_log: str = ""
    """CSV file where the autotuner logs what it tried and what it chose."""

    autotune_warmup_steps: int = 3
    """Steps the autotuner ignores before measuring each candidate."""

    autotune_steps_per_sample: int = 5
    """Steps measured for each candidate setting."""

    dynamic_process_sets: bool = True
    """``add_process_set`` / ``remove_process_set`` work at any time after ``init()`` (Horovod's
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``; each set has an engine of its own, so a dynamic set costs nothing
    extra here). 0 is Horovod's default: the sets are those given to ``init(process_sets=[...])``, and adding
    or removing one later is a ValueError, unless ``init(process_sets="dynamic")`` asked for dynamic sets."""

    hierarchical_allreduce: bool = False
    """Reduce within each host first, then across hosts, then share within the host."""

    shm_bytes: int = 4 << 20
    """On one host: fusion buffers up to this size are reduced through a shared-memory window (a slot per
    rank and one for the result, ``(ranks + 1) * shm_bytes`` of /dev/shm) instead of MPI's allreduce,
    which saves two copies of the data; 0 = always MPI."""

    hosts_per_node: int = 0
    """Pretend each host holds this many ranks (tests of the hierarchical path on
    one machine); 0 = ask MPI which ranks share memory."""

    log_level: str = "WARNING"
    """Level of the ``aiacc`` logger's messages (debug, info, warning, error)."""

    max_restarts: int = 0
    """aiaccrun: start the job again up to this many times after a rank died or raised (needs
    ``elastic_dir``: the restarted ranks resume from the last commit written there)."""

    elastic_dir: str = ""
    """Directory where ``state.commit()`` of ``hvd.elastic`` writes the committed state (rank 0, in the
    background) and from which a restarted job resumes."""

    commit_direct_io: bool = True
    """Write commit files with direct I/O (``O_DIRECT``) where the filesystem takes it: less CPU per commit
    than through the page cache, which a training loop shares; 0 writes through the page cache."""

    host_discovery_script: str = ""
    """aiaccrun (Horovod's flag): an executable that prints the hosts available now, one ``host:slots`` a
    line. It runs at every start of the job (the first and each restart); the start gets
    ``min(max_np, slots found)`` ranks on those hosts, waiting for at least ``min_np`` slots. The ranks see
    it set: their commits may then be resumed at another world size within ``[min_np, max_np]``."""

    min_np: int = 0
    """With ``host_discovery_script``: the fewest ranks a start may have (0 = ``-np``, or 1 without it).
    aiaccrun sets the value it used on every rank."""

    max_np: int = 0
    """With ``host_discovery_script``: the most ranks a start may have (0 = no bound)."""

    elastic_timeout: float = 600.0
    """With ``host_discovery_script``: seconds a start waits (asking the script every second) for
    ``min_np`` slots before aiaccrun gives up with an error."""

    mpiexec: str = ""
    """Path of the ``mpiexec`` aiaccrun uses; empty = the one belonging to the MPI
    that mpi4py loads (found next to the Python interpreter first)."""

    emulated_cluster: str = ""
    """aiaccrun: launch on the emulated cluster of this name (or state directory) made by
    ``python -m aiacc.bench cluster up``: hosts are its network namespaces (``-H h0:2,h1:2``),
    hydra enters them through its launcher-exec hook."""

    explicit: FrozenSet[str] = dataclasses.field(default=frozenset(), compare=False)
    """The settings given through a variable or a flag (not left at their default): the autotuner holds
    those constant, as Horovod's does."""

    origins: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)
    """The variable that gave each setting in ``explicit`` (aiacc's, or Horovod's name for it): messages
    name what the user set (see :meth:`variable`)."""

    def variable(self, field: str) -> str:
        """The variable that set ``field``, else aiacc's own for it."""
        return self.origins.get(field) or _BY_FIELD[field].env

    def describe(self) -> str:
        """Every setting, with the variable that gave it or "(default)": what ``AIACC_LOG_LEVEL=debug`` (Horovod's
        ``HOROVOD_LOG_LEVEL=debug``/``trace``) logs at ``init()``."""
        return ", ".join(f"{o.field}={getattr(self, o.field)!r} ({self.origins.get(o.field, 'default')})"
                         for o in OPTIONS)


def _flag_mb_to_bytes(text: str) -> str:
    value = float(text) * (1 << 20)
    if 0 < value < 1:  # (0 bytes: fusion off without a word)
        raise ValueError("expected 0 or a number of MiB of at least one byte (1/1048576 MiB)")
    return str(int(value))


OPTIONS: tuple[Option, ...] = (
    Option("enable", "AIACC_ENABLE", "--enable", _parse_bool, "1/0, true/false, yes/no, on/off", "0",
           "Switch: 1 runs the engine; 0/unset gives rank 0 of 1 and hands back the user's own optimizer. aiaccrun sets 1 (and refuses 0).",
           flag_to_env=lambda _: "1", flag_takes_value=False),
    Option("fusion_threshold", "AIACC_FUSION_THRESHOLD", "--fusion-threshold-mb", parse_bytes,
           "a size in bytes (67108864, 64MiB); the flag takes MiB", "64MiB",
           "Largest fusion buffer; 0 disables fusion.", flag_to_env=_flag_mb_to_bytes),
    Option("bucket_cap", "AIACC_BUCKET_CAP", "--bucket-cap-mb", _pos_bytes,
           "a size in bytes > 0 (26214400, 25MiB); the flag takes MiB", "25MiB",
           "Largest gradient bucket of an optimizer wrapper (DDP's bucket_cap_mb); the first holds at most 1 MiB.",
           flag_to_env=_flag_mb_to_bytes),
    Option("cycle_time_ms", "AIACC_CYCLE_TIME_MS", "--cycle-time-ms", _cycle_ms,
           "a number of milliseconds > 0 and <= 60000", "1",
           "Time between negotiation cycles of the background thread."),
    Option("cache_capacity", "AIACC_CACHE_CAPACITY", "--cache-capacity", _cache_capacity,
           "a whole number from 0 to 1048576", "1024",
           "Tensors kept in the response cache (agreed by one bit per cycle); 0 disables it."),
    Option("timeline", "AIACC_TIMELINE", "--timeline", _path, "a file path, or DYNAMIC", "(off)",
           "Chrome/Perfetto trace of every tensor's phases and every cycle (rank 0); DYNAMIC (Horovod's): no "
           "file until the script calls start_timeline()."),
    Option("timeline_mark_cycles", "AIACC_TIMELINE_MARK_CYCLES", "--timeline-mark-cycles", _parse_bool, "1/0", "0",
           "Mark the start of every engine cycle in the timeline (a CYCLE_START instant, as Horovod's).",
           flag_to_env=lambda _: "1", flag_takes_value=False),
    Option("timeline_all_ranks", "AIACC_TIMELINE_ALL_RANKS", "--timeline-all-ranks", _parse_bool, "1/0", "0",
           "Write the timeline on every rank, as FILE.rank<N>.", flag_to_env=lambda _: "1", flag_takes_value=False),
    Option("summary", "AIACC_SUMMARY", "--summary", _parse_bool, "1/0", "0",
           "Rank 0 prints one line on what its engine did (requests, collectives, bytes, cache, cycles, CPU) at "
           "shutdown; aiacc.summary() gives it as a dict on any rank.", flag_to_env=lambda _: "1",
           flag_takes_value=False),
    Option("stall_check_seconds", "AIACC_STALL_CHECK_SECONDS", "--stall-check-seconds", _seconds,
           "a number of seconds from 0 to 1e9", "60",
           "Warn about tensors some ranks have not submitted after this long, naming the ranks; 0 disables."),
    Option("stall_shutdown_seconds", "AIACC_STALL_SHUTDOWN_SECONDS", "--stall-shutdown-seconds", _seconds,
           "a number of seconds from 0 to 1e9", "1800",
           "End every rank with a StallError naming the tensor and the ranks once a tensor has stalled this long; "
           "0 waits forever. Shorter than a stall check that is set (by any variable), it is off, with a warning, "
           "as in Horovod (a Horovod job's check of an hour is not ended by this default's 30 minutes)."),
    Option("start_timeout", "AIACC_START_TIMEOUT", "--start-timeout", _seconds,
           "a number of seconds from 0 to 1e9", "120",
           "End the job with an error when a rank has waited this long in MPI's start-up for the others (a rank "
           "that exited or hangs before init()); 0 waits forever."),
    Option("partition_bytes", "AIACC_PARTITION_BYTES", "--partition-bytes", parse_bytes,
           "a size in bytes (4194304, 4MiB)", "0 (off)",
           "Split larger allreduces into partitions scheduled separately."),
    Option("priority", "AIACC_PRIORITY", "--priority", _parse_bool, "1/0", "1",
           "Send what the next forward pass needs first."),
    Option("overlap_forward", "AIACC_OVERLAP_FORWARD", "--overlap-forward", _parse_bool, "1/0", "0",
           "PyTorch: update each layer in its forward pre-hook, overlapping communication with the next forward.",
           flag_to_env=lambda _: "1", flag_takes_value=False),
    Option("check_same_start", "AIACC_CHECK_SAME_START", "--check-same-start", _parse_bool, "1/0", "1",
           "At the second optimizer step, compare the parameters across ranks once (one small collective) and warn, "
           "naming them and the ranks, when they differ (the broadcast of rank 0's parameters was forgotten); 0: no "
           "check."),
    Option("caller_cycles", "AIACC_CALLER_CYCLES", "--caller-cycles", _parse_bool, "1/0", "1",
           "A thread waiting for a result runs the engine's cycles itself (no thread hand-off); 0: the engine "
           "thread only."),
    Option("credit_bytes", "AIACC_CREDIT_BYTES", "--credit-bytes", parse_bytes, "a size in bytes", "0 (no bound)",
           "Bytes posted per cycle before looking again for more urgent tensors; allreduces then fly while the next cycle negotiates (at most two cycles' worth)."),
    Option("autotune", "AIACC_AUTOTUNE", "--autotune", _parse_bool, "1/0", "0",
           "Tune fusion threshold, cycle time and partition size online.",
           flag_to_env=lambda _: "1", flag_takes_value=False),
    Option("autotune_log", "AIACC_AUTOTUNE_LOG", "--autotune-log", _path, "a file path", "(off)",
           "CSV log of the autotuner's trials and choice."),
    Option("autotune_warmup_steps", "AIACC_AUTOTUNE_WARMUP_STEPS", "--autotune-warmup-steps", _nonneg_int,
           "a whole number >= 0", "3", "Steps ignored before each autotune measurement."),
    Option("autotune_steps_per_sample", "AIACC_AUTOTUNE_STEPS_PER_SAMPLE", "--autotune-steps-per-sample", _pos_int,
           "a whole number > 0", "5", "Steps measured per autotune candidate."),
    Option("dynamic_process_sets", "AIACC_DYNAMIC_PROCESS_SETS", "--dynamic-process-sets", _parse_bool, "1/0", "1",
           "add_process_set/remove_process_set work at any time after init() (Horovod's "
           "HOROVOD_DYNAMIC_PROCESS_SETS=1); 0, Horovod's default: only the sets given to init(process_sets=[...]), "
           "unless init(process_sets=\"dynamic\")."),
    Option("hierarchical_allreduce", "AIACC_HIERARCHICAL_ALLREDUCE", "--hierarchical-allreduce", _parse_bool,
           "1/0", "0", "Reduce within each host, then across hosts, then share within the host.",
           flag_to_env=lambda _: "1", flag_takes_value=False),
    Option("shm_bytes", "AIACC_SHM_BYTES", "--shm-bytes", parse_bytes, "a size in bytes (4194304, 4MiB)",
           "4194304 (4 MiB)", "One host: reduce fusion buffers up to this size through shared memory; 0 = MPI."),
    Option("hosts_per_node", "AIACC_HOSTS_PER_NODE", "--ranks-per-emulated-host", _nonneg_int, "a whole number >= 0",
           "0 (real hosts)", "Group consecutive ranks into emulated hosts of this size (testing)."),
    Option("log_level", "AIACC_LOG_LEVEL", "--log-level", _log_level,
           "debug, info, warning, error, critical (or Horovod's trace, fatal)", "warning",
           "Level of the aiacc logger."),
    Option("max_restarts", "AIACC_MAX_RESTARTS", "--max-restarts", _nonneg_int, "a whole number >= 0", "0",
           "aiaccrun: restart the job up to N times after a rank died or raised (needs --elastic-dir)."),
    Option("elastic_dir", "AIACC_ELASTIC_DIR", "--elastic-dir", _path, "a directory", "(off)",
           "Where hvd.elastic commits are written (atomically, by rank 0) and a restarted job resumes from."),
    Option("commit_direct_io", "AIACC_COMMIT_DIRECT_IO", "--commit-direct-io", _parse_bool, "1/0", "1",
           "Write elastic commits with O_DIRECT where the filesystem takes it (less CPU than the page cache)."),
    Option("host_discovery_script", "AIACC_HOST_DISCOVERY_SCRIPT", "--host-discovery-script", _path,
           "a shell command (an executable's path)", "(off)",
           "aiaccrun: run at every start (and restart); prints the hosts available now, one host:slots a line; the "
           "start gets min(--max-np, slots) ranks on them. Replaces -H/--hostfile; -np becomes optional."),
    Option("min_np", "AIACC_MIN_NP", "--min-np", _nonneg_int, "a whole number >= 0", "-np (or 1)",
           "With --host-discovery-script: the fewest ranks a start may have; fewer slots: wait (--elastic-timeout)."),
    Option("max_np", "AIACC_MAX_NP", "--max-np", _nonneg_int, "a whole number >= 0", "0 (no bound)",
           "With --host-discovery-script: the most ranks a start may have."),
    Option("elastic_timeout", "AIACC_ELASTIC_TIMEOUT", "--elastic-timeout", _pos_float, "a number of seconds > 0",
           "600", "With --host-discovery-script: how long a start waits for --min-np slots before giving up."),
    Option("mpiexec", "AIACC_MPIEXEC", "--mpiexec", _path, "a path", "(auto)",
           "The mpiexec aiaccrun uses; by default the one of the MPI that mpi4py loads."),
    Option("emulated_cluster", "AIACC_EMULATED_CLUSTER", "--emulated-cluster", _path, "a cluster name or directory",
           "(off)", "aiaccrun: run on the emulated cluster of `python -m aiacc.bench cluster up` (hosts h0, h1, ... "
           "are its network namespaces)."),
)

_BY_ENV = {o.env: o for o in OPTIONS}
_BY_FIELD = {o.field: o for o in OPTIONS}


def _horovod_log_level(text: str) -> str:
    """Horovod's levels: its trace is aiacc's debug, its fatal aiacc's error."""
    return {"trace": "debug", "fatal": "error"}.get(text.strip().lower(), text)


# Horovod's variables that have an aiacc setting: a Horovod job script's settings keep working. Each maps to
# (field, text conversion or None); the AIACC_ variable wins where both are set. Horovod's own defaults differ
# in places (its stall shutdown is off, aiacc's after 30 minutes): only a variable that is set counts.
HOROVOD_VARIABLES = {
    "HOROVOD_FUSION_THRESHOLD": ("fusion_threshold", None),
    "HOROVOD_CYCLE_TIME": ("cycle_time_ms", None),
    "HOROVOD_CACHE_CAPACITY": ("cache_capacity", None),
    "HOROVOD_TIMELINE": ("timeline", None),
    "HOROVOD_TIMELINE_MARK_CYCLES": ("timeline_mark_cycles", None),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": ("stall_check_seconds", None),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("stall_shutdown_seconds", None),
    "HOROVOD_START_TIMEOUT": ("start_timeout", None),
    "HOROVOD_AUTOTUNE": ("autotune", None),
    "HOROVOD_AUTOTUNE_LOG": ("autotune_log", None),
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": ("autotune_warmup_steps", None),
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": ("autotune_steps_per_sample", None),
    "HOROVOD_HIERARCHICAL_ALLREDUCE": ("hierarchical_allreduce", None),
    "HOROVOD_DYNAMIC_PROCESS_SETS": ("dynamic_process_sets", None),
    "HOROVOD_ELASTIC_TIMEOUT": ("elastic_timeout", None),
    "HOROVOD_LOG_LEVEL": ("log_level", _horovod_log_level),
}
# Horovod's off-switch of its stall inspector (see from_env): not one setting but two.
STALL_CHECK_DISABLE = "HOROVOD_STALL_CHECK_DISABLE"
_HOROVOD_BY_FIELD: dict = {}
for _var, (_field, _convert) in HOROVOD_VARIABLES.items():
    _HOROVOD_BY_FIELD.setdefault(_field, []).append((_var, _convert))
assert {o.field for o in OPTIONS} == {f.name for f in dataclasses.fields(Config)} - {"explicit", "origins"}, \
    "OPTIONS and Config disagree"


# Horovod's run-time variables that aiacc does not read, with why: init() names those that are set (see
# unread_horovod_variables), so that a Horovod job's setting is never dropped without a word.
_GPU_ONLY = "a GPU (CUDA/NCCL) setting of Horovod's; aiacc's NCCL path has none"
_SET_BY_HOROVODRUN = "set by horovodrun for its Gloo ranks; aiacc's ranks come from MPI"
HOROVOD_NOT_READ = {
    "HOROVOD_CONTROLLER": "aiacc's controller is always MPI",
    "HOROVOD_CPU_OPERATIONS": "aiacc's CPU collectives are always MPI's, with its own shared-memory reduction",
    "HOROVOD_MPI_THREADS_DISABLE": "aiacc asks MPI for MPI_THREAD_MULTIPLE, which its process sets need",
    "HOROVOD_THREAD_AFFINITY": "aiacc does not pin its engine thread to cores",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "aiacc has no hierarchical allgather (AIACC_HIERARCHICAL_ALLREDUCE is for "
                                      "allreduce)",
    "HOROVOD_TORUS_ALLREDUCE": "aiacc has no torus allreduce",
    "HOROVOD_DISABLE_GROUP_FUSION": "aiacc fuses a group's tensors with any others that fit a fusion buffer",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "aiacc's Adasum exchanges whole tensors",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "aiacc's autotuner is a coordinate search, not Bayesian",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "aiacc's autotuner is a coordinate search, not Bayesian",
    "HOROVOD_LOG_HIDE_TIME": "aiacc logs through Python's logging, whose format is the script's",
    "HOROVOD_ENABLE_XLA_OPS": "aiacc registers no XLA operations",
    "HOROVOD_CCL_CACHE": "aiacc does not use oneCCL",
    "HOROVOD_NUM_NCCL_STREAMS": _GPU_ONLY, "HOROVOD_BATCH_D2D_MEMCOPIES": _GPU_ONLY,
    "HOROVOD_ENABLE_ASYNC_COMPLETION": _GPU_ONLY, "HOROVOD_DISABLE_NVTX_RANGES": _GPU_ONLY,
    "HOROVOD_ELASTIC": "set by horovodrun's elastic driver; aiacc's restarts are aiaccrun's --max-restarts",
    **{v: _SET_BY_HOROVODRUN for v in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                                       "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
                                       "HOROVOD_SECRET_KEY")},
}
# read only by Horovod's build (pip install) or by parts of Horovod aiacc does not have (Gloo, Spark, Ray): not
# settings of a running job, never named
_HOROVOD_NOT_RUNTIME = re.compile(r"HOROVOD_(WITH_|WITHOUT_|GPU|NCCL_|CUDA_|ROCM_|BUILD_|CMAKE|DEBUG$|"
                                  r"ALLOW_MIXED_GPU_IMPL$|MPICXX_SHOW$|MPI_CXX|GLOO_|SPARK_|RAY_)")


def unread_horovod_variables(environ: Optional[Mapping[str, str]] = None) -> list:
    """``VAR (why)`` for each ``HOROVOD_*`` variable set in ``environ`` that aiacc does not read: one of Horovod's
    run-time settings aiacc has no counterpart for, or a name Horovod does not have either (a typo)."""
    env = os.environ if environ is None else environ
    unread = []
    for var in sorted(k for k in env if k.startswith("HOROVOD_")):
        if var in HOROVOD_VARIABLES or var == STALL_CHECK_DISABLE or _HOROVOD_NOT_RUNTIME.match(var):
            continue
        unread.append(f"{var} ({HOROVOD_NOT_READ.get(var, 'not a setting of Horovod that aiacc knows: a typo?')})")
    return unread


# set by aiaccrun for the ranks, not settings: which start of the job this is (hvd.elastic), where ranks
# say how they ended (aiacc.exits)
LAUNCHER_SET = frozenset({"AIACC_RESTART_COUNT", "AIACC_EXIT_DIR"})


def from_env(environ: Optional[Mapping[str, str]] = None) -> Config:
    """Build a :class:`Config` from ``environ`` (default ``os.environ``), validating every value."""
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith("AIACC_") and k not in _BY_ENV and k not in LAUNCHER_SET)
    if unknown:
        raise ConfigError(
            f"unknown aiacc variable {', '.join(unknown)}; known variables: {', '.join(sorted(_BY_ENV))}"
        )
    values, origins = {}, {}
    for opt in OPTIONS:
        # aiacc's variable, else Horovod's names for the same setting (the first one set decides, in
        # HOROVOD_VARIABLES' order; the others, bad values too, are named by init(): ``shadowed_variables``)
        found = _values_of(opt, env, first=True)
        if found:
            (var, values[opt.field]), = found
            origins[opt.field] = var
    if STALL_CHECK_DISABLE in env:
        # Horovod's switch turns its whole stall inspector off, the warning and the shutdown, whatever times are
        # set (by any variable, or aiaccrun's flags): a Horovod job that turned it off is never ended by it.
        try:
            disabled = _parse_bool(env[STALL_CHECK_DISABLE])
        except ValueError as exc:
            raise ConfigError(f"{STALL_CHECK_DISABLE}={env[STALL_CHECK_DISABLE]!r} is not valid: {exc}") from None
        if disabled:
            for field in ("stall_check_seconds", "stall_shutdown_seconds"):
                values[field] = 0.0
                origins[field] = STALL_CHECK_DISABLE
    _stall_rule(values, origins)
    return Config(**values, explicit=frozenset(values), origins=origins)


def _values_of(opt: Option, env: Mapping[str, str], first: bool = False) -> list:
    """``(variable, value)`` for each variable set in ``env`` that gives ``opt`` (only the first one with
    ``first``): aiacc's, then Horovod's names for it, in the order that decides. The first one's bad value is a
    ConfigError naming it; a later one's value is then the ConfigError itself (``shadowed_variables``)."""
    found = []
    for var, convert in [(opt.env, None)] + _HOROVOD_BY_FIELD.get(opt.field, []):
        if var not in env:
            continue
        text = env[var]
        try:
            value = text if convert is None else convert(text)
            if value is None:
                continue
            found.append((var, opt.parse(value)))
        except (ValueError, TypeError) as exc:
            reason = str(exc) if str(exc).startswith("expected") else f"expected {opt.accepts}"
            error = ConfigError(f"{var}={text!r} is not valid: {reason}")
            if not found:
                raise error from None
            found.append((var, error))
        if first:
            break
    return found


def shadowed_variables(environ: Optional[Mapping[str, str]] = None) -> list:
    """``VAR (why)`` for each variable set in ``environ`` to another value than the variable that decides its
    setting (``AIACC_FUSION_THRESHOLD`` over ``HOROVOD_FUSION_THRESHOLD``, an aiaccrun flag over a Horovod
    variable, as horovodrun's flags replace them), bad values too: ``init()`` names them, so that a Horovod job's
    setting is never dropped without a word."""
    env = os.environ if environ is None else environ
    shadowed = []
    for opt in OPTIONS:
        found = _values_of(opt, env)
        shadowed += [f"{var}={env[var]} (not used: {found[0][0]}={env[found[0][0]]} decides"
                     + (f"; and not valid: {str(value).split(': ', 1)[1]})" if isinstance(value, ConfigError) else ")")
                     for var, value in found[1:] if value != found[0][1]]
    return shadowed


def _stall_rule(values: dict, origins: dict) -> None:
    """Horovod's rule: a stall shutdown shorter than the stall check (set by a variable) never happens (it ended
    the job with no warning first; and a Horovod job that set a check of an hour, whose shutdown is off in
    Horovod, was ended at aiacc's default 30 minutes). A set shutdown that is dropped is warned about."""
    check = values.get("stall_check_seconds", 0.0)
    shutdown = values.get("stall_shutdown_seconds", Config.stall_shutdown_seconds)
    if not 0 < shutdown < check:
        return
    if "stall_shutdown_seconds" in values:
        logging.getLogger(__name__).warning(
            "%s=%g is less than %s=%g: the stall shutdown is off (as in Horovod); set it longer than the check "
            "to have one", origins["stall_shutdown_seconds"], shutdown, origins["stall_check_seconds"], check)
    values["stall_shutdown_seconds"] = 0.0
    origins.setdefault("stall_shutdown_seconds", origins["stall_check_seconds"])


# Variables that launchers set in each rank's environment, giving the job's size, and who sets them: the first one
# set counts. Read only to warn when aiacc is disabled inside a multi-rank job, and to refuse a rank that MPI sees
# alone in a job its launcher started with several (``launched_as``).
_LAUNCHERS = (("PMI_SIZE", "MPICH's mpiexec"), ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
              ("PMIX_SIZE", "a PMIx launcher"), ("MV2_COMM_WORLD_SIZE", "MVAPICH's mpirun"),
              ("MPI_LOCALNRANKS", "MPICH's mpiexec"))


def launched_as(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, str, str]]:
    """``(size, variable, launcher)`` of the job this process was started in, from the variables its launcher set:
    an MPI launcher's (the first of ``_LAUNCHERS`` set), else torchrun's ``WORLD_SIZE`` (beside its
    ``TORCHELASTIC_RUN_ID``), else an ``srun`` step's ``SLURM_NTASKS``; None when none is set (or not a number)."""
    env = os.environ if environ is None else environ
    found = next(((var, who) for var, who in _LAUNCHERS if var in env), None)
    if found is None and "TORCHELASTIC_RUN_ID" in env and "WORLD_SIZE" in env:
        found = ("WORLD_SIZE", "torchrun")
    if found is None and env.get("SLURM_STEP_ID") is not None and "SLURM_NTASKS" in env:
        found = ("SLURM_NTASKS", "Slurm's srun")
    if found is None:
        return None
    var, who = found
    try:
        return max(1, int(env[var])), var, who
    except ValueError:
        return None


def mpi_world_size_hint(environ: Optional[Mapping[str, str]] = None) -> int:
    """The size of the job this process belongs to, from its launcher's variables (1 if none)."""
    found = launched_as(environ)
    return found[0] if found else 1


def markdown_table() -> str:
    """The README's table of variables."""
    rows = ["| variable | `aiaccrun` flag | default | meaning |", "|---|---|---|---|"]
    for o in OPTIONS:
        switch = "" if o.flag_takes_value else " (no value)"
        flag = "(aiaccrun sets 1)" if o.field == "enable" else f"`{o.flag}`{switch}"
        rows.append(f"| `{o.env}` | {flag} | {o.default_text} | {o.help} Accepts {o.accepts}. |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover - documentation helper
    import sys

    if "--markdown" in sys.argv:
        print(markdown_table())
