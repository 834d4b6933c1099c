"""Errors that name a Keras variable: the engine names a gradient of a ``DistributedOptimizer`` by a label that is the
same on every rank (its place in the optimizer's list); these add the variable's Keras path, which only this rank
knows. Shared by the PyTorch backend (``_torch_buckets``) and the JAX backend (``_optimizer``), without importing
either framework."""

from __future__ import annotations

import aiacc
from aiacc.buckets import check_same_gradients
from aiacc.exceptions import TensorMismatchError
from aiacc.names import describe

from ..gradients import AUTO_NAME

__all__ = ["label", "with_paths", "explain_group_mismatch"]


def label(prefix: str, i: int, variable) -> str:
    """How the engine names the gradient of the optimizer's ``i``-th variable: the same on every rank (the
    TensorFlow backend's ``<prefix>.<i>.<name>``), so not a name Keras numbered per process (``variable_4``), nor the
    variable's path, whose layer names Keras numbers per process too (``dense_1``: another model built first)."""
    return f"{prefix}.{i}" + ("" if AUTO_NAME.fullmatch(variable.name) else f".{variable.name}")


def with_paths(error: TensorMismatchError, labels: list, variables: list) -> TensorMismatchError:
    """``error`` (which names gradients by their labels) with the Keras path, on this rank, of each variable it
    names: the labels say where a variable is in the optimizer's list, the path which layer's it is."""
    text = str(error)
    named = [f"{lab!r} is {v.path!r}" for lab, v in zip(labels, variables)
             if repr(lab) in text and getattr(v, "path", None)]
    if not named:
        return error
    return TensorMismatchError(f"{text} (on rank {aiacc.rank()}: {describe(named, quote=False)})")


def explain_group_mismatch(reducer, present: list, entries: list, sources: list, error: TensorMismatchError) -> None:
    """A grouped allreduce of a step's gradients (those not None: the ``present`` indices into the optimizer's
    variables ``sources``, with ``entries`` their ``(dtype, shape)``) failed on every rank with ``error``, which names
    a gradient by its place in the group only (``entry 0 of the group``): every rank now compares its gradients
    (label, dtype, shape) in one collective, and the error raised names the variables, by label and by this rank's
    Keras path. (Kept out of the steps that succeed: no cost there.)"""
    labels = [label(reducer.prefix, i, sources[i]) for i in present]
    try:
        check_same_gradients(aiacc.engine_for(reducer.process_set),
                             [(lab, dtype, shape) for lab, (dtype, shape) in zip(labels, entries)],
                             f"{reducer.prefix}.gradients.check", reducer.op, reducer.compression)
    except TensorMismatchError as e:
        raise with_paths(e, labels, [sources[i] for i in present]) from error
