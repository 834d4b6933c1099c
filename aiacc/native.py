"""Small native libraries that adapters compile on first use (TensorFlow's status op, Keras-on-JAX's host call).

:func:`build_and_load` compiles one C++ source with the C++ compiler on PATH into a cache directory
(``~/.cache/aiacc``, else ``<tmp>/aiacc-<uid>``) under a name that holds what the binary depends on (the
caller's versions and a hash of the source and flags), so every later process loads it at once; ranks that
start together build it once (a file lock), and other processes never see half a file. Callers fall back to
pure Python when it raises (no compiler, no writable directory, another ABI) and say so once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, TypeVar

__all__ = ["build_and_load", "library_name"]

T = TypeVar("T")


def _cache_dirs() -> Iterator[Path]:
    yield Path.home() / ".cache" / "aiacc"
    yield Path(tempfile.gettempdir()) / f"aiacc-{os.getuid()}"


def _compiler() -> Optional[str]:
    for name in (sysconfig.get_config_var("CXX") or "").split()[:1] + ["c++", "g++", "clang++"]:
        path = shutil.which(name)
        if path:
            return path
    return None


def library_name(stem: str, source: Path, flags: Sequence[str]) -> str:
    """``<stem>_<hash of the source and flags>.so``."""
    digest = hashlib.sha256(source.read_bytes() + "\0".join(flags).encode()).hexdigest()[:16]
    return f"{stem}_{digest}.so"


def _build(source: Path, target: Path, flags: Sequence[str]) -> None:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, "-shared", "-fPIC", "-O2", "-w", str(source), "-o", str(partial), *flags]
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def build_and_load(source: Path, name: str, flags: Sequence[str], load: Callable[[Path], T]) -> T:
    """``load(path)`` of ``source`` compiled with ``flags`` into ``name`` in the first cache directory where that
    works (built there first if it is not); raises ``RuntimeError`` naming each directory's problem."""
    problems = []
    for directory in _cache_dirs():
        target = directory / name
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then load its library
                if not target.exists():
                    _build(source, target, flags)
            return load(target)
        except Exception as exc:  # noqa: BLE001 - try the next directory, then the caller falls back
            problems.append(f"{directory}: {exc}")
    raise RuntimeError("; ".join(problems))
