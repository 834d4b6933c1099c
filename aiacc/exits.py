"""How each rank of an ``aiaccrun`` job ended, for the launcher: a rank that never ended by itself.

MPICH's mpiexec (hydra) ends the other ranks with SIGKILL when one leaves the job without shutting MPI
down (``os._exit(0)`` in the middle of training, a library calling it), and then lists every rank's exit
status as 0: the job looked successful with the training unfinished (rank 0 stopped at step 5 of 20, no
message). So each rank on a host that sees the launcher's directory (``AIACC_EXIT_DIR``, set by aiaccrun)
leaves a file there when ``init()`` runs and another when the process ends by itself (the interpreter's
exit, any status; or ``os._exit``, which skips that, saying so); the launcher names the ranks with the
first file and not the second. A job whose ranks all end with ``os._exit`` (a way to skip slow teardown)
stays a success. Ranks on hosts without that directory (no shared file system) write nothing.

On several hosts hydra ends only the leaving rank's host: the other hosts' ranks waited for it until the stall
shutdown (30 minutes by default). ``LeaverWatch`` ends such a job from the launcher, as hydra does on one host.
A failed start also leaves MPICH's shared-memory segments behind (MPI_Finalize removes them; a killed or aborted
rank does not): ``remove_orphaned_segments``.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Set

__all__ = ["watch", "unfinished", "Unfinished", "no_restart", "restart_refused", "LeaverWatch", "mpich_segments",
           "remove_orphaned_segments"]

LEAVE_GRACE = 5.0  # seconds the other ranks may still run after one left by os._exit before the launcher ends them

_watched: Dict[str, int] = {}  # the file prefix -> the pid that wrote it (a forked child is not the rank)


def watch(rank: int, environ=os.environ) -> None:
    """Called by ``init()``: this process is rank ``rank`` of the job."""
    folder = environ.get("AIACC_EXIT_DIR")
    if not folder:
        return
    prefix = os.path.join(folder, f"rank{rank}")
    if not _write(prefix + ".started", ""):
        return
    first = not _watched
    _watched[prefix] = os.getpid()
    if first:
        atexit.register(_ended, "exit")
        real_exit = os._exit

        def _exit(status):
            _ended(f"os._exit({status})")
            real_exit(status)

        os._exit = _exit


def no_restart(reason: str, environ=os.environ) -> None:
    """This rank fails with an error that a restart of the job would meet again (an elastic directory holding
    another job's commits, a state that cannot be saved): ``aiaccrun --max-restarts`` does not start it again."""
    folder = environ.get("AIACC_EXIT_DIR")
    if folder:
        _write(os.path.join(folder, "no-restart"), reason)


def restart_refused(folder: str) -> Optional[str]:
    """Why a rank said the job must not be started again (``no_restart``), or None."""
    try:
        with open(os.path.join(folder, "no-restart")) as f:
            return f.read()
    except OSError:
        return None


def _ended(how: str) -> None:
    pid = os.getpid()
    for prefix, owner in _watched.items():
        if owner == pid:
            _write(prefix + ".ended", how)


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


class Unfinished(NamedTuple):
    """Ranks that started but did not end by themselves (``killed``), and those that left by ``os._exit``
    (``left``: rank -> how), the likely cause; ``report`` says it in words."""

    killed: List[int]
    left: Dict[int, str]

    @property
    def leavers(self) -> str:
        """``rank 1 called os._exit(0), ...``: who left and how."""
        return ", ".join(f"rank {r} called {how}" for r, how in sorted(self.left.items()))

    @property
    def ranks(self) -> str:
        """``rank 0`` or ``ranks 0, 2``: the ranks that did not end by themselves."""
        return f"rank{'s' if len(self.killed) > 1 else ''} {', '.join(map(str, self.killed))}"

    @property
    def report(self) -> str:
        cause = f" after {self.leavers} while the others ran" if self.left else ""
        return (f"{self.ranks} did not finish: mpiexec ended {'them' if len(self.killed) > 1 else 'it'}{cause} (a "
                "rank that leaves without shutting aiacc down ends the job)")

    @property
    def not_ended(self) -> str:
        """The ranks that did not end by themselves, for a failure MPI gave no rank's status of."""
        return (f"{self.ranks} did not end by {'themselves' if len(self.killed) > 1 else 'itself'} (killed by a "
                "signal, or ended by mpiexec after another rank failed)")


def unfinished(folder: str) -> Optional[Unfinished]:
    """The ranks that started but did not end by themselves, by the files in ``folder`` (None if none)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    started = sorted(int(n[4:-8]) for n in names if n.startswith("rank") and n.endswith(".started"))
    ended = {}
    for n in names:
        if n.startswith("rank") and n.endswith(".ended"):
            try:
                with open(os.path.join(folder, n)) as f:
                    ended[int(n[4:-6])] = f.read()
            except (OSError, ValueError):
                continue
    killed = [r for r in started if r not in ended]
    if not killed:
        return None
    return Unfinished(killed, {r: how for r, how in ended.items() if how.startswith("os._exit")})


class LeaverWatch(threading.Thread):
    """While a start runs, ends it (``end()``, once) when a rank left by ``os._exit`` ``grace`` seconds ago and
    others still run: hydra does that at once on one host, but not to the ranks of other hosts, which waited for
    the one that left until the stall shutdown. ``ended``: the ``Unfinished`` that made it act, or None."""

    def __init__(self, folder: str, running: Callable[[], bool], end: Callable[[Unfinished], None],
                 grace: float = LEAVE_GRACE, every: float = 0.5):
        super().__init__(name="aiaccrun-leavers", daemon=True)
        self.folder, self.running, self.end, self.grace, self.every = folder, running, end, grace, every
        self.ended: Optional[Unfinished] = None
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        first = None
        while not self._stop.wait(self.every) and self.running():
            left = unfinished(self.folder)
            if left is None or not left.left:
                continue
            first = time.monotonic() if first is None else first
            if time.monotonic() - first >= self.grace and self.running():
                self.ended = left
                self.end(left)
                return


SHM = "/dev/shm"


def mpich_segments() -> Set[str]:
    """The names of MPICH's shared-memory segments on this host now."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith("mpich_shm_")}
    except OSError:
        return set()


def remove_orphaned_segments(before: Set[str]) -> List[str]:
    """Remove MPICH's shared-memory segments made since ``before`` that no process maps or holds open any more
    (what a failed start's ranks left: a few MiB of memory per host and start, until the next reboot); returns
    their names. A segment another job is using is mapped by its ranks and stays."""
    new = mpich_segments() - before
    if not new:
        return []
    used: Set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                used.update(line.rsplit("/", 1)[1].split()[0] for line in f if "/mpich_shm_" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if "/mpich_shm_" in target:
                    used.add(target.rsplit("/", 1)[1].split()[0])
        except OSError:
            continue
    removed = []
    for name in sorted(new - used):
        try:
            os.unlink(os.path.join(SHM, name))
            removed.append(name)
        except OSError:
            pass
    return removed
