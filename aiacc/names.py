"""How the tensors an adapter submits on a user's behalf are named: the same on every rank and in every
framework, so that the ranks match them (and the response cache knows them) whatever framework runs."""

from __future__ import annotations

from typing import Optional, Sequence

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
    """For ranks whose lists of names differ: ``only rank 1 has 'x'; only rank 2 has ...`` for each rank holding
    names that not every rank has (``show`` formats them), joined by '; '; empty when every rank has them all."""
    everywhere = set.intersection(*map(set, per_rank))
    return "; ".join(f"only rank {r} has {show([x for x in names if x not in everywhere])}"
                     for r, names in zip(ranks, per_rank) if len(everywhere) < len(names))
