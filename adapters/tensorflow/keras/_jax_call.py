"""How Keras' compiled JAX train step calls aiacc's Python (the gradient reduction, the finite check of a loss-scale
optimizer, the same-start comparison): :func:`host_call`, ``jax.experimental.io_callback``'s signature.

``io_callback`` would do, but JAX dispatches a compiled function that holds a host callback through its Python path
(``pxla.ExecuteReplicated``: tokens, every argument's sharding and layout resolved in Python), ~28 µs per argument
and result array on every call, and a Keras step passes every variable in and out: 6.4 ms a step for 211 variables
on this machine, where the same function without the callback dispatches in C++ in 0.5 ms. So on the CPU the call
is an XLA FFI custom call instead (``_jax_call.cc``, compiled on first use like TensorFlow's status op,
``aiacc.native``): its handler takes the GIL and calls :func:`_dispatch` with the buffers' addresses, which runs the
Python function on read-only numpy views of the arguments and copies its results into XLA's result buffers. It is
declared without side effects (a custom call with them is a JAX effect, which takes the Python path again), so XLA
may drop a call whose results are unused: every caller here uses them (the same-start check gates a gradient on its
result). Elsewhere (a GPU backend, or the library could not be built: one warning) ``io_callback``."""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from aiacc import native

logger = logging.getLogger(__name__)

__all__ = ["host_call", "raise_failed_call"]

_SOURCE = Path(__file__).with_name("_jax_call.cc")
_TARGET = "aiacc_host_call"
_lock = threading.Lock()
_loaded = None  # the library once registered with XLA, False where it could not be had
_calls: dict = {}  # id -> (function, the arguments' (shape, dtype), the results' structs, one result not a list)
_ids = itertools.count(1)
_failed: "collections.deque" = collections.deque(maxlen=8)  # the latest exceptions host calls' functions raised


def _view(address: int, nbytes: int, shape, dtype, writable: bool) -> np.ndarray:
    if nbytes == 0:
        return np.empty(shape, dtype)
    out = np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype).reshape(shape)
    out.flags.writeable = writable
    return out


def _dispatch(call_id: int, inputs: list, outputs: list) -> None:
    """(From the handler, holding the GIL.) Run call ``call_id``'s function on its arguments, and write its
    results into ``outputs`` ((address, bytes) of XLA's result buffers)."""
    fn, specs, results, single = _calls[call_id]
    got = fn(*[_view(a, n, shape, dtype, False) for (a, n), (shape, dtype) in zip(inputs, specs)])
    got = [got] if single else list(got)
    if len(got) != len(results):
        raise ValueError(f"aiacc: a host call returned {len(got)} results for {len(results)}")
    for (address, nbytes), struct, value in zip(outputs, results, got):
        value = np.asarray(value)
        if value.shape != tuple(struct.shape) or value.dtype != np.dtype(struct.dtype):
            raise ValueError(f"aiacc: a host call returned {value.dtype}{list(value.shape)} for "
                             f"{np.dtype(struct.dtype)}{list(struct.shape)}")
        np.copyto(_view(address, nbytes, struct.shape, struct.dtype, True), value)


def _load():
    import jax  # noqa: PLC0415 - Keras on JAX only
    import jax.ffi  # noqa: PLC0415

    flags = ["-std=c++17", f"-I{jax.ffi.include_dir()}", f"-I{sysconfig.get_paths()['include']}"]
    stem = f"aiacc_jax_call_jax{jax.__version__}_py{sys.version_info[0]}{sys.version_info[1]}"

    def load(path: Path):
        library = ctypes.PyDLL(str(path))  # (calls keep the GIL: the handler takes it itself)
        library.aiacc_set_dispatch.argtypes = [ctypes.py_object]
        library.aiacc_set_dispatch(_dispatch)
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.AiaccHostCall), platform="cpu")
        return library

    return native.build_and_load(_SOURCE, native.library_name(stem, _SOURCE, flags), flags, load)


def _native() -> bool:
    global _loaded
    import jax  # noqa: PLC0415

    if jax.default_backend() != "cpu":
        return False
    with _lock:
        if _loaded is None:
            try:
                _loaded = _load()
            except Exception as exc:  # noqa: BLE001 - optional: io_callback does the same, slower
                logger.warning("aiacc.keras: the XLA call into aiacc could not be built (%s); Keras' JAX steps call "
                               "aiacc through jax.experimental.io_callback instead (~28 us more per variable and "
                               "step)", exc)
                _loaded = False
    return bool(_loaded)


def _recorded(fn: Callable) -> Callable:
    def call(*args):
        try:
            return fn(*args)
        except BaseException as exc:
            _failed.append(exc)
            raise

    return call


def _raised_in(error: BaseException):
    """The exception a host call's function raised whose message ``error`` (XLA's) carries, or None."""
    text = str(error)
    return next((f for f in reversed(_failed) if f is not error and str(f) and str(f) in text), None)


def raise_failed_call(variables) -> None:
    """(Where fit ends.) A host call's function that raised (gradients that differ across ranks) failed its step:
    XLA's error is then in the step's results, and JAX raises it only where they are read (or where a later step is
    dispatched on them), so fit could return as if it had trained. Raises the function's exception (a
    TensorMismatchError naming the variables, as the other backends raise from fit), chained to XLA's: in place of
    XLA's error when fit is raising that, else when waiting for ``variables``' values fails."""
    import jax  # noqa: PLC0415

    raising = sys.exc_info()[1]  # (called in fit's finally: what a step raised, if one did)
    failed = _raised_in(raising) if raising is not None else None
    if failed is not None:
        raise failed.with_traceback(None) from raising
    try:
        values = [v.value for v in variables]
    except Exception:  # noqa: BLE001 - no values: a step raised before Keras had its state back (fit raises it)
        return
    try:
        jax.block_until_ready(values)
    except Exception as exc:
        failed = _raised_in(exc)
        if failed is None:
            raise
        raise failed.with_traceback(None) from exc


def host_call(fn: Callable, results, *args):
    """``fn(*args)`` run on the host where the compiled function reaches this call (numpy arrays in, arrays like
    ``results`` out: a ``jax.ShapeDtypeStruct`` or a list of them), as ``jax.experimental.io_callback``. An exception
    ``fn`` raises is XLA's error in the results (JAX raises it where they are read) and is kept for
    :func:`raise_failed_call`."""
    import jax  # noqa: PLC0415

    fn = _recorded(fn)
    if not _native():
        from jax.experimental import io_callback  # noqa: PLC0415

        return io_callback(fn, results, *args)
    single = isinstance(results, jax.ShapeDtypeStruct)
    structs = [results] if single else list(results)
    call_id = next(_ids)
    _calls[call_id] = (fn, [(tuple(a.shape), np.dtype(a.dtype)) for a in args], structs, single)
    out = jax.ffi.ffi_call(_TARGET, structs)(*args, id=np.int64(call_id))
    return out[0] if single else list(out)
