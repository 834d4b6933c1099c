"""Every case of ``same_results_table`` through aiacc.torch, aiacc.tensorflow and aiacc.mxnet, in one process
per rank: one line per case and framework with what came back, framework-free (JSON: the arrays' dtype,
shape and values, alltoall's received splits, or the exception's family and message).

The three adapters share one engine (one ``init``), so a case runs three times, under three names
(``<case>~<framework>``; the suffix is taken out of messages, which must then be the same).
"""

import json
import sys

import numpy as np

import aiacc.mxnet as hvd_mx  # first: it restores numpy.bool, which MXNet 1.9.1 needs
import aiacc.tensorflow as hvd_tf
import aiacc.torch as hvd_torch
import mxnet as mx
import tensorflow as tf
import torch

import aiacc
from aiacc.compression import bfloat16_dtype
from aiacc.exceptions import (AiaccError, DuplicateNameError, InvalidArgumentError, NotInitializedError,
                              TensorMismatchError)
from report import say
from same_results_table import CASES, ONE, SIZE, kwargs_of, inputs

BF16 = bfloat16_dtype()
FAMILIES = (TensorMismatchError, InvalidArgumentError, DuplicateNameError, NotInitializedError, NotImplementedError,
            TypeError, ValueError, AiaccError)

aiacc.init()
r = aiacc.rank()
assert aiacc.size() == SIZE, f"the table is written for {SIZE} ranks (SAME_RESULTS_RANKS)"
one = aiacc.add_process_set(list(ONE))


class Adapter:
    """How one framework makes tensors from numpy arrays and reads its results back."""

    def __init__(self, name, module, tensor, array):
        self.name, self.module, self.tensor, self.array = name, module, tensor, array


def _torch_tensor(a: np.ndarray):
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _torch_array(t):
    return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()


ADAPTERS = {
    "torch": Adapter("torch", hvd_torch, _torch_tensor, _torch_array),
    "tensorflow": Adapter("tensorflow", hvd_tf, tf.constant, lambda t: t.numpy()),
    "mxnet": Adapter("mxnet", hvd_mx, lambda a: mx.nd.array(a, dtype=a.dtype), lambda t: t.asnumpy()),
}


def call(adapter: Adapter, case, name: str):
    hvd = adapter.module
    kwargs = kwargs_of(case, r)
    if kwargs.get("compression") == "fp16":
        kwargs["compression"] = hvd.Compression.fp16
    if kwargs.get("process_set") == "one":
        kwargs["process_set"] = one
    elif kwargs.get("process_set") == "unregistered":
        kwargs["process_set"] = aiacc.ProcessSet([0])
    name = kwargs.pop("name", name)
    if "op" in kwargs and kwargs["op"] in ("Sum", "Average", "Min", "Max", "Product", "Adasum"):
        kwargs["op"] = getattr(hvd, kwargs["op"])  # the adapter's own constant
    tensors = [adapter.tensor(a) for a in inputs(case, r)]
    in_place = case.kind.endswith("_")  # the result is read from the input tensors themselves
    if case.kind.startswith("grouped"):
        out = getattr(hvd, case.kind)(tensors, name=name, **kwargs)
        return [adapter.array(t) for t in (tensors if in_place else out)], None
    root = kwargs.pop("root_rank", None)
    out = getattr(hvd, case.kind)(tensors[0], *(() if root is None else (root,)), name=name, **kwargs)
    if in_place:
        out = tensors[0]
    if case.kind == "alltoall" and "splits" in kwargs:
        rows, received = out
        return [adapter.array(rows)], [int(x) for x in adapter.array(received).reshape(-1)]
    return [adapter.array(out)], None


def message(exc: BaseException, name: str) -> str:
    text = exc.message if isinstance(exc, tf.errors.OpError) else str(exc)
    return text.replace(name, name.split("~")[0])


checks = 0
for case in CASES:
    for framework in case.frameworks:
        name = f"{case.id}~{framework}"
        try:
            arrays, received = call(ADAPTERS[framework], case, name)
            report = {"arrays": [{"dtype": a.dtype.name, "shape": list(a.shape),
                                  "values": (a.astype(np.float32) if a.dtype == BF16 else a).tolist()}
                                 for a in (np.asarray(x) for x in arrays)], "received": received}
        except Exception as exc:  # noqa: BLE001 - what was raised is the result
            family = next((f.__name__ for f in FAMILIES if isinstance(exc, f)), type(exc).__name__)
            report = {"error": family, "message": message(exc, name)}
        say("RESULT " + json.dumps({"rank": r, "case": case.id, "framework": framework, **report}))
        checks += 1

aiacc.shutdown()
say(f"OK rank={r} checks={checks}")
sys.exit(0)
