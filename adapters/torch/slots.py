"""A ``DistributedOptimizer``'s parameters: each one's part in the current step (``Slot``), and what keeps a
gradient from silently leaving its bucket: the model converted after wrapping (``Module._apply``, i.e.
``model.double()``, ``.to(memory_format=...)``, sets ``.data`` of every ``p.grad``, so the bucket view
held its own memory and its rank's gradient stayed unaveraged), and a parameter averaged by two wrappers
at once (each points ``p.grad`` into its own buckets): the newer one takes it over."""

from __future__ import annotations

import sys
import weakref
from typing import List

import torch
from torch.utils.weak import WeakIdKeyDictionary

from aiacc.names import describe

from .arrays import laid_out_as, memory_order
from .mpi_ops import from_array

__all__ = ["Slot", "changed_in_flight", "changed_in_flight_error", "check_synchronized", "check_unconverted", "claim",
           "fits", "handed", "new_view", "release", "repeated_grad_error", "taken_error", "view_as"]


class Slot:
    """One parameter's part in the current step.

    ``delay``: backward passes left before its gradient is final (0: handed to its bucket).
    ``view``: the tensor over its bucket memory that is its ``.grad`` (None before the first
    step has settled the buckets); ``ptr``: the memory it was made over (another: its ``.data`` was
    set since). ``done``: the averaged gradient is in ``p.grad``. ``order``: the parameter's dimensions
    in memory order when it is not row-major (channels_last): its bucket memory holds the gradient in
    that order, and ``view`` has the parameter's strides, as DDP's bucket views do (torch's fused
    optimizers read a gradient as laid out like its parameter; a row-major one on a channels_last
    parameter was misread). ``dtype``, ``device``: the parameter's when the optimizer was wrapped (its
    bucket's). ``none``: its gradient counts as None (see ``DistributedOptimizer.zero_grad``). ``held``: this
    rank's own dense gradient of a parameter no rank has had one for before (copied into its bucket), kept until
    the step's end in case the parameter turns out sparse (``sparse_grads.turn_sparse``).
    """

    __slots__ = ("param", "name", "index", "delay", "view", "ptr", "done", "sparse", "handle", "order", "dtype",
                 "device", "hook", "none", "given", "held", "version")

    def __init__(self, param: torch.Tensor, name: str, index: int, passes: int):
        self.param, self.name, self.index = param, name, index
        self.order = memory_order(param)
        self.dtype, self.device = param.dtype, param.device
        self.view, self.ptr = None, 0
        self.hook = None  # its post-accumulate-grad hook's handle (None: removed, or taken by a newer wrapper)
        self.sparse = False  # produces sparse gradients: reduced on its own, in no bucket
        # its gradient is None as torch sees it, though ``view`` stands in for it (zero_grad() zeroes the buckets
        # in place): set by zero_grad(set_to_none=True), cleared when a backward hands the gradient over
        self.none = False
        # the gradient tensor handed over when it is not the bucket view: in the first step (no view yet), until the
        # buckets settle; later a sparse one that came for a bucketed parameter (``sparse_grads.hand_over``)
        self.given = None
        self.held = None
        self.version = 0  # the version counter of the gradient handed over, when it was (see ``changed_in_flight``)
        self.reset(passes)

    def reset(self, passes: int) -> None:
        self.delay, self.done, self.handle, self.held = passes, False, None, None
        if self.view is not None:
            self.given = None


def handed(slot: Slot):
    """What ``p.grad`` is once its gradient has been handed over (another tensor: it was set to None since)."""
    return slot.given if slot.given is not None else slot.view


def changed_in_flight(slots: List[Slot]) -> List[str]:
    """Before ``step()`` sends what is missing: the names of the gradients changed in place since their hook handed
    them over (``clip_grad_norm_(model.parameters())`` between backward and ``step()``). In a bucket already sent,
    the engine was averaging that memory meanwhile, so the change went in or not by timing; in a bucket that waits
    for ``step()`` (one holding a parameter some rank did not use) it goes in, each rank's own change averaged (not
    DDP's: average, then clip): which one a gradient gets depends on the buckets, so both are refused. (The first
    step's buckets settle in ``step()``, which averaged each rank's changed gradients: refused too, by the counter of
    the gradient its hook handed over; not with overlap_forward, whose deferred updates may run in that backward.)
    Each gradient has its own counter (a view of its own over its bucket's memory), which autograd's accumulation
    moves before the hook, the engine's writes (numpy) never. Changes through ``.data`` leave no trace (README)."""
    return [slot.name for slot in slots if not slot.delay and not slot.sparse and (
        slot.view._version != slot.version if slot.view is not None else
        slot.given is not None and slot.version >= 0 and slot.given._version != slot.version)]


def changed_in_flight_error(names: List[str]) -> RuntimeError:
    return RuntimeError(
        f"the gradient{'s' if len(names) > 1 else ''} of {describe(names)} {'were' if len(names) > 1 else 'was'} "
        "changed in place between backward() and step() while being averaged (torch.nn.utils.clip_grad_norm_ or "
        "p.grad.mul_(...) on model.parameters()): whether the change went into the average depended on timing "
        "and on the gradient buckets. "
        "Average first, then change them: opt.synchronize(); torch.nn.utils.clip_grad_norm_(...); then "
        "`with opt.skip_synchronize(): opt.step()` (Horovod's recipe); or reach them through the optimizer "
        "(reading opt.param_groups waits for the averages first, as GradScaler's unscale_ does)")


def changed_before_averaging(slots: List[Slot], passes: int) -> List[str]:
    """Before ``step()`` sends what is missing: the names of the gradients of a window of fewer than ``passes``
    backward passes (the last micro-batches of an epoch) changed in place since their last pass. None of them was
    handed over yet (a gradient goes at its ``passes``-th pass), so reading ``param_groups`` had nothing to wait for,
    and ``clip_grad_norm_`` or GradScaler's ``unscale_`` changed each rank's own: ``step()`` then averaged each
    rank's clipped gradient (silently not one process's clip of the average), or one rank's unscale found an
    overflow the others did not and the ranks parted (one skipped the step)."""
    return [slot.name for slot in slots if 0 < slot.delay < passes and not slot.sparse and slot.param.grad is not None
            and slot.param.grad._version != slot.version]


def unscaling_early(d: dict) -> bool:
    """Whether ``param_groups`` (the property, whose ``__dict__`` is ``d``) is read by GradScaler's unscale_ while
    gradients of this window are accumulated and not handed over (fewer than ``backward_passes_per_step`` passes: the
    last window of an epoch). unscale_ comes right before the step, so the window ends: the property averages them
    first, and the scaler unscales and looks for infinities on the averages, as in a full window (each rank's own:
    one rank's overflow had that rank alone skip the step)."""
    if sys._getframe(2).f_code.co_name != "_unscale_grads_":  # (the property, then its caller)
        return False
    passes = d.get("backward_passes_per_step", 1)
    return any(0 < slot.delay < passes for slot in d.get("_aiacc_slot_list", ()))


def changed_before_averaging_error(names: List[str]) -> RuntimeError:
    return RuntimeError(
        f"the gradient{'s' if len(names) > 1 else ''} of {describe(names)} {'were' if len(names) > 1 else 'was'} "
        "changed in place between backward() and step() in a window of fewer than backward_passes_per_step backward "
        "passes (the last micro-batches of an epoch), before any rank's were averaged (torch.nn.utils.clip_grad_norm_, "
        "GradScaler's unscale_): each rank changed its own. Average first, then change them: opt.synchronize(); "
        "scaler.unscale_(opt) / clip_grad_norm_(...); then `with opt.skip_synchronize(): opt.step()` (Horovod's "
        "recipe)")


def check_synchronized(slots: List[Slot], passes: int) -> None:
    """``step()`` inside ``skip_synchronize()``: the gradients handed over since the last ``synchronize()`` must have
    been waited for (Horovod's recipe: ``synchronize()`` first). Else the optimizer read gradients the engine was
    still averaging, a mix decided by timing (and the same-start check blamed a missing broadcast); Horovod refused
    it at the next ``zero_grad()``. Raised before the update: the parameters are as they were."""
    names = [slot.name for slot in slots if slot.delay != passes]
    if names:
        raise RuntimeError(
            f"optimizer.step() was called inside optimizer.skip_synchronize() while the gradient"
            f"{'s' if len(names) > 1 else ''} of {describe(names)} handed over by backward() "
            f"{'were' if len(names) > 1 else 'was'} still being averaged: call optimizer.synchronize() first "
            "(loss.backward(); optimizer.synchronize(); change the gradients; with optimizer.skip_synchronize(): "
            "optimizer.step()), or step() outside skip_synchronize()")


def check_unconverted(slot: Slot) -> None:
    """A RuntimeError naming the parameter when its dtype or device is no longer its bucket's."""
    p = slot.param
    if p.dtype != slot.dtype or p.device != slot.device:
        raise RuntimeError(
            f"DistributedOptimizer: parameter {slot.name!r} is now {p.dtype} on {p.device}, but was {slot.dtype} on "
            f"{slot.device} when DistributedOptimizer wrapped the optimizer (model.double(), .half(), .to(...) "
            "since): its gradient bucket holds the gradient as it was. Convert the model before wrapping the "
            "optimizer, or wrap it again (remove_hooks() on this one first)")


def fits(slot: Slot) -> bool:
    """Whether its view is still its bucket's memory (``Module._apply`` sets ``.data`` of a gradient: the model
    converted) laid out for the parameter (``model.to(...)`` while ``p.grad`` was None leaves the view as it was).
    A few microseconds: for the paths that copy anyway."""
    p, view = slot.param, slot.view
    return (view.data_ptr() == slot.ptr and p.dtype == view.dtype and p.device == view.device
            and memory_order(p) == slot.order)


def view_as(slot: Slot, buckets, order):
    """Its bucket memory (``buckets``: the core's ``GradientBuckets``) holding the gradient with the dimensions in
    ``order``, seen like the parameter."""
    p = slot.param
    memory = buckets.view(slot.index).reshape(tuple(laid_out_as(p, order, inverse=True).shape))
    return laid_out_as(from_array(memory, p.dtype), order)


def new_view(slot: Slot, buckets, keep: bool = False) -> None:
    """``slot.view``: its bucket memory laid out as the parameter is now (its memory format may have changed since
    wrapping: the ranks convert alike, and a bucket is reduced element by element). ``keep``: the gradient in it
    stays (rearranged for a new layout; not while in flight); else the caller writes it next."""
    check_unconverted(slot)
    order = memory_order(slot.param)
    kept = view_as(slot, buckets, slot.order).clone() if keep and order != slot.order else None
    slot.order = order
    slot.view = view_as(slot, buckets, order)
    if kept is not None:
        with torch.no_grad():
            slot.view.copy_(kept)
    slot.ptr = slot.view.data_ptr()


def repeated_grad_error(name: str, passes: int, thrown=()) -> RuntimeError:
    """``thrown``: the names of gradients of the same optimizer that were thrown away since they were handed over."""
    if thrown:
        return RuntimeError(
            f"the gradient of {name!r} was computed again before step() while being averaged with gradients that were "
            f"thrown away since ({describe(list(thrown))}, set to None): throw away all of this optimizer's gradients "
            "(optimizer.zero_grad(), or model.zero_grad() over all its parameters) or none of them")
    return RuntimeError(
        f"the gradient of {name!r} was computed more than backward_passes_per_step={passes} times before step(): "
        "to accumulate gradients locally over more backward passes, increase backward_passes_per_step; or one "
        "backward pass computed it twice (a reentrant torch.utils.checkpoint of a block used twice: pass "
        "use_reentrant=False); or its gradient was zeroed in place (model.zero_grad(set_to_none=False)) after the "
        "backward that handed it over, while it was being averaged: to discard gradients before step(), set them to "
        "None (model.zero_grad()) or call optimizer.zero_grad()")


# parameter -> the DistributedOptimizer (weakly) whose hook averages its gradient: the newest wrapper of it
_owners = WeakIdKeyDictionary()


def claim(slots: List[Slot], owner) -> None:
    """``owner`` averages the parameters of ``slots`` from now on. An older wrapper of one of them (still alive:
    ``opt = hvd.DistributedOptimizer(...)`` again runs before the old one is dropped) loses its hook on it, so
    that a backward pass does not hand the gradient to two wrappers, and its later ``step()`` or ``zero_grad()``
    raise ``taken_error`` (each would point ``p.grad`` into its own buckets)."""
    ref = weakref.ref(owner)
    for slot in slots:
        old = _owners.get(slot.param)
        other = old() if old is not None else None
        if other is not None and other is not owner:
            theirs = getattr(other, "_aiacc_slots", {}).get(id(slot.param))
            if theirs is not None and theirs.hook is not None:
                theirs.hook.remove()
                theirs.hook = None
                other._aiacc_taken = other._aiacc_taken or theirs.name
        _owners[slot.param] = ref


def release(slots: List[Slot], owner) -> None:
    """``owner`` stopped averaging the parameters of ``slots`` (``remove_hooks()``)."""
    for slot in slots:
        ref = _owners.get(slot.param)
        if ref is not None and ref() is owner:
            del _owners[slot.param]


def taken_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"DistributedOptimizer: parameter {name!r} is averaged by a DistributedOptimizer made after this one (over "
        "the same parameters), and no longer by this one: step only the newer one, or give each optimizer its own "
        "parameters (one wrapper per parameter: each keeps the gradients in its own buckets)")
