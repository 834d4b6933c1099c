"""One table of collective calls that every adapter must answer alike, and its numpy reference.

``same_results.py`` runs each case through aiacc.torch, aiacc.tensorflow and aiacc.mxnet at SIZE ranks (2; the
environment variable SAME_RESULTS_RANKS sets another number, for a run by hand) and
prints what came back in a framework-free form; ``test_same_results.py`` checks that the three agree with
each other and with :func:`expected` (computed here, with numpy only). Pure numpy: both import it.

A case's inputs are deterministic functions of (case, rank), so every rank knows every rank's input.
``kwargs`` are the keyword arguments of the call, the same in the three adapters (Horovod's names);
some are symbolic: ``compression="fp16"`` (the adapter's own ``Compression.fp16``),
``process_set="one"`` (the process set of rank 1 alone, registered by the worker) and
``process_set="unregistered"`` (a ``ProcessSet([0])`` never registered); ``name`` replaces the name the
worker gives. Error cases are
bad on every rank (or on none), so that no rank waits for another that has given up.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional, Tuple, Union

import numpy as np

from aiacc.compression import bfloat16_dtype

SIZE = int(os.environ.get("SAME_RESULTS_RANKS", "2"))
OTHERS = ("rank " if SIZE == 2 else "ranks ") + ",".join(str(k) for k in range(1, SIZE))  # as messages name them
POWER_OF_2 = SIZE & (SIZE - 1) == 0
NOT_ADASUM = ("NotImplementedError", f"Adasum runs on a power-of-2 number of ranks, not {SIZE}")
FRAMEWORKS = ("torch", "tensorflow", "mxnet")
ONE = (1,)  # the ranks of the process set "one"
IN_PLACE = ("torch", "mxnet")  # the adapters with in-place collectives on tensors


class Case(NamedTuple):
    id: str
    kind: str  # allreduce, grouped_allreduce, allgather, broadcast, alltoall, reducescatter
    dtype: Union[str, Callable[[int], str]]  # or per rank
    shape: Union[tuple, Callable[[int], tuple], list]  # one shape, per rank, or a list of them (grouped)
    kwargs: dict = {}
    error: Optional[Tuple[str, str]] = None  # (exception family, words of the message) on every rank
    frameworks: tuple = FRAMEWORKS
    tolerance: float = 0.0  # relative and absolute, for floating-point results


def _rows(r):
    return (2 + r, 3)  # allgather: ranks give different numbers of rows


T16 = 2e-3
CASES = [
    # ---- allreduce: every op, dtype, scale factor and the compression --------------------------------
    Case("ar.sum.f32", "allreduce", "float32", (2, 3), {"op": "Sum"}, tolerance=1e-6),
    Case("ar.default.f32", "allreduce", "float32", (4,), {}, tolerance=1e-6),
    Case("ar.avg.f64", "allreduce", "float64", (2, 2), {"op": "Average"}, tolerance=1e-12),
    Case("ar.sum.f16", "allreduce", "float16", (3,), {"op": "Sum"}, tolerance=T16),
    Case("ar.avg.f16", "allreduce", "float16", (3,), {"op": "Average"}, tolerance=T16),
    Case("ar.min.i32", "allreduce", "int32", (5,), {"op": "Min"}),
    Case("ar.max.i64", "allreduce", "int64", (2, 3), {"op": "Max"}),
    Case("ar.prod.i32", "allreduce", "int32", (4,), {"op": "Product"}),
    Case("ar.sum.u8", "allreduce", "uint8", (4,), {"op": "Sum"}),
    Case("ar.sum.i8", "allreduce", "int8", (4,), {"op": "Sum"}),
    Case("ar.avg.i32", "allreduce", "int32", (6,), {"op": "Average"}),  # rounds toward zero
    Case("ar.prod.f64", "allreduce", "float64", (3,), {"op": "Product"}, tolerance=1e-12),
    Case("ar.scale.sum.f32", "allreduce", "float32", (3,), {"op": "Sum", "prescale_factor": 0.5,
                                                            "postscale_factor": 3.0}, tolerance=1e-6),
    Case("ar.scale.avg.f64", "allreduce", "float64", (3,), {"op": "Average", "prescale_factor": 2.0,
                                                            "postscale_factor": 0.25}, tolerance=1e-12),
    Case("ar.average_true.f32", "allreduce", "float32", (3,), {"average": True}, tolerance=1e-6),
    Case("ar.average_false.f32", "allreduce", "float32", (3,), {"average": False}, tolerance=1e-6),
    Case("ar.fp16.avg.f32", "allreduce", "float32", (2, 3), {"compression": "fp16"}, tolerance=T16),
    Case("ar.fp16.sum.f64", "allreduce", "float64", (4,), {"op": "Sum", "compression": "fp16"}, tolerance=T16),
    Case("ar.fp16.sum.i32", "allreduce", "int32", (4,), {"op": "Sum", "compression": "fp16"}),  # ints travel as they are
    Case("ar.max.bool", "allreduce", "bool", (6,), {"op": "Max"}),
    Case("ar.min.bool", "allreduce", "bool", (6,), {"op": "Min"}),
    Case("ar.sum.bool", "allreduce", "bool", (6,), {"op": "Sum"}),
    Case("ar.scalar.f32", "allreduce", "float32", (), {"op": "Sum"}, tolerance=1e-6),
    Case("ar.set.f32", "allreduce", "float32", (3,), {"op": "Sum", "process_set": "one"}, tolerance=1e-6),
    # ---- allreduce refused -------------------------------------------------------------------------------
    Case("ar.avg.bool", "allreduce", "bool", (3,), {}, error=("TypeError", "op=Average is not defined for bool")),
    Case("ar.uint32", "allreduce", "uint32", (3,), {"op": "Sum"},
         error=("TypeError", "has dtype uint32, which aiacc does not support"),
         frameworks=("torch", "tensorflow")),  # MXNet has no dtype aiacc refuses
    Case("ar.max.complex64", "allreduce", "complex64", (3,), {"op": "Max"},
         error=("TypeError", "op=Max is not defined for complex tensors (complex64)"),
         frameworks=("torch", "tensorflow")),  # (MXNet has no complex numbers)
    Case("ar.shape_mismatch", "allreduce", "float32", lambda r: (2, 3) if r == 0 else (3, 2), {"op": "Sum"},
         error=("TensorMismatchError", f"shape differs across ranks (rank 0: (2, 3); {OTHERS}: (3, 2))")),
    Case("ar.dtype_mismatch", "allreduce", lambda r: "float32" if r == 0 else "float64", (3,), {"op": "Sum"},
         error=("TensorMismatchError", f"dtype differs across ranks (rank 0: float32; {OTHERS}: float64)")),
    Case("ar.op_mismatch", "allreduce", "float32", (3,), {"op": lambda r: "Sum" if r == 0 else "Max"},
         error=("TensorMismatchError", f"reduce op differs across ranks (rank 0: Sum; {OTHERS}: Max)")),
    Case("ar.adasum.f32", "allreduce", "float32", (2, 3), {"op": "Adasum", "prescale_factor": 0.5,
                                                            "postscale_factor": 3.0}, tolerance=1e-6,
         error=None if POWER_OF_2 else NOT_ADASUM),
    Case("ar.adasum.f64", "allreduce", "float64", (5,), {"op": "Adasum"}, tolerance=1e-12,
         error=None if POWER_OF_2 else NOT_ADASUM),
    Case("ar.adasum.f16", "allreduce", "float16", (4,), {"op": "Adasum"}, tolerance=T16,
         error=None if POWER_OF_2 else NOT_ADASUM),
    Case("gar.adasum", "grouped_allreduce", "float32", [(3,), (2, 2)], {"op": "Adasum"}, tolerance=1e-6,
         error=None if POWER_OF_2 else NOT_ADASUM),
    Case("ar.adasum.int", "allreduce", "int32", (3,), {"op": "Adasum"},
         error=("TypeError", "Adasum combines float16, float32 and float64 host arrays (as Horovod), not int32"
                + ("" if POWER_OF_2 else f" (GPU tensors: reduce a CPU copy); it also runs on a power-of-2 number "
                   f"of ranks only, not {SIZE}"))),  # (the tensor is checked first, and both are named)
    Case("ar.bad_op", "allreduce", "float32", (3,), {"op": "median"},
         error=("ValueError", "op='median' is not a reduce operation")),
    Case("ar.op_and_average", "allreduce", "float32", (3,), {"op": "Sum", "average": True},
         error=("ValueError", "pass either op= or the deprecated average=, not both")),
    Case("ar.bad_name", "allreduce", "float32", (3,), {"name": 5},
         error=("TypeError", "allreduce: name=5 must be a string, not int")),
    Case("ar.unregistered", "allreduce", "float32", (3,), {"process_set": "unregistered"},
         error=("ValueError", "is not a registered process set; add it with add_process_set")),
    Case("ar.sum.bf16", "allreduce", "bfloat16", (4,), {"op": "Sum"}, tolerance=2e-2,
         frameworks=("torch", "tensorflow")),  # MXNet 1.9 has no bfloat16
    Case("ar.scale.sum.i32", "allreduce", "int32", (4,), {"op": "Sum", "prescale_factor": 2.5}),
    Case("ar.min.f16", "allreduce", "float16", (4,), {"op": "Min"}, tolerance=T16),
    Case("ar.postscale.avg.i64", "allreduce", "int64", (5,), {"op": "Average", "postscale_factor": 3.0}),
    Case("ar.prescale_mismatch", "allreduce", "float32", (3,), {"op": "Sum", "prescale_factor": lambda r: 1.0 + r},
         error=("TensorMismatchError", "differs across ranks")),
    # ---- in place: torch and MXNet (TensorFlow tensors are immutable; its broadcast_ assigns variables) ----
    Case("ar_.sum.f32", "allreduce_", "float32", (2, 3), {"op": "Sum"}, tolerance=1e-6, frameworks=IN_PLACE),
    Case("ar_.fp16.avg.f64", "allreduce_", "float64", (4,), {"compression": "fp16"}, tolerance=T16,
         frameworks=IN_PLACE),
    Case("gar_.max.i32", "grouped_allreduce_", "int32", [(3,), (2, 2)], {"op": "Max"}, frameworks=IN_PLACE),
    Case("bc_.root1.f32", "broadcast_", "float32", (3,), {"root_rank": 1}, frameworks=IN_PLACE),
    Case("bc_.root5", "broadcast_", "float32", (3,), {"root_rank": 5}, frameworks=IN_PLACE,
         error=("InvalidArgumentError", f"root_rank=5 is out of range for a job of {SIZE} ranks (valid: 0..{SIZE - 1})")),
    # ---- grouped allreduce ---------------------------------------------------------------------------
    Case("gar.sum.f32", "grouped_allreduce", "float32", [(2, 3), (4,)], {"op": "Sum"}, tolerance=1e-6),
    Case("gar.fp16.avg.f64", "grouped_allreduce", "float64", [(3,), (2, 2)], {"compression": "fp16"},
         tolerance=T16),
    Case("gar.max.i64", "grouped_allreduce", "int64", [(3,), (1,)], {"op": "Max"}),
    # ---- allgather -------------------------------------------------------------------------------------
    Case("ag.f32", "allgather", "float32", _rows, {}),
    Case("ag.i64", "allgather", "int64", _rows, {}),
    Case("ag.bool", "allgather", "bool", _rows, {}),
    Case("ag.f16", "allgather", "float16", (1, 2), {}),
    Case("ag.set.i32", "allgather", "int32", _rows, {"process_set": "one"}),
    Case("ag.unregistered", "allgather", "float32", (2,), {"process_set": "unregistered"},
         error=("ValueError", "is not a registered process set; add it with add_process_set")),
    Case("gag.f32", "grouped_allgather", "float32", lambda r: [(2 + r, 3), (1 + r,)], {}),
    Case("gag.set.i64", "grouped_allgather", "int64", lambda r: [(2 + r,), (1,)], {"process_set": "one"}),
    Case("ag.scalar", "allgather", "float32", (), {},
         error=("InvalidArgumentError", "needs at least one dimension (got a scalar)")),
    Case("ag.compression", "allgather", "float32", (2,), {"compression": "fp16"},
         error=("TypeError", "got an unexpected keyword argument 'compression'")),  # no adapter compresses it
    # ---- broadcast -----------------------------------------------------------------------------------
    Case("bc.root0.f32", "broadcast", "float32", (2, 3), {"root_rank": 0}),
    Case("bc.root1.i32", "broadcast", "int32", (4,), {"root_rank": 1}),
    Case("bc.root1.bool", "broadcast", "bool", (5,), {"root_rank": 1}),
    Case("bc.root1.f16", "broadcast", "float16", (3,), {"root_rank": 1}),
    Case("bc.set.root1", "broadcast", "float64", (3,), {"root_rank": 1, "process_set": "one"}),
    Case("bc.set.root0", "broadcast", "float64", (3,), {"root_rank": 0, "process_set": "one"},
         error=("InvalidArgumentError", "root_rank=0 is not in process set")),
    Case("bc.unregistered", "broadcast", "float32", (3,), {"root_rank": 0, "process_set": "unregistered"},
         error=("ValueError", "is not a registered process set; add it with add_process_set")),
    Case("bc.root_mismatch", "broadcast", "float32", (3,), {"root_rank": lambda r: r},
         error=("TensorMismatchError", "root rank differs across ranks")),
    Case("bc.root5", "broadcast", "float32", (3,), {"root_rank": 5},
         error=("InvalidArgumentError", f"root_rank=5 is out of range for a job of {SIZE} ranks (valid: 0..{SIZE - 1})")),
    Case("bc.root_negative", "broadcast", "float32", (3,), {"root_rank": -1},
         error=("InvalidArgumentError", f"root_rank=-1 is out of range for a job of {SIZE} ranks (valid: 0..{SIZE - 1})")),
    Case("bc.compression", "broadcast", "float32", (3,), {"root_rank": 0, "compression": "fp16"},
         error=("TypeError", "got an unexpected keyword argument 'compression'")),
    # ---- alltoall --------------------------------------------------------------------------------------
    Case("a2a.equal.f32", "alltoall", "float32", (2 * SIZE, 2), {}),
    Case("a2a.splits.i32", "alltoall", "int32", (2 * SIZE, 2),
         {"splits": lambda r: ([1, 3] if r == 0 else [2, 2]) + [2] * (SIZE - 2)}),
    # a list of whole floats ([rows / size] * size) is counts, as Horovod casts a list (it was refused)
    Case("a2a.splits.whole_floats", "alltoall", "float32", (2 * SIZE, 2),
         {"splits": lambda r: ([1.0, 3.0] if r == 0 else [2.0, 2.0]) + [2.0] * (SIZE - 2)}),
    Case("a2a.splits.bool", "alltoall", "bool", (3,),
         {"splits": lambda r: ([3, 0] if r == 0 else [1, 2]) + [0] * (SIZE - 2)}),
    Case("a2a.bad_splits", "alltoall", "float32", (4,), {"splits": [1, 1]},
         error=("InvalidArgumentError", f"splits [1, 1] must be {SIZE} non-negative numbers summing to the first "
                                        "dimension 4")),
    Case("a2a.float_splits", "alltoall", "float32", (4,), {"splits": [1.5, 2.5]},
         error=("InvalidArgumentError", "splits must hold whole numbers, got float64 values [1.5, 2.5]")),
    Case("a2a.negative_splits", "alltoall", "float32", (2,), {"splits": [3, -1]},
         error=("InvalidArgumentError", f"splits [3, -1] must be {SIZE} non-negative numbers")),
    Case("a2a.indivisible", "alltoall", "float32", (SIZE + 1, 2), {},
         error=("InvalidArgumentError", f"first dimension {SIZE + 1} is not divisible by {SIZE} ranks; pass splits")),
    Case("a2a.unregistered", "alltoall", "float32", (2,), {"process_set": "unregistered"},
         error=("ValueError", "is not a registered process set; add it with add_process_set")),
    Case("a2a.set.f64", "alltoall", "float64", (3,), {"process_set": "one"}),
    Case("a2a.scalar", "alltoall", "float32", (), {},
         error=("InvalidArgumentError", "needs at least one dimension (got a scalar)")),
    # ---- reducescatter -------------------------------------------------------------------------------
    Case("rs.sum.f32", "reducescatter", "float32", (5, 2), {"op": "Sum"}, tolerance=1e-6),  # rows 3 and 2
    Case("rs.default.f64", "reducescatter", "float64", (4, 3), {}, tolerance=1e-12),
    Case("rs.max.i32", "reducescatter", "int32", (3,), {"op": "Max"}),
    Case("rs.avg.i64", "reducescatter", "int64", (4,), {"op": "Average"}),
    Case("rs.fp16.sum.f32", "reducescatter", "float32", (4, 2), {"op": "Sum", "compression": "fp16"},
         tolerance=T16),
    Case("rs.scale.f32", "reducescatter", "float32", (3, 2), {"op": "Sum", "prescale_factor": 2.0,
                                                              "postscale_factor": 0.5}, tolerance=1e-6),
    Case("rs.sum.bool", "reducescatter", "bool", (4,), {"op": "Sum"}),
    Case("rs.set.f32", "reducescatter", "float32", (3, 2), {"op": "Sum", "process_set": "one"}, tolerance=1e-6),
    Case("rs.set.avg.f64", "reducescatter", "float64", (3,), {"process_set": "one"}, tolerance=1e-12),
    Case("rs.unregistered", "reducescatter", "float32", (4,), {"process_set": "unregistered"},
         error=("ValueError", "is not a registered process set; add it with add_process_set")),
    Case("grs.sum.f32", "grouped_reducescatter", "float32", [(5, 2), (3,)], {"op": "Sum"}, tolerance=1e-6),
    Case("grs.fp16.avg.f64", "grouped_reducescatter", "float64", [(4,), (2, 2)], {"compression": "fp16"},
         tolerance=T16),
    Case("rs.scalar", "reducescatter", "float32", (), {"op": "Sum"},
         error=("InvalidArgumentError", "needs at least one dimension (got a scalar)")),
    Case("rs.avg.bool", "reducescatter", "bool", (4,), {},
         error=("TypeError", "op=Average is not defined for bool")),
    Case("rs.op_mismatch", "reducescatter", "float32", (4,), {"op": lambda r: "Min" if r == 0 else "Sum"},
         error=("TensorMismatchError", f"reduce op differs across ranks (rank 0: Min; {OTHERS}: Sum)")),
]

# the error every rank outside the process set "one" gets (all but rank 1), when the call itself is fine
def _outside(rank: int) -> tuple:
    return ("ValueError", f"rank {rank} is not in process set")


def per_rank(value, rank: int):
    """A case's value for ``rank`` (a function of the rank, or the same for every rank)."""
    return value(rank) if callable(value) else value


def shapes(case: Case, rank: int) -> list:
    """The shapes of the rank's input tensors (one, or one per tensor of a group)."""
    shape = per_rank(case.shape, rank)
    return list(shape) if case.kind.startswith("grouped") else [shape]


def _kind(case: Case) -> str:
    return case.kind.replace("grouped_", "").rstrip("_")


def inputs(case: Case, rank: int) -> list:
    """The rank's input arrays: small positive numbers (exact sums and products), or random bools."""
    dtype = per_rank(case.dtype, rank)
    rng = np.random.default_rng([CASES.index(case), rank])
    out = []
    for shape in shapes(case, rank):
        if dtype == "bool":
            out.append(rng.random(shape) < 0.5)
        elif dtype == "complex64":
            out.append((rng.random(shape) + 1j).astype(np.complex64))
        elif dtype == "bfloat16":
            out.append((rng.random(shape) + 0.5).astype(bfloat16_dtype()))
        elif np.dtype(dtype).kind in "iu":
            out.append(rng.integers(1, 5, size=shape).astype(dtype))
        else:
            out.append((rng.random(shape) + 0.5).astype(dtype))
    return [np.asarray(a) for a in out]  # 0-d arrays, not numpy scalars


def kwargs_of(case: Case, rank: int) -> dict:
    return {k: per_rank(v, rank) for k, v in case.kwargs.items()}


def _ranks(case: Case) -> tuple:
    return ONE if case.kwargs.get("process_set") == "one" else tuple(range(SIZE))


def _reduce(op: str, arrays: list, dtype: np.dtype, pre: float, post: float):
    """Horovod's reduction: prescaled inputs (integers through float64, truncated), the op, then the
    average and the postscale (integers: one factor postscale / n, rounded toward zero once), in float64
    for floating-point results."""
    floating = dtype.kind == "f" or dtype == bfloat16_dtype()
    if pre != 1.0:
        arrays = [a.astype(np.float64) * pre if floating else (a.astype(np.float64) * pre).astype(dtype)
                  for a in arrays]
    if dtype == np.bool_:
        stack = np.stack(arrays)
        return stack.all(0) if op in ("Min", "Product") else stack.any(0)
    if op == "Adasum":  # the paper's formula, a' = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, pairwise in a tree
        level = [x.astype(np.float64).ravel() for x in arrays]
        while len(level) > 1:
            level = [(1 - a @ b / (2 * (a @ a))) * a + (1 - a @ b / (2 * (b @ b))) * b
                     for a, b in zip(level[0::2], level[1::2])]
        return (level[0].reshape(arrays[0].shape) * post).astype(dtype)
    stack = np.stack([a.astype(np.float64) if floating else a.astype(np.int64) for a in arrays])
    total = {"Sum": stack.sum(0), "Average": stack.sum(0), "Min": stack.min(0), "Max": stack.max(0),
             "Product": stack.prod(0)}[op]
    n = len(arrays)
    if op == "Average" and not floating:  # (mpi_operations.cc: postscale /= size, one scaling, truncated once)
        return np.trunc(total * (post / n)).astype(dtype) if post != 1.0 else np.trunc(total / n).astype(dtype)
    if op == "Average":
        total = total / n
    return (total * post).astype(dtype)


def _numpy_dtype(name: str) -> np.dtype:
    return bfloat16_dtype() if name == "bfloat16" else np.dtype(name)


def _op(case: Case, rank: int) -> str:
    kwargs = kwargs_of(case, rank)
    if "average" in kwargs:
        return "Average" if kwargs["average"] else "Sum"
    return kwargs.get("op", "Average")


def expected(case: Case, rank: int):
    """``("error", family, words)`` or ``("ok", [arrays], received splits or None)`` of ``rank``."""
    if case.error is not None:
        return ("error",) + case.error
    ranks = _ranks(case)
    if rank not in ranks:
        return ("error",) + _outside(rank)
    everyone = {k: inputs(case, k) for k in ranks}
    kwargs = kwargs_of(case, rank)
    dtype = np.dtype(_numpy_dtype(per_rank(case.dtype, rank)))
    pre, post = kwargs.get("prescale_factor", 1.0), kwargs.get("postscale_factor", 1.0)
    kind, count = _kind(case), len(everyone[rank])
    if kind == "allreduce":
        results = [_reduce(_op(case, rank), [everyone[k][i] for k in ranks], dtype, pre, post) for i in range(count)]
        return ("ok", results, None)
    if kind == "allgather":
        return ("ok", [np.concatenate([everyone[k][i] for k in ranks]) for i in range(count)], None)
    if kind == "broadcast":
        return ("ok", [everyone[kwargs["root_rank"]][0]], None)
    if kind == "alltoall":
        def splits_of(k):
            given = kwargs_of(case, k).get("splits")
            rows = everyone[k][0].shape[0]
            return given if given is not None else [rows // len(ranks)] * len(ranks)
        pieces, received = [], []
        for k in ranks:
            start = int(sum(splits_of(k)[:ranks.index(rank)]))
            count = int(splits_of(k)[ranks.index(rank)])
            pieces.append(everyone[k][0][start:start + count])
            received.append(count)
        return ("ok", [np.concatenate(pieces)], received if "splits" in kwargs else None)
    if kind == "reducescatter":
        results = []
        for i in range(count):
            total = _reduce(_op(case, rank), [everyone[k][i] for k in ranks], dtype, pre, post)
            rows = total.shape[0]
            counts = [rows // len(ranks) + (1 if j < rows % len(ranks) else 0) for j in range(len(ranks))]
            start = sum(counts[:ranks.index(rank)])
            results.append(total[start:start + counts[ranks.index(rank)]])
        return ("ok", results, None)
    raise AssertionError(case.kind)


def checks() -> int:
    """How many results a rank reports: one per case and framework."""
    return sum(len(case.frameworks) for case in CASES)
