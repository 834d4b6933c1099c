"""How the tensors an adapter submits on a user's behalf are named: the same on every rank and in every
framework, so that the ranks match them (and the response cache knows them) whatever framework runs."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

__all__ = ["derived_name", "gradient_name", "describe", "only_on_some_ranks", "BUCKET_SETUP_PREFIX"]

# the first step of a set of gradient buckets agrees on its gradients in collectives named so (then the set's
# key); the stall inspector knows ranks that wait in two different ones have different lists of gradients
BUCKET_SETUP_PREFIX = "aiacc.buckets."


def derived_name(name: Optional[str], suffix: str) -> Optional[str]:
    """The name of a collective that belongs to the collective ``name``: its gradient (``"grad"``), its row
    counts, ... (``"<name>.<suffix>"``); None for an unnamed one (matched by call order, as it is)."""
    return None if name is None else f"{name}.{suffix}"


def gradient_name(parameter: str, prefix: str = "") -> str:
    """The name of a parameter's gradient reduced by a ``DistributedOptimizer`` / ``DistributedTrainer``:
    ``"<prefix>grad.<parameter>"``."""
    return f"{prefix}grad.{parameter}"


def describe(names: Sequence[str], limit: int = 5, quote: bool = True) -> str:
    """The first ``limit`` of ``names`` for an error message (``repr``'d unless ``quote`` is False), then how
    many more there are: ``'a', 'b' (and 3 more)``."""
    shown = ", ".join(repr(n) if quote else n for n in names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def only_on_some_ranks(per_rank: Sequence[Sequence[str]], ranks: Sequence[int], show=describe) -> str:
    """For ranks whose lists of names differ: ``only rank 1 has 'x'; only ranks 0,2 have ...``: the names that
    not every rank has, grouped by the ranks that have them (``show`` formats each group), joined by '; ';
    empty when every rank has them all. (Each rank's own list used to be named as its alone: at 3 ranks,
    a name all but one rank had read 'only rank 0 has 'x'; only rank 2 has 'x''.)"""
    everywhere = set.intersection(*map(set, per_rank))
    holders: Dict[str, List[int]] = {}
    for r, names in zip(ranks, per_rank):
        for x in dict.fromkeys(names):
            if x not in everywhere:
                holders.setdefault(x, []).append(r)
    groups: Dict[tuple, List[str]] = {}
    for x, rs in sorted(holders.items(), key=lambda item: item[1][0]):  # stable: each group's names in list order
        groups.setdefault(tuple(rs), []).append(x)
    return "; ".join(f"only {'rank' if len(rs) == 1 else 'ranks'} {','.join(map(str, rs))} "
                     f"{'has' if len(rs) == 1 else 'have'} {show(names)}" for rs, names in groups.items())
