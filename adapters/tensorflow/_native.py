"""The one native op of aiacc.tensorflow (``_status_op.cc``), built on first use, and what to do without it.

``AiaccStatus(code, message)`` fails with TensorFlow error ``code`` (or passes when it is 0): the only way a
collective inside a graph can fail with the error class Horovod's ops use (see ``_errors``). It is compiled
the first time a graph needs it, with the C++ compiler (``c++``/``g++``) and the headers that come with
the TensorFlow wheel (``tf.sysconfig``; about 6 s), into a cache directory (``~/.cache/aiacc``, else the
temporary directory) under a name that holds the TensorFlow version and a hash of the source, so every
later process loads it at once. Ranks that start together build it once (a file lock). If it cannot be
built or loaded (no compiler, a read-only home and /tmp, another TensorFlow ABI), :func:`status_op` returns
None, aiacc logs one warning, and graph-mode collectives raise in Python instead: the same message,
as ``InvalidArgumentError`` or ``UnknownError``.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

import tensorflow as tf

logger = logging.getLogger(__name__)

__all__ = ["status_op"]

_SOURCE = Path(__file__).with_name("_status_op.cc")
_lock = threading.Lock()
_loaded = None  # the module of the loaded library, False once it could not be had


def _cache_dirs():
    yield Path.home() / ".cache" / "aiacc"
    yield Path(tempfile.gettempdir()) / f"aiacc-{os.getuid()}"


def _compiler() -> Optional[str]:
    for name in (sysconfig.get_config_var("CXX") or "").split()[:1] + ["c++", "g++", "clang++"]:
        path = shutil.which(name)
        if path:
            return path
    return None


def _library_name() -> str:
    flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    digest = hashlib.sha256(_SOURCE.read_bytes() + "\0".join(flags).encode()).hexdigest()[:16]
    return f"aiacc_status_tf{tf.__version__}_{digest}.so"


def _build(target: Path) -> None:
    """Compile the op into ``target`` (atomically: other processes never see half a file)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, "-shared", "-fPIC", "-O2", "-w", str(_SOURCE), "-o", str(partial),
           *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _load():
    name, problems = _library_name(), []
    for directory in _cache_dirs():
        target = directory / name
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then load its library
                if not target.exists():
                    _build(target)
            return tf.load_op_library(str(target))
        except Exception as exc:  # noqa: BLE001 - try the next directory, then fall back
            problems.append(f"{directory}: {exc}")
    raise RuntimeError("; ".join(problems))


def status_op() -> Optional[Callable]:
    """``fn(code, message) -> tf.Operation`` failing with TensorFlow error ``code`` unless it is 0, or None
    when the op cannot be built here."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = _load()
            except Exception as exc:  # noqa: BLE001 - optional: fall back to errors raised in Python
                logger.warning("aiacc.tensorflow: the op that gives graph-mode collectives Horovod's error classes "
                               "could not be built (%s); errors inside graphs are raised as InvalidArgumentError "
                               "or UnknownError instead", exc)
                _loaded = False
    return _loaded.aiacc_status if _loaded else None
