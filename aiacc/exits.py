"""How each rank of an ``aiaccrun`` job ended, for the launcher: a rank that never ended by itself.

MPICH's mpiexec (hydra) ends the other ranks with SIGKILL when one leaves the job without shutting MPI
down (``os._exit(0)`` in the middle of training, a library calling it), and then lists every rank's exit
status as 0: the job looked successful with the training unfinished (rank 0 stopped at step 5 of 20, no
message). So each rank on a host that sees the launcher's directory (``AIACC_EXIT_DIR``, set by aiaccrun)
leaves a file there when ``init()`` runs and another when the process ends by itself (the interpreter's
exit, any status; or ``os._exit``, which skips that, saying so); the launcher names the ranks with the
first file and not the second. A job whose ranks all end with ``os._exit`` (a way to skip slow teardown)
stays a success. Ranks on hosts without that directory (no shared file system) write nothing.
"""

from __future__ import annotations

import atexit
import os
from typing import Dict, List, NamedTuple, Optional

__all__ = ["watch", "unfinished", "Unfinished", "no_restart", "restart_refused"]

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
    def report(self) -> str:
        killed = self.killed
        cause = ""
        if self.left:
            cause = " after " + ", ".join(f"rank {r} called {how}" for r, how in sorted(self.left.items()))
            cause += " while the others ran"
        return (f"rank{'s' if len(killed) > 1 else ''} {', '.join(map(str, killed))} did not finish: mpiexec ended "
                f"{'them' if len(killed) > 1 else 'it'}{cause} (a rank that leaves without shutting aiacc down ends "
                "the job)")


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
