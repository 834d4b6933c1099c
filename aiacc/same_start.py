"""Do the ranks train the same model? One comparison of the parameters' values across the ranks, once.

The most common mistake in a data-parallel script is a forgotten broadcast of rank 0's parameters
(``broadcast_parameters`` in torch and MXNet, ``BroadcastGlobalVariablesCallback`` in Keras, the TF custom
loop's ``broadcast_variables`` after the first step): each rank then keeps its own random initialisation,
the gradients are averaged, and the weights never agree -- a different model on every rank, without a
word. (DDP broadcasts at construction; Horovod says nothing.)

Each optimizer wrapper calls :func:`check_same_start` once, at its second optimizer step, before that
step's update: Horovod's torch and MXNet recipes broadcast before the first step, its TF and Keras ones
right after it, so all of them have broadcast by then. Every rank takes one digest per parameter (a CRC-32
of its bytes: exact, not a float sum that rounding could tell apart) and one allreduce of the digests and
their negatives with ``Min`` tells each rank which parameters differ; only then a second collective (an
allgather of the differing digests) tells which ranks. After that the check costs nothing: no collective
in any later step. ``AIACC_CHECK_SAME_START=0`` switches it off (a setting every rank must share).
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import warnings
import zlib
from typing import Iterable, List, Optional, Tuple

import numpy as np

from . import api
from .names import describe
from .objects import members_of
from .ops import Min

__all__ = ["check_same_start", "digest", "user_site", "SWITCH"]

SWITCH = "AIACC_CHECK_SAME_START=0"


def digest(array) -> int:
    """A CRC-32 of ``array``'s bytes (any numpy array, in C order): the same on every rank for the same values
    (exact in a float64)."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return zlib.crc32(flat)


# where frames are not the script's: aiacc, its adapters, the standard library, installed packages (the frameworks)
_NOT_THE_SCRIPT = tuple(os.path.join(os.path.realpath(d), "") for d in {
    os.path.dirname(os.path.abspath(__file__)),
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "adapters"),
    *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))})


def user_site() -> Optional[Tuple[str, int, dict]]:
    """The script's line running now: (file, line, its globals) of the innermost frame outside aiacc, the standard
    library, installed packages and TensorFlow's generated code (AutoGraph's copies of the script's functions), or
    None. A check built while a step is traced or a graph is built runs later on a thread of the framework, where no
    ``stacklevel`` reaches the script: its warning names the line taken here (``model.fit(...)``, the traced step's
    call, ``opt.minimize(...)``), as an eager check's names the script's step. A script that is itself an installed
    package's module (``python -m pkg.train``) has no frame outside those: then the innermost frame of ``__main__``
    (the script run)."""
    frame, main = sys._getframe(1), None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _not_the_script(filename):
            return filename, frame.f_lineno, frame.f_globals
        if main is None and frame.f_globals.get("__name__") == "__main__" and not _generated(filename):
            main = frame
        frame = frame.f_back
    return (main.f_code.co_filename, main.f_lineno, main.f_globals) if main is not None else None


def _generated(filename: str) -> bool:
    return filename.startswith("<") or "__autograph_generated_file" in filename


@functools.lru_cache(maxsize=1024)
def _not_the_script(filename: str) -> bool:
    return _generated(filename) or os.path.realpath(filename).startswith(_NOT_THE_SCRIPT)


def check_same_start(named: Iterable[Tuple[str, object]], what: str, fix: str, process_set=None,
                     stacklevel: int = 3, name: Optional[str] = None,
                     where: Optional[Tuple[str, int, dict]] = None) -> List[str]:
    """Compare the parameters ``named`` ((name, numpy array of its values) pairs, in the same order on every
    rank of ``process_set``) across those ranks; when some differ, a ``UserWarning`` on every rank naming the
    first few, the ranks whose values are not the first rank's, and ``fix`` (what to call). A collective: every
    rank of the set calls it at the same point. ``name``: of its collectives (default ``what``), apart for checks
    that may run at the same time (two optimizers in one traced TensorFlow step). ``where``: the line the warning
    names (``user_site()``'s, taken when a traced check was built), else ``stacklevel``'s. Returns the names of the
    parameters that differ."""
    tag = f"aiacc.same_start.{name or what}"
    names, digests = [], []
    for label, values in named:
        names.append(str(label))
        digests.append(digest(values))
    mine = np.array(digests, np.float64)
    low = api.allreduce(np.concatenate([mine, -mine]), op=Min, name=tag, process_set=process_set)
    differ = np.flatnonzero(low[:len(names)] != -low[len(names):])
    if differ.size == 0:
        return []
    # (every rank learnt that some differ: all of them run this second collective)
    rows = api.allgather(mine[differ].reshape(1, -1), name=f"{tag}.ranks", process_set=process_set)
    members = members_of(process_set, len(rows))
    first = members[0]
    others = [r for r, row in zip(members, rows) if not np.array_equal(row, rows[0])]
    bad = [names[i] for i in differ]
    message = (
        f"{what}: the ranks do not train the same model: the values of parameter{'s' if len(bad) > 1 else ''} "
        f"{describe(bad)} ({len(bad)} of {len(names)}) on rank{'s' if len(others) > 1 else ''} "
        f"{', '.join(map(str, others))} are not those of rank {first} (compared once, at the second optimizer "
        "step). The gradients are averaged, but each rank keeps its own initial weights: the weights never agree. "
        f"{fix} {SWITCH} switches this check off.")
    if where is None:
        warnings.warn(message, UserWarning, stacklevel=stacklevel)
    else:
        # (as warnings.warn would for that line: the module's name and registry; not its globals, from which
        # warn_explicit would ask the module's loader for the source by ``__name__``: ImportError for a script run
        # as ``python -m pkg.train``, whose loader is pkg.train's; the line is read from the file when shown)
        file, line, module = where
        warnings.warn_explicit(message, UserWarning, file, line, module.get("__name__"),
                               module.setdefault("__warningregistry__", {}))
    return bad
