"""What a ``DistributedOptimizer`` calls its parameters: the names that identify their gradients across ranks
(and appear in errors and the timeline), from ``named_parameters`` or, without it, Horovod's defaults."""

from __future__ import annotations

from typing import Dict

import torch

import aiacc
from aiacc.names import describe

__all__ = ["parameter_names"]


# DistributedOptimizers made without named_parameters, per process set (by its ranks; None: the job's): the same
# sequence on every rank of the set
_unnamed_wrappers: Dict[object, int] = {}


def parameter_names(param_groups, named_parameters, process_set=None):
    """({parameter: name}, parameters in model order) for the optimizer's parameters; an error naming
    what is wrong with ``named_parameters`` (not pairs, a name twice, parameters it misses)."""
    # a parameter listed twice (torch warns) is averaged once, as with named_parameters
    ordered = list(dict.fromkeys(p for group in param_groups for p in group["params"]))
    if named_parameters is None:
        # Horovod's names, for the first such optimizer of its process set; the k-th after it gets its own (two of
        # them in one step had the same gradient names: a DuplicateNameError at the second step that named no
        # cause). Counted per set, as names are scoped: a rank in two overlapping sets, an unnamed optimizer on
        # each, had its second one named noname1, its peer in that set noname (a TensorMismatchError at once)
        ranks = getattr(process_set, "ranks", None)
        key = None if ranks is None or process_set is aiacc.global_process_set else tuple(ranks)
        k = _unnamed_wrappers.get(key, 0)
        _unnamed_wrappers[key] = k + 1
        prefix = "allreduce.noname." if k == 0 else f"allreduce.noname{k}."
        where = {}
        for gi, group in enumerate(param_groups):
            for pi, p in enumerate(group["params"]):
                where.setdefault(p, f"{prefix}{gi}.{pi}")
        return where, ordered
    pairs = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in pairs):
        raise ValueError("named_parameters must be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters()")
    seen = set()
    for name, _ in pairs:
        if name in seen:
            raise ValueError(f"DistributedOptimizer: duplicate parameter name {name!r} in named_parameters; "
                             "names must be unique (they identify gradients across ranks)")
        seen.add(name)
    names: Dict[torch.Tensor, str] = {}
    for name, p in pairs:
        names.setdefault(p, str(name))
    missing = []
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            if p not in names:
                missing.append(f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})")
    if missing:
        raise ValueError("named_parameters does not cover parameters of the optimizer: "
                         f"{describe(missing, quote=False)} ({len(missing)} parameters); pass "
                         "model.named_parameters() of the model the optimizer trains")
    in_optimizer = set(ordered)
    return names, [p for p in names if p in in_optimizer]
