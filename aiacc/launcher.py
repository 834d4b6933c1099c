"""``aiaccrun``: start N ranks of a command through the right ``mpiexec``.

The ``mpiexec`` must belong to the MPI library that mpi4py loads: a
different one (say the system's Open MPI beside the ``mpich`` wheel) starts
N separate singletons or fails with "unsupported PMI version". aiaccrun
asks mpi4py which library it uses (without starting MPI), then looks for a
launcher of that family next to the Python interpreter, next to the
library, and on PATH, checking each with ``--version``.

Every ``AIACC_*`` variable of the caller's environment is forwarded to all
ranks, ``AIACC_ENABLE=1`` is set, and each tuning flag becomes its variable
(``--cycle-time-ms 2`` -> ``AIACC_CYCLE_TIME_MS=2``). The exit status is
the worst of the ranks', as mpiexec reports it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import config as _config
from . import exits
from .exceptions import ConfigError

__all__ = ["main", "find_mpiexec", "build_command", "parse_hosts", "discover_hosts", "wait_for_hosts", "MPIFamily"]


class LauncherError(Exception):
    """A problem aiaccrun reports and exits on (status 2)."""


class MPIFamily:
    HYDRA = "mpich"  # MPICH, Intel MPI, MVAPICH: hydra's mpiexec
    OPEN_MPI = "openmpi"


def mpi_library() -> Tuple[str, str]:
    """(family, one-line description) of the MPI library mpi4py loads, without starting MPI."""
    try:
        import mpi4py  # noqa: PLC0415

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        raise LauncherError(f"mpi4py cannot load an MPI library ({exc}); install one with `pip install mpich`") from None
    text = MPI.Get_library_version().strip()
    first = text.splitlines()[0] if text else "unknown MPI"
    lowered = text.lower()
    if "open mpi" in lowered:
        return MPIFamily.OPEN_MPI, first
    return MPIFamily.HYDRA, first


def _library_bin_dirs() -> List[str]:
    """bin/ folders beside the libmpi this process has loaded (Linux)."""
    dirs = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "libmpi" in os.path.basename(path):
                    lib_dir = os.path.dirname(path)
                    for cand in (os.path.join(lib_dir, "..", "bin"), os.path.join(lib_dir, "..", "..", "bin")):
                        cand = os.path.normpath(cand)
                        if cand not in dirs:
                            dirs.append(cand)
    except OSError:
        pass
    return dirs


def _launcher_family(path: str) -> Optional[str]:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout + out.stderr).lower()
    if "hydra" in text or "intel(r) mpi" in text:
        return MPIFamily.HYDRA
    if "open mpi" in text or "openrte" in text or "prte" in text:
        return MPIFamily.OPEN_MPI
    return None


def find_mpiexec(explicit: str = "", search_dirs: Optional[Sequence[str]] = None) -> Tuple[str, str]:
    """(path, family) of the mpiexec that matches mpi4py's MPI; LauncherError if there is none.

    ``search_dirs`` replaces the default search order (interpreter's scripts folder, the
    interpreter's folder, the MPI library's bin/, then PATH)."""
    family, description = mpi_library()
    if explicit:
        found = _launcher_family(explicit)
        if found is None:
            raise LauncherError(f"AIACC_MPIEXEC/--mpiexec {explicit!r} is not a working mpiexec "
                                f"(`{explicit} --version` failed)")
        if found != family:
            raise LauncherError(f"AIACC_MPIEXEC/--mpiexec {explicit!r} is a {found} launcher but mpi4py uses "
                                f"{description}; they cannot start each other's processes")
        return explicit, family
    if search_dirs is None:
        dirs = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)] + _library_bin_dirs()
        dirs += os.environ.get("PATH", "").split(os.pathsep)
    else:
        dirs = list(search_dirs)
    looked = []
    seen = set()
    for d in dirs:
        for name in ("mpiexec", "mpirun"):
            path = os.path.join(d, name) if d else ""
            if not path or path in seen:
                continue
            seen.add(path)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                got = _launcher_family(path)
                looked.append(f"{path} ({got or 'unrecognised'})")
                if got == family:
                    return path, family
    detail = "; found but not matching: " + ", ".join(looked) if looked else ""
    raise LauncherError(
        f"no mpiexec for {description} (the MPI that mpi4py uses) was found next to {sys.executable}, "
        f"next to the MPI library, or on PATH{detail}. Install the launcher that belongs to it "
        "(`pip install mpich` brings both), or name it with AIACC_MPIEXEC / --mpiexec."
    )


def parse_hosts(hosts: Optional[str], hostfile: Optional[str]) -> List[Tuple[str, int]]:
    """``-H a:2,b:2`` or a hostfile (lines ``host slots=N`` or ``host:N`` or ``host``; spaces or tabs
    between the host and ``slots``, and around ``=``, as Horovod reads them) -> [(host, slots)]. Not both:
    horovodrun refuses the pair too (aiacc would count the hosts twice)."""
    if hosts is not None and hostfile is not None:
        raise LauncherError("-H/--hosts and --hostfile both give the hosts: use one")
    entries: List[str] = []
    if hosts:
        entries += [h for h in hosts.split(",") if h.strip()]
    if hostfile is not None:
        try:
            with open(hostfile) as f:
                for line in f:
                    line = line.split("#", 1)[0].strip()
                    if line:
                        entries.append(line)
        except OSError as exc:
            raise LauncherError(f"cannot read hostfile {hostfile!r}: {exc.strerror}") from None
    out = []
    for e in entries:
        e = e.strip()
        slots = 1
        words = e.split()
        if len(words) > 1:
            host = words[0]
            found = re.search(r"(?:^|\s)slots\s*=\s*(\S+)", " ".join(words[1:]))
            if found is None:
                raise LauncherError(f"host entry {e!r}: expected `host slots=N` (or host:N)")
            value = found.group(1)
        elif ":" in e:
            host, _, value = e.rpartition(":")
        else:
            host, value = e, "1"
        try:
            slots = int(value)
            if slots <= 0:
                raise ValueError
        except ValueError:
            raise LauncherError(f"host entry {e!r}: slots must be a whole number > 0") from None
        if not host.strip():
            raise LauncherError(f"host entry {e!r}: no host name before the slots")
        out.append((host.strip(), slots))
    if not out and (hosts is not None or hostfile is not None):
        # (taken for no hosts at all, it would start a job meant for those hosts here, on -np ranks)
        given = (f"hostfile {hostfile!r} has only blank lines and comments" if hostfile is not None
                 else f"-H {hosts!r} is empty")
        raise LauncherError(f"{given}: it names no hosts (give at least one, `host slots=N` or host:N)")
    return out


DISCOVERY_SCRIPT_TIMEOUT = 60.0  # seconds one run of --host-discovery-script may take


def discover_hosts(script: str, environ: Dict[str, str]) -> List[Tuple[str, int]]:
    """Run ``script`` (``--host-discovery-script``) through the shell, as horovodrun does (a path, or a command
    with an interpreter or arguments), and parse what it prints: one ``host:slots`` a line (Horovod's format;
    blank lines and ``#`` comments are skipped; a line given twice counts once, as in Horovod). LauncherError
    naming the script on a script that cannot run, fails, or prints a line that is not ``host:slots`` or gives
    one host two slot counts."""
    try:
        out = subprocess.run(script, shell=True, capture_output=True, text=True, env=environ,
                             timeout=DISCOVERY_SCRIPT_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise LauncherError(f"--host-discovery-script {script!r} did not finish within "
                            f"{DISCOVERY_SCRIPT_TIMEOUT:g} s") from None
    except OSError as exc:
        raise LauncherError(f"--host-discovery-script {script!r} cannot be run: {exc.strerror}") from None
    if out.returncode != 0:
        detail = (out.stderr.strip().splitlines()[-1:] or ["no message"])[0]
        if out.returncode in (126, 127):  # (the shell's: not executable, not found)
            word = script.split()[0] if script.split() else script
            hint = ""
            if "/" not in word and os.path.isfile(word):
                hint = f" (a script in this directory runs as ./{word}, as any command)"
            elif out.returncode == 126 and os.path.isfile(word) and not os.access(word, os.X_OK):
                hint = f" (not executable: chmod +x {word}, or give `sh {word}`)"
            raise LauncherError(f"--host-discovery-script {script!r} cannot be run: {detail}{hint}")
        status = (f"was killed by signal {-out.returncode}" if out.returncode < 0
                  else f"exited with status {out.returncode}")
        raise LauncherError(f"--host-discovery-script {script!r} {status}: {detail}")
    hosts: Dict[str, int] = {}
    for number, line in enumerate(out.stdout.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        host, sep, slots = entry.rpartition(":")
        host = host.strip()
        if not sep or not host or not slots.strip().isdigit() or int(slots) <= 0:
            raise LauncherError(f"--host-discovery-script {script!r} printed {line!r} on line {number}: expected "
                                "host:slots (a host name, a colon and a whole number > 0), one host a line")
        if hosts.setdefault(host, int(slots)) != int(slots):
            raise LauncherError(f"--host-discovery-script {script!r} printed host {host!r} twice, with "
                                f"{hosts[host]} and {int(slots)} slots (one line a host)")
    return list(hosts.items())


def _describe_hosts(hosts: List[Tuple[str, int]]) -> str:
    return ",".join(f"{h}:{s}" for h, s in hosts) or "no hosts"


def wait_for_hosts(script: str, min_np: int, timeout: float, environ: Dict[str, str], poll_seconds: float = 1.0,
                   timeout_name: str = "--elastic-timeout", first: bool = True) -> List[Tuple[str, int]]:
    """The hosts ``script`` reports once they have at least ``min_np`` slots, asking it every
    ``poll_seconds``; LauncherError naming the script, the slots found and ``min_np`` after ``timeout`` s
    (``timeout_name``: what set it). As in Horovod, only a failure of the job's ``first`` call of the script ends
    the job at once; a later one (a cloud API down a while) is reported and the script asked again until the
    timeout."""
    deadline = time.monotonic() + timeout
    announced, failure = False, None
    while True:
        try:
            hosts = discover_hosts(script, environ)
        except LauncherError as exc:
            if first:
                raise
            if str(exc) != failure:
                print(f"aiaccrun: {exc}; asking again every {poll_seconds:g} s for up to {timeout:g} s "
                      f"({timeout_name})", file=sys.stderr, flush=True)
            hosts, failure = None, str(exc)
        first, slots = False, sum(s for _, s in hosts or ())
        if hosts is not None and slots >= min_np:
            return hosts
        if time.monotonic() + poll_seconds > deadline:
            if hosts is None:
                raise LauncherError(f"{failure}, and still after {timeout:g} s ({timeout_name})")
            raise LauncherError(f"--host-discovery-script {script!r} found {slots} slot{'s' * (slots != 1)} "
                                f"({_describe_hosts(hosts)}) "
                                f"and still no more after {timeout:g} s ({timeout_name}); --min-np {min_np} needs "
                                f"at least {min_np}")
        if hosts is not None and not announced:
            print(f"aiaccrun: waiting for {min_np} slots: --host-discovery-script {script!r} found {slots} "
                  f"({_describe_hosts(hosts)}); asking again every {poll_seconds:g} s for up to {timeout:g} s",
                  file=sys.stderr, flush=True)
            announced = True
        time.sleep(poll_seconds)


class RankRange(NamedTuple):
    """How many ranks a start of a job with --host-discovery-script may have (max_np 0: no bound)."""

    min_np: int
    max_np: int

    def ranks(self, hosts: List[Tuple[str, int]]) -> int:
        slots = sum(s for _, s in hosts)
        return min(slots, self.max_np) if self.max_np else slots


def rank_range(np: Optional[int], env: Dict[str, str]) -> RankRange:
    """--min-np (default -np, or 1) and --max-np from the ranks' variables, checked against each other."""
    min_np = int(env.get("AIACC_MIN_NP", "0") or 0) or np or 1
    max_np = int(env.get("AIACC_MAX_NP", "0") or 0)
    if max_np and min_np > max_np:
        raise LauncherError(f"--min-np {min_np}{' (from -np)' if 'AIACC_MIN_NP' not in env else ''} is more "
                            f"than --max-np {max_np}")
    if np is not None and max_np and np > max_np:
        raise LauncherError(f"-np {np} is more than --max-np {max_np}")
    return RankRange(min_np, max_np)


def _not_a_command(first: str) -> str:
    """Why ``first``, a file on this machine, cannot start the ranks ('' when it can or is no file here): a
    script named without ``python`` that is not on PATH (the ranks said "exec: train.py: not found" while it lay
    in the working directory), or a path to a file that is not executable (they said "Permission denied")."""
    if not os.path.isfile(first):
        return ""
    if os.sep not in first and "/" not in first:
        return "" if shutil.which(first) else "is a file here, not a command on PATH"
    return "" if os.access(first, os.X_OK) else "is not executable"


def build_command(mpiexec: str, family: str, np: int, hosts: List[Tuple[str, int]], env: Dict[str, str],
                  command: Sequence[str], extra: Sequence[str] = ()) -> List[str]:
    """The mpiexec command line for ``family``, passing every variable in ``env`` to all ranks."""
    cmd = [mpiexec, "-n", str(np)]
    host_list = ",".join(f"{h}:{s}" for h, s in hosts)
    if family == MPIFamily.OPEN_MPI:
        # Open MPI's mpiexec already exits with the status of the first rank that failed.
        if host_list:
            cmd += ["-H", host_list]
        for k, v in sorted(env.items()):
            cmd += ["-x", f"{k}={v}"]
    else:
        # hydra ORs the ranks' statuses together (5 and 2 give 7); it can list them instead.
        cmd.append("-print-all-exitcodes")
        if host_list:
            cmd += ["-hosts", host_list]
        for k, v in sorted(env.items()):
            cmd += ["-genv", k, v]
    return cmd + list(extra) + list(command)


def emulated_cluster(ref: str, hosts: List[Tuple[str, int]], np: int,
                     family: str) -> Tuple[List[Tuple[str, int]], List[str], Dict[str, str]]:
    """(hosts as addresses, mpiexec arguments, rank variables) to launch on the emulated cluster ``ref``
    (``python -m aiacc.bench cluster up``): hosts may be named h0, h1, ... or by address; without
    -H the ranks are spread evenly over all of its hosts."""
    from .bench.cluster import ClusterError, load_state  # noqa: PLC0415 - only with --emulated-cluster

    if family != MPIFamily.HYDRA:
        raise LauncherError("--emulated-cluster launches through MPICH hydra's launcher-exec hook; the MPI that "
                            "mpi4py uses is not MPICH")
    try:
        state = load_state(ref)
        if hosts:
            hosts = [(state.host_address(h), slots) for h, slots in hosts]
        else:
            n = len(state.hosts)  # np // n each, one more on the first np % n (hydra fills hosts in order)
            slots = [np // n + (i < np % n) for i in range(n)]
            hosts = [(h, k) for h, k in zip(state.hosts, slots) if k]
    except ClusterError as exc:
        raise LauncherError(str(exc)) from None
    return hosts, list(state.mpiexec_args), dict(state.env)


# torchrun's variables, from the MPI launcher's own per-process ones (MPICH hydra: PMI_*, MPI_LOCAL*;
# Open MPI: OMPI_COMM_WORLD_*), so that torch.distributed's env:// rendezvous works under aiaccrun
# (dist.init_process_group("aiacc") or "gloo") exactly as under torchrun.
_RANK_SHIM = (
    'RANK="${PMI_RANK:-$OMPI_COMM_WORLD_RANK}"; WORLD_SIZE="${PMI_SIZE:-$OMPI_COMM_WORLD_SIZE}"; '
    'LOCAL_RANK="${MPI_LOCALRANKID:-$OMPI_COMM_WORLD_LOCAL_RANK}"; '
    'LOCAL_WORLD_SIZE="${MPI_LOCALNRANKS:-$OMPI_COMM_WORLD_LOCAL_SIZE}"; '
    # --ranks-per-emulated-host K (AIACC_HOSTS_PER_NODE): hosts of K consecutive ranks, as aiacc.local_rank() has them
    'k="${AIACC_HOSTS_PER_NODE:-0}"; case "$k$RANK$WORLD_SIZE" in *[!0-9]*|"") k=0;; esac; '
    'if [ "$k" -gt 0 ]; then LOCAL_RANK=$((RANK % k)); n=$((WORLD_SIZE - RANK / k * k)); '
    'if [ "$n" -gt "$k" ]; then n=$k; fi; LOCAL_WORLD_SIZE=$n; fi; '
    # stdin reaches rank 0 only (as under horovodrun): hydra gave the others a pipe that never ends, so a
    # sys.stdin.read() there waited for ever; they read end-of-file at once
    '[ "$RANK" = 0 ] || exec </dev/null; export RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE; exec "$@"'
)


def torchrun_command(command: Sequence[str]) -> List[str]:
    """``command`` started through a shell line that sets RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE from the MPI launcher's variables, then execs it (no process stays behind)."""
    return ["/bin/sh", "-c", _RANK_SHIM, "aiaccrun-rank", *command]


def torchrun_env(hosts: List[Tuple[str, int]], environ=os.environ) -> Dict[str, str]:
    """MASTER_ADDR and MASTER_PORT for torch's rendezvous, unless the caller set them: the first host (this
    machine when none is given) and a port free here (torchrun's 29500 when the first host is another)."""
    out = {}
    host = hosts[0][0] if hosts else "127.0.0.1"
    local = host in ("127.0.0.1", "localhost", socket.gethostname())
    if "MASTER_ADDR" not in environ:
        out["MASTER_ADDR"] = host
    if "MASTER_PORT" not in environ:
        if local:
            with socket.socket() as sock:
                sock.bind(("", 0))
                out["MASTER_PORT"] = str(sock.getsockname()[1])
        else:
            out["MASTER_PORT"] = "29500"
    return out


# horovodrun's flags, so that a Horovod job's command line runs with `horovodrun` changed to `aiaccrun`:
# the same setting under Horovod's name (field -> horovodrun's flag) ...
HOROVODRUN_ALIASES = {
    "timeline": "--timeline-filename", "autotune_log": "--autotune-log-file",
    "stall_check_seconds": "--stall-check-warning-time-seconds",
    "stall_shutdown_seconds": "--stall-check-shutdown-time-seconds",
    "autotune_warmup_steps": "--autotune-warmup-samples", "min_np": "--min-num-proc", "max_np": "--max-num-proc",
}
# ... Horovod's switches that turn a setting off (flag -> (field, value)) ...
HOROVODRUN_OFF = {"--no-hierarchical-allreduce": ("hierarchical_allreduce", "0"), "--no-autotune": ("autotune", "0"),
                  "--no-timeline-mark-cycles": ("timeline_mark_cycles", "0")}
# ... its stall inspector's switches, which set Horovod's own variable for the ranks (off wins over every stall
# time, as in Horovod: see aiacc.config.STALL_CHECK_DISABLE) ...
HOROVODRUN_STALL_SWITCHES = {"--no-stall-check": "1", "--stall-check": "0"}
# ... flags that choose what aiacc does not have (Gloo, NCCL streams, Horovod's log format, its Bayesian
# autotuner's knobs): accepted, and named as ignored on stderr with why (switches, then flags with a value) ...
_NOT_READ = _config.HOROVOD_NOT_READ  # (the same reasons as for Horovod's variables of these settings)
_LOG_FORMAT = _NOT_READ["HOROVOD_LOG_HIDE_TIME"]
_CONTROLLER = "aiacc's controller and CPU transport are always MPI's"
_BAYES = _NOT_READ["HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"]
HOROVODRUN_IGNORED = {
    "--verbose": "horovodrun's own output; aiacc's log level is --log-level",
    "--disable-cache": "horovodrun's cache of its start-up checks; aiaccrun keeps none",
    "--gloo": _CONTROLLER, "--mpi": _CONTROLLER, "--tcp": "MPI picks its transport (--mpi-args for MPICH's)",
    "--hierarchical-allgather": _NOT_READ["HOROVOD_HIERARCHICAL_ALLGATHER"],
    "--no-hierarchical-allgather": _NOT_READ["HOROVOD_HIERARCHICAL_ALLGATHER"],
    "--torus-allreduce": _NOT_READ["HOROVOD_TORUS_ALLREDUCE"], "--no-torus-allreduce": _NOT_READ["HOROVOD_TORUS_ALLREDUCE"],
    "--mpi-threads-disable": _NOT_READ["HOROVOD_MPI_THREADS_DISABLE"],
    "--no-mpi-threads-disable": _NOT_READ["HOROVOD_MPI_THREADS_DISABLE"],
    "--log-with-timestamp": _LOG_FORMAT, "--log-without-timestamp": _LOG_FORMAT,
    "--log-hide-timestamp": _LOG_FORMAT, "--no-log-hide-timestamp": _LOG_FORMAT,
    "--prefix-output-with-timestamp": _LOG_FORMAT,
}
HOROVODRUN_IGNORED_VALUES = {
    "--num-nccl-streams": _NOT_READ["HOROVOD_NUM_NCCL_STREAMS"],
    "--thread-affinity": _NOT_READ["HOROVOD_THREAD_AFFINITY"],
    "--gloo-timeout-seconds": _CONTROLLER,
    "--autotune-bayes-opt-max-samples": _BAYES, "--autotune-gaussian-process-noise": _BAYES,
    "--binding-args": "jsrun's process binding; aiaccrun starts ranks with mpiexec (--mpiexec-args for its binding)",
    "--blacklist-cooldown-range": "aiaccrun does not blacklist hosts; a restart asks the discovery script again",
}
HOROVODRUN_IGNORED_NARGS = {"--blacklist-cooldown-range": 2}  # (the ignored flags that take more than one value)
# ... and flags that would change where or how ranks start, which aiaccrun leaves to mpiexec: refused, with what
# to do instead (ignoring them would start the job somewhere else, or fail far from the cause).
HOROVODRUN_REFUSED = {
    "--ssh-port": "put the port in ~/.ssh/config (`Host node1` / `Port 2222`): mpiexec starts remote ranks with ssh",
    "--ssh-identity-file": "put it in ~/.ssh/config (`IdentityFile`): mpiexec starts remote ranks with ssh",
    "--output-filename": "redirect the output of aiaccrun, or give mpiexec its own option with --mpiexec-args",
    "--config-file": "give the settings as flags or AIACC_*/HOROVOD_* variables",
    "--jsrun": "aiaccrun starts ranks with the mpiexec of the MPI that mpi4py uses",
    "--slots-per-host": "give every host's slots in the discovery script's output (host:slots)",
    "--reset-limit": "aiacc restarts failed jobs: --max-restarts N with --elastic-dir DIR",
}
HOROVODRUN_REFUSED_SWITCHES = frozenset({"--jsrun"})  # the refused flags that take no value in horovodrun


def _flags_of(option) -> List[str]:
    """aiaccrun's flag for a setting, and horovodrun's name for it where it has one."""
    return [option.flag] + ([HOROVODRUN_ALIASES[option.field]] if option.field in HOROVODRUN_ALIASES else [])


def _parser() -> argparse.ArgumentParser:
    epilog_rows = "\n".join(f"  {'(aiaccrun sets it)' if o.field == 'enable' else o.flag:<30} {o.env:<34} "
                            f"default {'1 under aiaccrun' if o.field == 'enable' else o.default_text}"
                            for o in _config.OPTIONS)
    p = argparse.ArgumentParser(
        prog="aiaccrun",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run COMMAND as N ranks of one aiacc job.\n\n"
            "Launches through the mpiexec of the MPI that mpi4py uses (not whatever is first on PATH), sets\n"
            "AIACC_ENABLE=1, forwards every AIACC_* variable of this environment to all ranks, and turns the\n"
            "tuning flags below into their AIACC_* variables. Sets torchrun's RANK, WORLD_SIZE, LOCAL_RANK,\n"
            "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT on every rank (the last two unless set already), so\n"
            "torch.distributed's env:// rendezvous works (dist.init_process_group(\"aiacc\") after\n"
            "`import aiacc.torch`). Exits with the worst exit status of the ranks.\n\n"
            "Examples:\n"
            "  aiaccrun -np 2 python examples/pytorch_digits.py\n"
            "  aiaccrun -np 8 -H node1:4,node2:4 --cycle-time-ms 2 python train.py\n"
            "  aiaccrun -np 8 --hostfile hosts.txt --timeline run.json python train.py\n"
            "  aiaccrun --min-np 4 --max-np 16 --host-discovery-script ./hosts.sh --max-restarts 10 \\\n"
            "           --elastic-dir /shared/ckpt python train.py\n"
            "  aiaccrun --emulated-cluster emu -np 4 -H h0:2,h1:2 python train.py   (python -m aiacc.bench cluster up)\n\n"
            "Across hosts this is plain MPI (ssh by default). Inside a Slurm allocation hydra's mpiexec\n"
            "launches through Slurm by itself; with srun directly, run\n"
            "  srun --mpi=pmi2 -n 8 env AIACC_ENABLE=1 python train.py\n"
            "and a plain `mpiexec -n 2 -genv AIACC_ENABLE 1 python train.py` works too."
        ),
        epilog="Flags and the variables they set:\n" + epilog_rows,
    )
    p.add_argument("-np", "-n", "--num-proc", dest="np", type=int, metavar="N",
                   help="number of ranks to start (with --host-discovery-script: the default --min-np; optional)")
    p.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS,...",
                   help="hosts and how many ranks each takes, e.g. node1:4,node2:4")
    p.add_argument("--hostfile", "-hostfile", metavar="FILE",
                   help="file with one host per line: `host slots=N` or `host:N`")
    p.add_argument("--print-command", action="store_true",
                   help="print the mpiexec command line instead of running it")
    p.add_argument("--mpiexec-args", "--mpi-args", default="", metavar="'ARGS'",
                   help="extra arguments passed to mpiexec before COMMAND (one string)")
    tuning = p.add_argument_group("tuning flags (each sets its AIACC_* variable on every rank)")
    for o in _config.OPTIONS:
        if o.field == "enable":
            continue
        flags = _flags_of(o)
        if o.flag_takes_value:
            tuning.add_argument(*flags, dest=o.field, metavar="VALUE", help=f"{o.help} Sets {o.env}.")
        else:
            tuning.add_argument(*flags, dest=o.field, action="store_true", default=None,
                                help=f"{o.help} Sets {o.env}=1.")
    hvd = p.add_argument_group(
        "horovodrun's flags", "Horovod's names for the settings above (--timeline-filename, --autotune-log-file, "
        "--stall-check-warning-time-seconds, --stall-check-shutdown-time-seconds, --autotune-warmup-samples, "
        "--min-num-proc, --max-num-proc, --num-proc, --mpi-args, -hostfile) and these:")
    hvd.add_argument("-v", "--version", action="store_true", help="print aiacc's version and exit")
    hvd.add_argument("-cb", "--check-build", action="store_true",
                     help="print the frameworks, controllers and tensor operations this aiacc has, and exit")
    hvd.add_argument("--network-interface", "--network-interfaces", dest="network_interface", metavar="IFACE",
                     help="the network interface between hosts (passed to mpiexec)")
    for flag in HOROVODRUN_OFF:
        hvd.add_argument(flag, dest="horovod_off", action="append_const", const=flag, help=argparse.SUPPRESS)
    for flag in HOROVODRUN_IGNORED:
        extra = ("-prefix-timestamp",) if flag == "--prefix-output-with-timestamp" else ()
        hvd.add_argument(flag, *extra, dest="horovod_ignored", action="append_const", const=flag, help=argparse.SUPPRESS)
    for flag in HOROVODRUN_STALL_SWITCHES:
        hvd.add_argument(flag, dest="horovod_stall", action="append_const", const=flag, help=argparse.SUPPRESS)
    for flag in HOROVODRUN_IGNORED_VALUES:
        hvd.add_argument(flag, dest="horovod_ignored", action="append", nargs=HOROVODRUN_IGNORED_NARGS.get(flag),
                         type=lambda value, flag=flag: flag, help=argparse.SUPPRESS)
    for flag in HOROVODRUN_REFUSED:
        short = {"--ssh-port": ("-p",), "--ssh-identity-file": ("-i",)}.get(flag, ())
        if flag in HOROVODRUN_REFUSED_SWITCHES:  # (a switch: what follows it is the command)
            hvd.add_argument(flag, dest="horovod_refused", action="append_const", const=flag, help=argparse.SUPPRESS)
        else:
            hvd.add_argument(*short, flag, dest="horovod_refused", action="append", nargs="?",
                             type=lambda value, flag=flag: flag, const=flag, help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND ...", help="the program each rank runs")
    return p


def network_interface_args(family: str, interfaces: str) -> List[str]:
    """mpiexec's arguments for horovodrun's ``--network-interface``: the interface(s) ranks on different hosts
    talk over (hydra takes one)."""
    names = [i for i in interfaces.split(",") if i]
    if family == MPIFamily.OPEN_MPI:
        joined = ",".join(names)
        return ["--mca", "btl_tcp_if_include", joined, "--mca", "oob_tcp_if_include", joined]
    if len(names) != 1:
        raise LauncherError(f"--network-interface {interfaces!r}: MPICH's mpiexec takes one interface (-iface)")
    return ["-iface", names[0]]


def check_local_interface(name: str) -> None:
    """Hydra's mpiexec listens on ``-iface`` on this host: one that is not here was its four-line error and
    status 255 (Open MPI looks the interfaces up on each host itself)."""
    try:
        here = [n for _, n in socket.if_nameindex()]
    except OSError:  # (no way to list them here: hydra says it)
        return
    if name not in here:
        raise LauncherError(f"--network-interface {name!r}: no such interface on this host (it has "
                            f"{', '.join(here)}); hydra's mpiexec listens on it here")


def check_build() -> str:
    """``horovodrun --check-build`` for aiacc: which frameworks import here, the controller and the operations."""
    import importlib.util  # noqa: PLC0415

    def mark(ok: bool) -> str:
        return "[X]" if ok else "[ ]"

    frameworks = [("TensorFlow", "tensorflow"), ("PyTorch", "torch"), ("MXNet", "mxnet")]
    lines = [f"aiacc v{_version()}:", "", "Available Frameworks:"]
    lines += [f"    {mark(importlib.util.find_spec(module) is not None)} {name}" for name, module in frameworks]
    lines += ["", "Available Controllers:", f"    {mark(True)} MPI", f"    {mark(False)} Gloo", "",
              "Available Tensor Operations:", f"    {mark(importlib.util.find_spec('cupy') is not None)} NCCL",
              f"    {mark(False)} DDL", f"    {mark(False)} CCL", f"    {mark(True)} MPI", f"    {mark(False)} Gloo"]
    return "\n".join(lines)


def _version() -> str:
    from . import __version__  # noqa: PLC0415

    return __version__


def _typed_flag(option, argv: Sequence[str]) -> str:
    """The flag of ``option`` as the user typed it (aiacc's, or horovodrun's name for it), for messages."""
    alias = HOROVODRUN_ALIASES.get(option.field)
    if alias is not None and any(a == alias or a.startswith(alias + "=") for a in argv):
        return alias
    return option.flag


def _rank_env(args, argv: Sequence[str] = ()):
    """The ranks' AIACC_* environment from aiaccrun's flags and this one, and the settings it makes (checked)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("AIACC_")}
    off = {HOROVODRUN_OFF[flag][0]: HOROVODRUN_OFF[flag][1] for flag in getattr(args, "horovod_off", None) or ()}
    for o in _config.OPTIONS:
        value = getattr(args, o.field, None)
        if o.field in off:
            if value is not None:
                raise LauncherError(f"{_typed_flag(o, argv)} and "
                                    f"{next(f for f, v in HOROVODRUN_OFF.items() if v[0] == o.field)} contradict each other")
            env[o.env] = off[o.field]
            continue
        if value is None:
            continue
        try:
            text = o.flag_to_env(str(value)) if o.flag_to_env else str(value)
            o.parse(text)
        except (ValueError, TypeError, OverflowError) as exc:
            reason = str(exc) if str(exc).startswith("expected") else f"expected {o.accepts}"
            if o.flag_to_env is not None and "bytes" in reason:  # (a flag in MiB: not the variable's bytes)
                reason = f"expected a number of MiB {'> 0' if '> 0' in reason + o.accepts else '>= 0'} such as 64"
            raise LauncherError(f"{_typed_flag(o, argv)} {value!r} is not valid: {reason}") from None
        env[o.env] = text
    stall = set(getattr(args, "horovod_stall", None) or ())
    if len(stall) > 1:
        raise LauncherError("--stall-check and --no-stall-check contradict each other")
    if stall:
        env[_config.STALL_CHECK_DISABLE] = HOROVODRUN_STALL_SWITCHES[stall.pop()]
    given = env.get("AIACC_ENABLE", "").strip()
    try:
        if given and not _config._parse_bool(given):
            # (it was replaced by 1 without a word: the engine ran where the user had switched it off)
            raise LauncherError(f"AIACC_ENABLE={env['AIACC_ENABLE']!r} switches aiacc off, and aiaccrun runs it on "
                                "every rank: unset AIACC_ENABLE (or set it to 1), or run the script without aiaccrun "
                                "(`python train.py`) to train without aiacc")
    except ValueError as exc:
        raise LauncherError(f"AIACC_ENABLE={env['AIACC_ENABLE']!r} is not valid: {exc}") from None
    env["AIACC_ENABLE"] = "1"
    # every value the ranks will read must be valid before anything starts, Horovod's names for aiacc's settings
    # too: they reach the ranks with the rest of this environment (a bad one was a traceback on every rank)
    config = _launch_config(env)
    if config.hosts_per_node > 0:  # as a plain number for the rank shell line (' 2', '+2', '08' are 2 and 8 here)
        env["AIACC_HOSTS_PER_NODE"] = str(config.hosts_per_node)
    return env, config


def open_mpi_options(words: Sequence[str]) -> str:
    """Why ``words`` (--mpi-args) cannot go to hydra's mpiexec ('' when they can): Open MPI's options that
    horovodrun users pass, with MPICH's form of each."""
    for i, word in enumerate(words):
        if word in ("-x", "--x"):
            given = words[i + 1] if i + 1 < len(words) else "NAME"
            name, _, value = given.partition("=")
            return (f"{word} {given} is Open MPI's; this mpiexec is MPICH's (hydra), which gives every rank aiaccrun's "
                    f"whole environment: set it for aiaccrun ({name}={value or '...'} aiaccrun ...) or pass -genv "
                    f"{name} {value or 'VALUE'}")
        if word in ("-mca", "--mca", "--map-by", "--bind-to", "-npernode", "--npernode", "--oversubscribe"):
            return (f"{word} is Open MPI's; this mpiexec is MPICH's (hydra), whose options `mpiexec -help` lists "
                    "(-bind-to, -ppn, -genv NAME VALUE)")
    return ""


def _warn_idle_flags(args, argv: Sequence[str], launch, discovery: bool) -> None:
    """A warning for each flag typed that does nothing in this run (they were taken without a word): the autotuner's
    without --autotune, --elastic-timeout without --host-discovery-script."""
    idle = {"autotune_log": "--autotune", "autotune_warmup_steps": "--autotune",
            "autotune_steps_per_sample": "--autotune", "elastic_timeout": "--host-discovery-script"}
    for o in _config.OPTIONS:
        needs = idle.get(o.field)
        if needs and getattr(args, o.field, None) is not None and not (
                launch.autotune if needs == "--autotune" else discovery):
            print(f"aiaccrun: warning: {_typed_flag(o, argv)} applies only with {needs}; it does nothing in this run",
                  file=sys.stderr, flush=True)


def _launch_config(env: Dict[str, str]):
    """The settings of the ranks' environment: ``env`` (the AIACC_* variables aiaccrun gives them) and Horovod's
    variables for the same settings in this one, which reach the ranks with the rest of it."""
    horovod = {k: v for k, v in os.environ.items()
               if k in _config.HOROVOD_VARIABLES or k == _config.STALL_CHECK_DISABLE}
    return _config.from_env({**horovod, **env})


def _attach_dash_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> List[str]:
    """``--mpiexec-args -verbose`` as ``--mpiexec-args=-verbose``: argparse takes a lone value that starts
    with a dash for a flag of its own and stops ("expected one argument"). Only aiaccrun's flags before
    COMMAND are looked at (COMMAND's own arguments go through untouched)."""
    takes_value = {flag: 1 if action.nargs is None else action.nargs for action in parser._actions
                   if action.option_strings and (action.nargs is None or isinstance(action.nargs, int))
                   for flag in action.option_strings}  # (switches have nargs=0)
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token in ("--mpiexec-args", "--mpi-args") and i + 1 < len(argv):
            out.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        if not token.startswith("-"):  # COMMAND starts here
            return out + list(argv[i:])
        out.append(token)
        values = takes_value.get(token, 0)  # its values, whatever they look like
        out += argv[i + 1:i + 1 + values]
        i += 1 + values
    return out


_BOOL_WORDS = {"0", "1", "true", "false", "yes", "no", "on", "off"}
# the flags that take no value (and horovodrun's names for them)
_BARE_SWITCHES = {flag: o for o in _config.OPTIONS if not o.flag_takes_value for flag in _flags_of(o)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_attach_dash_values(parser, argv))
    if args.version:
        print(f"aiacc {_version()}")
        return 0
    if args.check_build:
        print(check_build())
        return 0
    if args.horovod_refused:
        flag = args.horovod_refused[0]
        print(f"aiaccrun: error: horovodrun's {flag} is not taken: {HOROVODRUN_REFUSED[flag]}", file=sys.stderr)
        return 2
    ignored = list(dict.fromkeys(f for got in args.horovod_ignored or () for f in ([got] if isinstance(got, str) else got)))
    if {"--gloo", "--mpi"} <= set(ignored):
        parser.error("--gloo and --mpi contradict each other (horovodrun takes one controller; aiacc always uses MPI)")
    if ignored:
        why = {**HOROVODRUN_IGNORED, **HOROVODRUN_IGNORED_VALUES}
        print(f"aiaccrun: ignoring horovodrun's {', '.join(ignored)}: no meaning for aiacc ("
              + "; ".join(f"{flag}: {why[flag]}" for flag in ignored) + ")", file=sys.stderr, flush=True)
    if not args.command:
        parser.error("no COMMAND given (e.g. `aiaccrun -np 2 python train.py`)")
    switch = argv[len(argv) - len(args.command) - 1] if len(argv) > len(args.command) else ""
    if args.command[0].lower() in _BOOL_WORDS and switch in _BARE_SWITCHES:
        # (`--autotune 1 python train.py` ran "1" as each rank's program: status 127)
        o = _BARE_SWITCHES[switch]
        off = next((f for f, (field, _) in HOROVODRUN_OFF.items() if field == o.field), None)
        parser.error(f"{switch} takes no value (it sets {o.env}=1; for 0 leave it out"
                     + (f" or give {off}" if off else "") + f"): {args.command[0]!r} would be the command")
    if args.command[0] == "--":
        args.command = args.command[1:]
    if args.np is not None and args.np <= 0:
        parser.error("-np must be at least 1")
    unrunnable = _not_a_command(args.command[0])
    if unrunnable:
        np_flag = f"-np {args.np} " if args.np is not None else ""
        runner = "python" if args.command[0].endswith(".py") else "its interpreter"
        parser.error(f"{args.command[0]!r} {unrunnable}: run it as `aiaccrun {np_flag}{runner} "
                     f"{shlex.join(args.command)}`" + (" or make it executable (chmod +x)" if unrunnable
                                                        == "is not executable" else ""))
    try:
        env, launch = _rank_env(args, argv[:len(argv) - len(args.command)])
        discovery = env.get("AIACC_HOST_DISCOVERY_SCRIPT", "")
        _warn_idle_flags(args, argv[:len(argv) - len(args.command)], launch, bool(discovery))
        if discovery:
            if args.hosts or args.hostfile:
                raise LauncherError("--host-discovery-script gives the hosts at every start: leave out -H/--hostfile")
            ranks = rank_range(args.np, env)
            env["AIACC_MIN_NP"] = str(ranks.min_np)  # the ranks accept commits of world sizes in the range
        else:
            if args.np is None:
                parser.error("-np N is required (or --host-discovery-script, which finds the hosts)")
            unused = [o.flag for o in _config.OPTIONS if o.field in ("min_np", "max_np") and env.get(o.env, "0") != "0"]
            if unused:
                raise LauncherError(f"{' and '.join(unused)} {'apply' if len(unused) > 1 else 'applies'} only "
                                    "with --host-discovery-script (AIACC_HOST_DISCOVERY_SCRIPT)")
        hosts = parse_hosts(args.hosts, args.hostfile)
        slots = sum(n for _, n in hosts)
        if hosts and args.np is not None and args.np > slots:
            # (hydra would start the extra ranks on the hosts again, round-robin: more ranks than cores or GPUs)
            raise LauncherError(f"-np {args.np} is more than the {slots} slots of {_describe_hosts(hosts)}; give "
                                "each host its slots (-H host:N) or a smaller -np")
        mpiexec, family = find_mpiexec(env.get("AIACC_MPIEXEC", ""))
        cluster_args: List[str] = []
        if env.get("AIACC_EMULATED_CLUSTER"):
            if discovery:
                raise LauncherError("--emulated-cluster and --host-discovery-script both give the hosts: use one")
            hosts, cluster_args, cluster_env = emulated_cluster(env["AIACC_EMULATED_CLUSTER"], hosts, args.np, family)
            env.update(cluster_env)
    except (LauncherError, ConfigError) as exc:
        print(f"aiaccrun: error: {exc}", file=sys.stderr)
        return 2
    extra = cluster_args + (shlex.split(args.mpiexec_args) if args.mpiexec_args else [])  # (quotes group words)
    foreign = open_mpi_options(extra) if family == MPIFamily.HYDRA else ""
    if foreign:  # (hydra's own message was a parser trace: "match_arg ...: unrecognized argument x")
        print(f"aiaccrun: error: --mpi-args {foreign}", file=sys.stderr)
        return 2
    if args.network_interface:
        try:
            extra += network_interface_args(family, args.network_interface)
            if family == MPIFamily.HYDRA and not args.print_command:
                check_local_interface(args.network_interface)
        except LauncherError as exc:
            print(f"aiaccrun: error: {exc}", file=sys.stderr)
            return 2
    restarts = int(env.get("AIACC_MAX_RESTARTS", "0") or 0)
    if restarts and not env.get("AIACC_ELASTIC_DIR"):
        print("aiaccrun: error: --max-restarts (AIACC_MAX_RESTARTS) needs --elastic-dir (AIACC_ELASTIC_DIR): a "
              "restarted job resumes from the commits of hvd.elastic written there", file=sys.stderr)
        return 2
    if discovery and not restarts and not args.print_command:
        # (horovodrun's elastic mode, which the same command line starts, recovers from a failed rank by itself:
        # here that takes a number of restarts and a commit directory, so say it rather than fail without a word)
        print("aiaccrun: --host-discovery-script without --max-restarts: the hosts are discovered at this start only, "
              "and a rank that fails ends the job (horovodrun's elastic mode would restart it); for that give "
              "--max-restarts N --elastic-dir DIR", file=sys.stderr, flush=True)
    stopped = []  # the signal that ended the launcher: no restart after it
    running: List[Optional[subprocess.Popen]] = []  # the mpiexec of the start under way (None while it starts)

    def stop(signum, _frame):
        stopped.append(signum)
        if running:
            # (a Ctrl-C typed in the terminal reached mpiexec itself: a second one from here made hydra force an
            # abort, and the scripts' own `except KeyboardInterrupt` never ran; a second Ctrl-C is passed on)
            typed = signum == signal.SIGINT and stopped.count(signum) == 1 and _typed_in_our_terminal(running[0])
            if running[0] is not None and not typed:
                running[0].send_signal(signum)  # its ranks end; nothing is started after it
            return
        # between starts (waiting for --host-discovery-script's hosts, or about to restart): there is no mpiexec to
        # pass it to, and a signal only recorded here was noticed after the next start had run in full
        print(f"aiaccrun: stopped by {signal.Signals(signum).name} before the job's next start (no rank is running)",
              file=sys.stderr, flush=True)
        sys.exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    np = args.np
    for attempt in range(restarts + 1):
        env["AIACC_RESTART_COUNT"] = str(attempt)
        if discovery:  # the hosts there now (the script sees AIACC_RESTART_COUNT)
            try:
                # (Horovod's HOROVOD_ELASTIC_TIMEOUT too: the launcher reads it, as horovodrun's driver does)
                timeout_name = launch.variable("elastic_timeout")
                hosts = wait_for_hosts(discovery, ranks.min_np, launch.elastic_timeout, dict(os.environ, **env),
                                       timeout_name="--elastic-timeout" if timeout_name.startswith("AIACC_")
                                       else timeout_name, first=attempt == 0)
            except LauncherError as exc:
                print(f"aiaccrun: error: {exc}", file=sys.stderr, flush=True)
                return 2
            np = ranks.ranks(hosts)
            print(f"aiaccrun: start {attempt}: {np} rank{'s' if np != 1 else ''} on {_describe_hosts(hosts)} (from --host-discovery-script)",
                  file=sys.stderr, flush=True)
        attempt_env = dict(env, **torchrun_env(hosts))  # a fresh rendezvous port for every start
        cmd = build_command(mpiexec, family, np, hosts, attempt_env, torchrun_command(args.command), extra)
        if args.print_command:
            print(" ".join(_quote(c) for c in cmd))
            return 0
        exit_dir = tempfile.mkdtemp(prefix="aiaccrun-exits-")
        attempt_env["AIACC_EXIT_DIR"] = exit_dir  # (not in cmd: the ranks inherit mpiexec's environment)
        segments = exits.mpich_segments()
        try:
            code, statuses, left = _run_job(cmd, attempt_env, family, mpiexec, stopped, running, exit_dir, np)
            unfinished = exits.unfinished(exit_dir)
            final = exits.restart_refused(exit_dir) if code else None
        finally:
            shutil.rmtree(exit_dir, ignore_errors=True)
        if code:  # (a rank killed or aborted left MPICH's shared memory behind; MPI_Finalize removes it)
            exits.remove_orphaned_segments(segments)
        code, failure = job_outcome(code, statuses, unfinished, bool(stopped), left)
        if code == 0 or stopped or not restarts or final:
            if code and not stopped and (statuses or unfinished):  # (MPI's banner names a process id, not the rank)
                print(f"aiaccrun: the job failed: {failure}", file=sys.stderr, flush=True)
            if code and final and restarts and not stopped:
                print(f"aiaccrun: not starting the job again (--max-restarts): a restart would fail the same way: "
                      f"{final}", file=sys.stderr, flush=True)
            return code
        if attempt < restarts:
            print(f"aiaccrun: the job failed ({failure}); starting it again: restart {attempt + 1} of {restarts}",
                  file=sys.stderr, flush=True)
        else:
            print(f"aiaccrun: error: the job failed {attempt + 1} times and --max-restarts {restarts} are used up; "
                  f"last failure: {failure}", file=sys.stderr, flush=True)
    return code


def _typed_in_our_terminal(proc: Optional[subprocess.Popen]) -> bool:
    """Whether ``proc`` shares this process's group and that group is the foreground one of the controlling
    terminal: a Ctrl-C typed there has then reached ``proc`` as well."""
    try:
        return proc is not None and _in_the_foreground() and os.getpgid(proc.pid) == os.getpgrp()
    except OSError:
        return False


def _in_the_foreground() -> bool:
    """Whether this process's group is the foreground one of its controlling terminal (an interactive run)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:  # no controlling terminal
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _ended_with_us():
    """mpiexec's ``preexec_fn``: it gets SIGTERM (and ends the ranks) when aiaccrun dies, by SIGKILL too (a
    scheduler's, ``timeout -k``), as horovodrun's middleman does; mpiexec and the ranks went on, orphaned, with
    nobody collecting their output or exit status. Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # (looked up here: the child only calls it)
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm():
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # (aiaccrun died before that)
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _run_job(cmd, env, family, mpiexec, stopped, running, exit_dir=None, np=None) -> Tuple[int, List[int], bool]:
    """Run one start of the job: (the worst exit status, the ranks' raw wait statuses if MPI listed them, whether
    it was ended after a rank left by os._exit: ``exits.LeaverWatch`` over ``exit_dir``). ``running`` holds its
    mpiexec meanwhile, for main's signal handler to forward SIGINT and SIGTERM to."""
    child_env = dict(os.environ)
    child_env.update(env)
    running[:] = [None]
    try:
        try:
            # Not in a terminal's foreground, mpiexec runs in a process group of its own: a signal sent to
            # aiaccrun's group (`kill -INT -PGID`, GNU timeout's, a batch system's) reached mpiexec twice, directly
            # and passed on from here, and hydra took two SIGINTs for a double Ctrl-C: it forced an abort, the
            # scripts' `except KeyboardInterrupt` did not run, and the job ended with status 0 now and then. In the
            # foreground it stays in ours: it reads the terminal (stdin) and a typed Ctrl-C reaches it directly.
            proc = subprocess.Popen(cmd, env=child_env, preexec_fn=_ended_with_us(),
                                    process_group=None if _in_the_foreground() else 0,
                                    stdout=subprocess.PIPE if family == MPIFamily.HYDRA else None)
        except OSError as exc:
            print(f"aiaccrun: error: cannot start {mpiexec}: {exc.strerror}", file=sys.stderr)
            return 2, [], False
        running[0] = proc
        if stopped:  # (a signal while mpiexec started)
            proc.send_signal(stopped[-1])
        watch = None
        if exit_dir:
            def end(left: exits.Unfinished) -> None:
                print(f"aiaccrun: {left.leavers} {exits.LEAVE_GRACE:g} s ago and {left.ranks} still "
                      f"run{'' if len(left.killed) > 1 else 's'} (mpiexec ends the ranks of the leaving rank's host "
                      "only): ending the job", file=sys.stderr, flush=True)
                proc.send_signal(signal.SIGTERM)

            watch = exits.LeaverWatch(exit_dir, lambda: proc.poll() is None, end)
            watch.start()
        statuses: List[int] = []
        try:
            if proc.stdout is not None:
                out = getattr(sys.stdout, "buffer", sys.stdout)
                ExitCodeFilter(out, statuses.extend).run(proc.stdout.fileno())
            code = proc.wait()
        finally:
            if watch is not None:
                watch.stop()
    finally:
        running.clear()
    code = 128 - code if code < 0 else code
    if np is not None and len(statuses) != np:
        # (a host whose proxy died is missing from hydra's list: the others' codes are not in rank order; "rank 1
        # was killed" was said of rank 3)
        statuses = []
    if stopped and not statuses and code == 0:  # (hydra's forced abort lists no statuses and ends with 0)
        code = 128 + stopped[0]
    return (worst_status(statuses) if statuses else code), statuses, watch is not None and watch.ended is not None


def job_outcome(code: int, wait_statuses: Sequence[int], unfinished: Optional[exits.Unfinished], stopped: bool,
                ended_after_leave: bool = False):
    """(exit code, failure text) of a job from mpiexec's code, the ranks' wait statuses and ``exits.unfinished``.
    A rank that left by os._exit ends the job: hydra kills the others and reports status 0 for them, or now and
    then SIGKILL (seen in CI); either way the cause is the rank that left (exit code 1). So too where aiaccrun
    ended it (``ended_after_leave``: the other hosts' ranks went on). Where MPI listed no rank's status (a host's
    ranks ended abnormally: "exit status 255"), the ranks that did not end by themselves are named."""
    by_hydra = all(_exit_code(s) in (0, 128 + signal.SIGKILL) for s in wait_statuses)
    if unfinished and not stopped and (code == 0 or ((by_hydra or ended_after_leave) and unfinished.left)):
        return 1, unfinished.report
    if unfinished and not stopped and not wait_statuses:
        return code, f"exit status {code}, and mpiexec listed no rank's status; {unfinished.not_ended}"
    return code, describe_failure(wait_statuses, code)


def describe_failure(wait_statuses: Sequence[int], code: int, most: int = 4) -> str:
    """Every failed rank and how it ended (the first ``most``), from the ranks' raw wait statuses (in rank
    order). All of them, not the first: when one rank dies, hydra kills the others, and now and then it
    records one of those as killed by SIGKILL too, so which rank failed first cannot be told from them."""
    failed = [(f"rank {rank} was killed by signal {s & 0x7F}" if s & 0x7F else
               f"rank {rank} exited with status {_exit_code(s)}")
              for rank, s in enumerate(wait_statuses) if _exit_code(s)]
    if not failed:
        return f"exit status {code}"
    more = f", {len(failed) - most} more" if len(failed) > most else ""
    return ", ".join(failed[:most]) + more


def _exit_code(wait_status: int) -> int:
    """A raw wait status as an exit code (a signal N counts as 128+N)."""
    return 128 + (wait_status & 0x7F) if wait_status & 0x7F else (wait_status >> 8) & 0xFF


def worst_status(wait_statuses: Sequence[int]) -> int:
    """The worst exit status among raw wait statuses (a signal N counts as 128+N)."""
    codes = [_exit_code(s) for s in wait_statuses]
    return max(codes) if codes else 0


class ExitCodeFilter:
    """Forwards mpiexec's stdout as it comes, minus hydra's "Exit codes:" line, which it parses.

    Output is passed on chunk by chunk (progress bars without newlines still show); only a
    line that starts like ``[mpiexec@`` is held until its end to see whether it is that line.
    """

    MARK = b"[mpiexec@"

    def __init__(self, out, on_statuses):
        self.out = out
        self.on_statuses = on_statuses
        self.pending = b""
        self.at_line_start = True
        # with several hosts hydra puts each further host's codes on a line of its own: "[host] 0,0"
        self.in_codes = False

    def feed(self, chunk: bytes) -> bytes:
        data = self.pending + chunk
        self.pending = b""
        emitted = []
        while data:
            nl = data.find(b"\n")
            line = data if nl < 0 else data[:nl + 1]
            held = line.startswith(self.MARK) or self.MARK.startswith(line) or (self.in_codes and line[:1] == b"[")
            if self.at_line_start and held:
                if nl < 0:
                    self.pending = data
                    break
                if b"Exit codes:" in line:
                    self._parse(line)
                    self.in_codes = True
                elif self.in_codes and self._HOST_CODES.fullmatch(line.rstrip(b"\r\n")):
                    self._parse(b"Exit codes: " + line)
                else:
                    self.in_codes = False
                    emitted.append(line)
            else:
                self.in_codes = False
                emitted.append(line)
                self.at_line_start = nl >= 0
            data = data[len(line):]
        return b"".join(emitted)

    _HOST_CODES = re.compile(rb"\[[^\]]*\] [0-9,]+")

    def _parse(self, line: bytes) -> None:
        rest = line.split(b"Exit codes:", 1)[1].decode(errors="replace")
        self.on_statuses([int(x) for x in re.findall(r"\d+", re.sub(r"\[[^\]]*\]", " ", rest))])

    def run(self, fd: int) -> None:
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except InterruptedError:
                continue
            if not chunk:
                break
            self._write(self.feed(chunk))
        if self.pending:
            self._write(self.pending)

    def _write(self, data: bytes) -> None:
        if data:
            try:
                self.out.write(data)
                self.out.flush()
            except (BrokenPipeError, ValueError):
                pass


def _quote(text: str) -> str:
    import shlex  # noqa: PLC0415

    return shlex.quote(text)


if __name__ == "__main__":
    sys.exit(main())
