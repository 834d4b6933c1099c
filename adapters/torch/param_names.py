"""What a ``DistributedOptimizer`` calls its parameters: the names that identify their gradients across ranks
(and appear in errors and the timeline), from ``named_parameters`` or, without it, Horovod's defaults."""

from __future__ import annotations

from typing import Dict

import torch

from aiacc.names import describe

__all__ = ["parameter_names"]


_unnamed_wrappers = [0]  # DistributedOptimizers made without named_parameters (the same sequence on every rank)


def parameter_names(param_groups, named_parameters):
    """({parameter: name}, parameters in model order) for the optimizer's parameters; an error naming
    what is wrong with ``named_parameters`` (not pairs, a name twice, parameters it misses)."""
    # a parameter listed twice (torch warns) is averaged once, as with named_parameters
    ordered = list(dict.fromkeys(p for group in param_groups for p in group["params"]))
    if named_parameters is None:
        # Horovod's names, for the first such optimizer; the k-th after it gets its own (two of them in one
        # step had the same gradient names: a DuplicateNameError at the second step that named no cause)
        k = _unnamed_wrappers[0]
        _unnamed_wrappers[0] += 1
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
