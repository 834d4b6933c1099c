"""Wrapped optimizers that share the user's optimizer's state instead of copying it.

``DistributedOptimizer`` returns an object of a subclass of the user's optimizer class whose
``param_groups`` and ``state`` *are* the user's optimizer's (the same list, dicts and dict), so
whatever holds the user's optimizer (a learning-rate scheduler made before wrapping, a
``GradScaler``'s bookkeeping, a checkpoint helper) sees what the wrapper trains with.
"""

from __future__ import annotations

import functools
import types
import weakref

from aiacc.mixin import mixin_class

__all__ = ["SharedState", "sharing_state"]


class SharedState:
    """Mixed in front of the user's optimizer class (after the wrapper's own mixin): keeps the
    sharing when a state dict is loaded."""

    def load_state_dict(self, state_dict):
        """torch's ``load_state_dict``, written into the existing ``param_groups`` dicts and ``state``:
        torch's replaces the list, its dicts and the state with new objects, so a scheduler made
        before wrapping (it holds the user's optimizer) would go on changing groups the wrapper no
        longer reads, silently: after ``broadcast_optimizer_state`` on every rank but the root (the
        ranks' learning rates part), after a checkpoint or an elastic restore on every rank."""
        groups, state = self.param_groups, self.state
        result = super().load_state_dict(state_dict)
        if self.param_groups is not groups:
            for old, new in zip(groups, self.param_groups):
                params = old["params"]  # (the same parameters, in a list of torch's)
                old.clear()
                old.update(new)
                old["params"] = params
            self.param_groups = groups
        if self.state is not state:
            state.clear()
            state.update(self.state)
            self.state = state
        return result


def sharing_state(optimizer, mixin):
    """An object of ``mixin`` mixed into ``optimizer``'s class that shares the user's optimizer's state,
    parameter groups and hooks (not a copy): its constructor is not run again, so any optimizer works,
    and schedulers see the same param_groups. Attributes that shadow methods (a scheduler's wrapper of
    step) stay behind: they are bound to the old object."""
    base = type(optimizer)
    shared = object.__new__(mixin_class(mixin, base))
    shared.__dict__.update({k: v for k, v in optimizer.__dict__.items() if not callable(getattr(base, k, None))})
    if getattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched", False):
        _tell_schedulers(shared, optimizer)
    return shared


def _tell_schedulers(shared, optimizer) -> None:
    """A learning-rate scheduler made before wrapping wrapped the user's optimizer's ``step`` to note that it
    ran (``_opt_called``), which the wrapper's ``step`` never calls: its first ``step()`` warned "Detected
    call of lr_scheduler.step() before optimizer.step()" although the optimizer had stepped. The wrapper's
    step notes it on both (and is marked as torch's, so a scheduler made on the wrapper leaves it)."""
    user = weakref.ref(optimizer)
    own = weakref.ref(shared)
    step_of_class = type(shared).step

    @functools.wraps(step_of_class)
    def step(*args, **kwargs):
        me, original = own(), user()
        if original is not None:
            original._opt_called = True
        me._opt_called = True
        return step_of_class(me, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    shared.step = step


def guard_wrapped(optimizer, wrapper) -> None:
    """``step()`` of the user's optimizer once ``wrapper`` (a ``DistributedOptimizer``) was made from it raises: it
    updates the parameters with this rank's own gradients, the wrapper's never averaged -- the ranks trained apart
    without a word, and the job ended well (``hvd.DistributedOptimizer(opt, ...)`` without ``opt =``, or the wrapper
    kept under another name). Horovod's hooks refused the second backward. The mark of a scheduler that wrapped
    ``step`` before is kept (see ``sharing_state``); switched off, no wrapper is made and nothing is set."""
    own = weakref.ref(wrapper)
    inner = optimizer.__dict__.get("step")
    kind = type(optimizer).__name__

    def step(_optimizer, *args, **kwargs):
        kept = own() is not None
        raise RuntimeError(
            f"step() was called on the {kind} that hvd.DistributedOptimizer wrapped, whose gradients are not averaged "
            "across the ranks (each rank would train on its own): " + (
                "call step() on the optimizer hvd.DistributedOptimizer returned" if kept else
                "hvd.DistributedOptimizer returns a new optimizer, and the one made from this optimizer was not kept: "
                "write opt = hvd.DistributedOptimizer(opt, ...) and step that one"))

    # a method, as torch's is: a scheduler made on this optimizer later wraps it (lr_scheduler's step_fn.__func__)
    functools.update_wrapper(step, inner if inner is not None else type(optimizer).step)
    optimizer.step = types.MethodType(step, optimizer)
