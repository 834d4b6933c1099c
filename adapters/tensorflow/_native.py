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

import logging
import threading
from pathlib import Path
from typing import Callable, Optional

import tensorflow as tf

from aiacc import native

logger = logging.getLogger(__name__)

__all__ = ["status_op"]

_SOURCE = Path(__file__).with_name("_status_op.cc")
_lock = threading.Lock()
_loaded = None  # the module of the loaded library, False once it could not be had


def _load():
    flags = [*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    name = native.library_name(f"aiacc_status_tf{tf.__version__}", _SOURCE, flags)
    return native.build_and_load(_SOURCE, name, flags, lambda path: tf.load_op_library(str(path)))


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
