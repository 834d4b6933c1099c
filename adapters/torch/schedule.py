"""Overlap communication with the *next* forward pass (ByteScheduler's idea for PyTorch).

With ``DistributedOptimizer(..., overlap_forward=True)`` (or ``AIACC_OVERLAP_FORWARD=1``),
``step()`` returns without waiting. Each parameter's update is applied by
the forward pre-hook of the module that owns it, which waits only for that
parameter's averaged gradient::

    backward t:   fc2 ─► fc1 ─► conv2 ─► conv1      (gradients submitted as produced)
    engine:        allreduce fc2, fc1 (big, partitioned) … conv grads jump ahead (higher priority)
    step t:       returns at once (hyper-parameters of step t are remembered)
    forward t+1:  conv1: wait conv1, update ─► conv2: wait, update ─► fc1: wait, update ─► fc2 …

The engine sends what the next forward needs first (priority: closer to the
input = more urgent), so the first layers' updates are ready early and
communication of the last layers runs under the first layers' forward.

Results are the same as without overlap: every update is the optimizer's own
step on the same averaged gradients, with the learning rate and other
hyper-parameters of the step that produced them (a scheduler that changes the
lr after ``step()`` does not leak into the deferred update). ``zero_grad()``
of a parameter whose update is pending is carried out right after the update.

A parameter whose module's forward never runs (``nn.MultiheadAttention``
reads ``out_proj.weight`` itself) is updated before the forward of the nearest
enclosing module whose forward does run (learned from the forwards seen so
far). Pending updates are also applied by ``optimizer.synchronize()``, the
next ``step()``, ``optimizer.state_dict()`` and the ``state_dict()`` of any
module whose forward has run. A module skipped in a step's forward (LayerDrop,
a data-dependent branch) has its update applied when the next backward hands
over its first gradient: nothing read those parameters in that forward. A
parameter read by code outside every module forward seen so far would see its
old value: when its gradient then arrives after the update was still pending
at that forward, aiacc raises an error naming it rather than training on wrong
numbers. Turn the overlap off for such models.

Code that changes parameters between ``step()`` and the next forward (weight clipping, a hand-made weight decay
or EMA) must call ``optimizer.synchronize()`` first, which applies the pending updates. Without it, a change
torch counts (the parameter's version counter: in place under ``torch.no_grad()``) is refused at the update naming
the parameter; a change through ``p.data`` leaves that counter as it was and cannot be told (README: a limitation).

Updates are applied outside ``torch.inference_mode`` (an eval forward under it
may be where they happen: optimizer state made there could not be updated
later). The scheduler holds its optimizer while updates are pending, so a
model whose optimizer was dropped right after ``step()`` still gets them. A
copy of the model (``copy.deepcopy``) shares the hook that applies them, and
pickling the whole model (``torch.save(model)``) while the hooks are on is
refused naming ``optimizer.remove_hooks()``: save ``model.state_dict()``, as
torch recommends, or remove the hooks first.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, List

import torch

from .slots import handed

__all__ = ["ForwardScheduler", "only_params", "remove_hooks"]


@contextlib.contextmanager
def only_params(groups, keep: Callable[[torch.Tensor], bool]):
    """Within the block, each param group lists only the parameters ``keep`` accepts (so that
    ``step()`` or ``zero_grad()`` of the optimizer touches just those); restored after."""
    saved = [g["params"] for g in groups]
    try:
        for g in groups:
            g["params"] = [p for p in g["params"] if keep(p)]
        yield
    finally:
        for g, params in zip(groups, saved):
            g["params"] = params


def remove_hooks(handles) -> None:
    """Remove torch hooks (``weakref.finalize`` of an optimizer wrapper that registered them)."""
    for h in handles:
        h.remove()


_schedulers: "weakref.WeakSet[ForwardScheduler]" = weakref.WeakSet()
_global_hook = None


def _on_forward(module: torch.nn.Module, _args) -> None:
    # never traced by torch.compile (registered through torch.compiler.disable): it waits for the engine
    # and updates parameters, which a compiled graph must see done (dynamo breaks the graph here and runs it
    # as it is). Wrapped when first registered, not at import: torch.compiler.disable imports dynamo,
    # ~0.85 s that every `import aiacc.torch` paid (measured with python -X importtime).
    for sched in list(_schedulers):
        sched.before_forward(module)


class _FlushBeforeStateDict:
    """A module's ``state_dict`` and ``load_state_dict`` pre-hook: applies the pending updates of its scheduler
    first. The modules' hooks keep the scheduler (and, through it, the optimizer while updates are pending)
    alive."""

    def __init__(self, sched: "ForwardScheduler"):
        self.sched = sched

    def __call__(self, *_args, **_kwargs) -> None:
        self.sched.flush()

    def __deepcopy__(self, memo):  # a copy of the model: the same hook (its state_dict applies the updates)
        return self

    def __reduce__(self):
        raise TypeError("this model was trained with DistributedOptimizer(overlap_forward=True), whose hooks apply "
                        "deferred updates and cannot be pickled: save model.state_dict() (as torch recommends), or "
                        "call optimizer.remove_hooks() before pickling the whole model")


class ForwardScheduler:
    """The deferred-update state of one DistributedOptimizer."""

    def __init__(self, optimizer):
        global _global_hook
        self.optimizer = weakref.ref(optimizer)
        self._holding = None  # the optimizer, held while updates are pending
        self._handles = []  # the modules' state_dict pre-hooks
        self._flush_hook = _FlushBeforeStateDict(self)
        self.late = set()  # id(param): applied in this step's backward (its module's forward did not run)
        self.pending: Dict[int, object] = {}  # id(param) -> slot, update not applied yet
        self.zero_after: Dict[int, bool] = {}  # id(param) -> set_to_none, zero_grad deferred
        self.hparams: List[dict] = []  # per param group, as they were at step()
        self.versions: Dict[int, int] = {}  # id(param) -> its gradient's version (in-place changes) at step()
        self.param_versions: Dict[int, int] = {}  # id(param) -> the parameter's own version at step()
        # modules whose forward has run (through module(...)): they update their own parameters
        self._fired: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        # module -> [(parameter, owning module)] of its whole subtree, computed once
        self._subtree: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
        _schedulers.add(self)
        if _global_hook is None:
            _global_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                torch.compiler.disable(_on_forward))

    # ---- step(): remember what to update, and how ------------------------------------------
    def defer(self, slots) -> None:
        opt = self.optimizer()
        self.hparams = [{k: _as_now(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        self.late.clear()
        self.versions = {}
        self.param_versions = {}
        for slot in slots:
            self.pending[id(slot.param)] = slot
            self.param_versions[id(slot.param)] = slot.param._version
            if handed(slot) is not None:
                self.versions[id(slot.param)] = handed(slot)._version
        if self.pending:
            self._holding = opt

    # ---- the forward pre-hook ----------------------------------------------------------------
    def before_forward(self, module: torch.nn.Module) -> None:
        if not self.pending and self.optimizer() is None:  # the optimizer is gone: nothing will be deferred again
            self.close()
            return
        if module not in self._fired:
            if getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod"):
                # a compiled graph reads its parameters as they were when the graph ran; updates
                # applied from hooks within it come too late (measured: wrong results), so refuse
                raise RuntimeError(
                    f"overlap_forward does not work with torch.compile'd modules ({type(module).__name__} is "
                    "compiled): use DistributedOptimizer(..., overlap_forward=False) (AIACC_OVERLAP_FORWARD=0), "
                    "and compile the model's blocks one by one to keep communication overlapping backward")
            self._fired.add(module)
            self._handles.append(module.register_state_dict_pre_hook(self._flush_hook))  # sees updated parameters
            # and a load overwrites updated parameters (a pending update applied after it, in the next forward,
            # moved the loaded values: TorchState.restore() did not return to the commit)
            self._handles.append(module.register_load_state_dict_pre_hook(self._flush_hook))
        if not self.pending and not self.late:
            return
        subtree = self._subtree.get(module)
        if subtree is None:
            subtree = self._subtree[module] = [(p, owner) for owner in module.modules()
                                               for p in owner._parameters.values() if p is not None]
        if self.late:  # updated already, and now read by its module: its next gradient is a fresh one
            for p, owner in subtree:
                if owner is module:
                    self.late.discard(id(p))
        if not self.pending:
            return
        # A module's own parameters, and those of submodules whose forward never runs (their
        # parameters are read by this module's code, as nn.MultiheadAttention reads out_proj.weight).
        pending, fired = self.pending, self._fired
        due = [pending[id(p)] for p, owner in subtree
               if id(p) in pending and (owner is module or owner not in fired)]
        if due:
            self.apply(due)

    # ---- applying updates ----------------------------------------------------------------------
    def flush(self) -> None:
        """Apply every pending update (before anything reads all parameters)."""
        if self.pending:
            self.apply(list(self.pending.values()))

    def flush_unused(self) -> None:
        """The backward of the next step hands over its first gradient with updates still pending: their
        modules' forward did not run in this step (skipped), so nothing read them; apply them now (their
        buckets take this step's gradients next). A parameter among them that gets a gradient in this
        backward was read by other code with its old value: ``late`` names it for the error."""
        self.late.update(self.pending)
        self.flush()

    def apply(self, slots) -> None:
        with torch.inference_mode(False):  # (an eval forward under inference_mode may be where this runs)
            self._apply(slots)

    def _apply(self, slots) -> None:
        opt = self._holding if self._holding is not None else self.optimizer()
        for slot in slots:
            self._check_parameter(slot)
            self._check_gradient(slot)
            opt._aiacc_wait(slot)
        ids = {id(slot.param) for slot in slots}
        groups = opt.param_groups
        saved = [{k: g[k] for k in hp} for g, hp in zip(groups, self.hparams)]
        with only_params(groups, lambda p: id(p) in ids):
            try:
                for g, hp in zip(groups, self.hparams):
                    g.update(hp)
                opt._aiacc_base_step()
            finally:
                for g, hp in zip(groups, saved):
                    g.update(hp)
        for slot in slots:
            key = id(slot.param)
            del self.pending[key]
            opt._aiacc_reset(slot)
            set_to_none = self.zero_after.pop(key, None)
            if set_to_none is not None:
                _zero(slot.param, set_to_none)
        if not self.pending:
            self._holding = None

    def _check_parameter(self, slot) -> None:
        """A parameter changed in place between ``step()`` and its deferred update (weight clipping under
        ``torch.no_grad()``, a hand-made weight decay): the change was made to the value before the update, which
        would then be added on top of it (the order of one process reversed, silently other numbers). Its version
        counter tells (changes through ``p.data`` do not move it: README, overlap_forward)."""
        p = slot.param
        if p._version != self.param_versions.get(id(p), p._version):
            raise RuntimeError(
                f"parameter {slot.name!r} was changed in place after step(), before its deferred update: with "
                "overlap_forward the update is applied in the next forward, so the change was made to the value "
                "before the update. Call optimizer.synchronize() after step() (it applies the pending updates) "
                "before changing parameters outside the forward, or use overlap_forward=False")

    def _check_gradient(self, slot) -> None:
        """Zeroing after ``step()`` is the loop's own business, but here it comes before the update. Set to None
        (``model.zero_grad()``): the update uses the averaged gradient (in its bucket), then it is None, as after
        the optimizer's ``zero_grad()``. Zeroed in place (``model.zero_grad(set_to_none=False)``) or replaced,
        while the bucket was being averaged: each rank averaged whatever it had then (the ranks drifted apart
        silently), so an error naming it."""
        p, view = slot.param, handed(slot)  # (its bucket view, or a sparse gradient that came for it: sparse_grads)
        if p.grad is None:
            if view is not None:
                p.grad = view
            self.zero_after.setdefault(id(p), True)
        elif view is not None and (p.grad is not view or view._version != self.versions.get(id(p), view._version)):
            raise RuntimeError(
                f"the gradient of {slot.name!r} was changed or replaced after step() (model.zero_grad(set_to_none="
                "False)?), before its update: with overlap_forward the update is applied in the next forward, and "
                "the gradient is being averaged until then. Zero gradients with optimizer.zero_grad() (carried out "
                "after the update) or set them to None (model.zero_grad())")

    def zero_grad_later(self, set_to_none: bool) -> None:
        """zero_grad() while updates are pending: defer it for those parameters (the caller zeroes the others)."""
        for key in self.pending:
            self.zero_after[key] = set_to_none

    def close(self) -> None:
        """Stop: no forward pre-hook work, no modules' state_dict hooks (a model stays picklable)."""
        _schedulers.discard(self)
        remove_hooks(self._handles)
        self._handles = []


def _as_now(value):
    """A hyper-parameter's value at ``step()``: a tensor one (``lr=torch.tensor(0.01)``) is copied, since a scheduler
    changes it in place (``fill_``) before the deferred update, which must use the step's value."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):  # (betas of tensors)
        return tuple(_as_now(v) for v in value)
    return value


def _zero(p: torch.Tensor, set_to_none: bool) -> None:
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
    else:
        if p.grad.grad_fn is not None:
            p.grad.detach_()
        else:
            p.grad.requires_grad_(False)
        p.grad.zero_()
