"""One subclass per wrapped class: how the adapters turn a user's optimizer (or tape) into a
distributed one without copying it or running its constructor again."""

from __future__ import annotations

import functools
from typing import Optional

__all__ = ["mixin_class"]


@functools.lru_cache(maxsize=None)
def mixin_class(mixin: type, base: type, module: Optional[str] = None) -> type:
    """``class base.__name__(mixin, base)``, made once per (mixin, base); ``__module__`` is
    ``module``, else ``base``'s (so it prints, and pickles, like the user's class)."""
    return type(base.__name__, (mixin, base), {"__module__": module or base.__module__})
