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

__all__ = ["host_call"]

_SOURCE = Path(__file__).with_name("_jax_call.cc")
_TARGET = "aiacc_host_call"
_lock = threading.Lock()
_loaded = None  # the library once registered with XLA, False where it could not be had
_calls: dict = {}  # id -> (function, the arguments' (shape, dtype), the results' structs, one result not a list)
_ids = itertools.count(1)


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


def host_call(fn: Callable, results, *args):
    """``fn(*args)`` run on the host where the compiled function reaches this call (numpy arrays in, arrays like
    ``results`` out: a ``jax.ShapeDtypeStruct`` or a list of them), as ``jax.experimental.io_callback``."""
    import jax  # noqa: PLC0415

    if not _native():
        from jax.experimental import io_callback  # noqa: PLC0415

        return io_callback(fn, results, *args)
    single = isinstance(results, jax.ShapeDtypeStruct)
    structs = [results] if single else list(results)
    call_id = next(_ids)
    _calls[call_id] = (fn, [(tuple(a.shape), np.dtype(a.dtype)) for a in args], structs, single)
    out = jax.ffi.ffi_call(_TARGET, structs)(*args, id=np.int64(call_id))
    return out[0] if single else list(out)
