"""``DistributedOptimizer``: gradients live in aiacc's buckets and are averaged as autograd produces them.

The optimizer registers its parameters once with the core's bucket layer (``aiacc.buckets.GradientBuckets``). The
first step learns the order in which autograd produces the gradients and settles the buckets (a collective that also
checks every rank has the same parameters); from then on each ``p.grad`` *is* a view of its bucket's flat buffer
(DDP's ``gradient_as_bucket_view``), autograd accumulates into it in place, and each parameter's
``register_post_accumulate_grad_hook`` only counts: when the last gradient of a bucket is ready, the bucket is sent
as one request while backward carries on with the layers below::

    backward:  [grad fc2][grad fc1]──►bucket 0 full: submit   [grad conv2][grad conv1]──►bucket 1: submit
    engine:                          └──── allreduce bucket 0 ────┘         └─ allreduce bucket 1 ─┘
    step():                                                               wait for both ─► optimizer update

No gradient is copied, and the engine's work per step follows the number of buckets (``AIACC_BUCKET_CAP``, DDP's
``bucket_cap_mb``), not of parameters. Because the gradients live in the buckets, ``zero_grad()`` of this optimizer
zeroes them in place (one fill per bucket) instead of setting them to None; a ``.grad`` set to None or replaced
elsewhere (``model.zero_grad()``) is copied back into its bucket by its hook in the next backward (one copy).

``step()`` waits for the buckets (``synchronize()``), then runs the wrapped
optimizer's own update; ``wait_for(p)`` waits for one parameter's bucket, so
a forward pre-hook can wait for exactly the parameters of the next layer
(``overlap_forward``).

Averaging semantics (Horovod's): with ``backward_passes_per_step=k``, autograd
*sums* the gradients of the k backward passes locally, then the sum is
averaged across ranks (``op=Average``); nothing divides by k. Scale the loss
by 1/k yourself if you want the mean over the k passes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import warnings
import weakref
from typing import Dict, List

import torch

import aiacc
from aiacc.buckets import GradientBuckets, ParamSpec
from aiacc.compression import as_compressor
from aiacc.names import describe, gradient_name
from aiacc.objects import check_passes
from aiacc.ops import Average, ReduceOp, as_reduce_op

from .adasum import adasum_optimizer
from .arrays import laid_out_as, memory_order, to_numpy
from .functions import averaged_loss
from .param_names import parameter_names
from .regroup import HINT, apply_change, check_between_steps, detect_change, regroup, set_groups
from .same_start import count_step
from .schedule import ForwardScheduler, only_params, remove_hooks
from .slots import (Slot, changed_before_averaging, changed_before_averaging_error, changed_in_flight,
                    changed_in_flight_error, check_synchronized, check_unconverted, claim, fits, handed, new_view,
                    release, repeated_grad_error, taken_error, unscaling_early, view_as)
from .sparse_grads import finish_sparse, hand_over, submit_sparse, turn_sparse
from .shared_state import SharedState, guard_wrapped, sharing_state
from .untraced import not_traced

logger = logging.getLogger(__name__)

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(SharedState):
    """Mixed in front of the user's optimizer class; see :func:`DistributedOptimizer`."""

    def _aiacc_setup(self, engine, process_set, names: Dict[torch.Tensor, str], order: List[torch.Tensor],
                     compression, backward_passes_per_step, factors, sparse_as_dense, overlap_forward,
                     bucket_cap: int, setup_name=None) -> None:
        self._aiacc_op, self._aiacc_prescale, self._aiacc_postscale = factors
        self._aiacc_args = (compression, factors, sparse_as_dense, overlap_forward, bucket_cap)  # (see regroup)
        self._aiacc_compression, self._aiacc_sparse_as_dense = compression, sparse_as_dense
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._aiacc_order = order
        params = [p for p in order if p.requires_grad]
        # parameters in no bucket: frozen now; later, also those of a param group added after wrapping
        self._aiacc_untracked = [p for p in order if not p.requires_grad]
        self._aiacc_param_ids = [tuple(map(id, group["params"])) for group in self.param_groups]
        self._aiacc_slots: Dict[int, Slot] = {
            id(p): Slot(p, names[p], i, self.backward_passes_per_step) for i, p in enumerate(params)}
        self._aiacc_slot_list = list(self._aiacc_slots.values())
        self._aiacc_fresh = set(range(len(params)))  # no rank has had their gradients yet (see sparse_grads)
        self._aiacc_change = None  # the parameters to average changed: regrouped at synchronize() (see regroup.py)
        # registered in model order: the core gives those nearer the input the higher priority
        self._aiacc_buckets = GradientBuckets(
            engine, [ParamSpec(gradient_name(names[p]),
                               tuple(laid_out_as(p, self._aiacc_slots[id(p)].order, inverse=True).shape),
                               to_numpy(p, names[p]).dtype, "cuda" if p.is_cuda else "cpu") for p in params],
            op=self._aiacc_op, prescale=self._aiacc_prescale, postscale=self._aiacc_postscale,
            compression=compression, cap=bucket_cap, presence=True, setup_name=setup_name, regroup_hint=HINT,
            engine_of=lambda: aiacc.engine_for(process_set))  # (after shutdown() and init() again: the new one)
        self._aiacc_should_synchronize, self._aiacc_synchronized = True, False
        self._aiacc_inflight = False  # gradients handed to the engine, not waited for yet: param_groups waits for them
        self._aiacc_read_synced = False  # synchronized because param_groups was read (see the property)
        self._aiacc_settled = False  # the first step has settled the buckets
        self._aiacc_process_set = process_set
        self._parameter_names = names  # Horovod's name for {parameter: name}, which its tests read
        # The hooks hold the optimizer weakly and are removed when it is collected, so a replaced
        # DistributedOptimizer stops sending gradients instead of sending them twice.
        owner = weakref.ref(self)

        def hook_for(slot: Slot):
            def on_grad(_p: torch.Tensor) -> None:
                opt = owner()
                if opt is not None:
                    opt._aiacc_on_grad(slot)
            return on_grad

        for slot in self._aiacc_slot_list:
            slot.hook = slot.param.register_post_accumulate_grad_hook(hook_for(slot))
        self._aiacc_hooks = [slot.hook for slot in self._aiacc_slot_list]
        self._aiacc_taken = None  # the name of a parameter a newer wrapper took over (see slots.claim)
        claim(self._aiacc_slot_list, self)
        weakref.finalize(self, remove_hooks, list(self._aiacc_hooks))
        self._aiacc_sched = ForwardScheduler(self) if overlap_forward else None
        if self._aiacc_sched is not None:  # collected: its modules' hooks go too (once no update is pending)
            weakref.finalize(self, self._aiacc_sched.close)

    # ---- the hook: autograd calls it once per backward pass per parameter -------------------
    def _aiacc_on_grad(self, slot: "Slot") -> None:
        sched = self._aiacc_sched
        if sched is not None and (id(slot.param) in sched.pending or id(slot.param) in sched.late):
            raise RuntimeError(
                f"parameter {slot.name!r} was used before its deferred update was applied: with overlap_forward "
                "a parameter is updated in the forward pre-hook of its module (or of the enclosing module whose "
                "forward runs), and this one was read by code outside every module's forward. Use "
                "overlap_forward=False (AIACC_OVERLAP_FORWARD=0) for this model")
        if sched is not None and sched.pending:  # updates of modules this step's forward skipped
            sched.flush_unused()
        if slot.delay == 0:
            if slot.param.grad is handed(slot):
                slot.version = slot.param.grad._version  # (said here, not again by step(): changed_in_flight)
                raise repeated_grad_error(slot.name, self.backward_passes_per_step, [
                    s.name for s in self._aiacc_slot_list if not s.delay and not s.sparse
                    and s.param.grad is not handed(s)])
            # its gradient was set to None (model.zero_grad()) after it was handed over: discarded, and computed anew
            self._aiacc_discard()
        slot.delay -= 1
        slot.none = False
        if slot.delay:  # a window not complete yet: its value, to tell a change before step (changed_before_averaging)
            slot.version = slot.param.grad._version
        if slot.delay == 0:
            self._aiacc_inflight = True
            view = slot.view
            if view is None:
                if slot.sparse or (slot.param.grad is not None and slot.param.grad.is_sparse):
                    submit_sparse(self, slot)
                    return
                # the first step: the buckets learn the order gradients arrive in
                grad = slot.given = self._aiacc_dense_grad(slot)
                slot.version = grad._version if sched is None else -1  # (changed_in_flight; -1: unchecked)
                self._aiacc_buckets.ready(slot.index, self._aiacc_in_memory_order(slot, grad))
                return
            if slot.param.grad is not view or view.data_ptr() != slot.ptr:
                hand_over(self, slot)
            slot.version = view._version  # (changed in place while its bucket is averaged: see changed_in_flight)
            self._aiacc_buckets.ready(slot.index)

    def _aiacc_dense_grad(self, slot: "Slot") -> torch.Tensor:
        if slot.param.grad is None:  # no gradient on this rank (the parameter was unused); another rank may have one
            slot.param.grad = torch.zeros_like(slot.param)
        return slot.param.grad

    @staticmethod
    def _aiacc_in_memory_order(slot: "Slot", grad: torch.Tensor):
        """The first step's gradient for its bucket: an array with the dimensions in the bucket's order."""
        check_unconverted(slot)
        return to_numpy(laid_out_as(grad, slot.order, inverse=True), slot.name)

    def _aiacc_adopt(self, slot: "Slot") -> None:
        """``p.grad`` is not its bucket view (set to None or replaced since), or the view's ``.data`` was set
        (the model converted: ``Module._apply``): copy it in, point back (a view laid out anew for a converted
        parameter, also one converted while it had no gradient)."""
        p = slot.param
        grad = p.grad
        if not fits(slot):
            if grad is slot.view:  # (its own memory, or the bucket's with the old layout: copied out first)
                grad = grad.clone()
            new_view(slot, self._aiacc_buckets)
        with torch.no_grad():
            if grad is None:
                slot.view.zero_()
            else:
                slot.view.copy_(grad.to_dense() if grad.is_sparse else grad)
        p.grad = slot.view

    def _aiacc_attach_views(self) -> None:
        """After the first step settled the buckets: every ``p.grad`` becomes a view of its bucket
        (which already holds the gradients handed over in that step)."""
        buckets = self._aiacc_buckets
        for slot in self._aiacc_slot_list:
            slot.given = None
            if buckets.excluded(slot.index):
                slot.sparse = True
            elif slot.view is None:  # as at wrapping: the first step's gradient is in it, maybe in flight
                check_unconverted(slot)
                slot.view = view_as(slot, self._aiacc_buckets, slot.order)
                # 0: the parameter's memory format changed since; laid out anew once the bucket is done
                slot.ptr = slot.view.data_ptr() if memory_order(slot.param) == slot.order else 0
                slot.param.grad, slot.version = slot.view, slot.view._version  # (the handed-over one's counter: moot)

    # ---- waiting -------------------------------------------------------------------------------
    def wait_for(self, p: torch.Tensor) -> None:
        """Block until ``p.grad`` holds the averaged gradient (submitting its bucket now if needed)."""
        self._aiacc_wait(self._aiacc_slots[id(p)])

    def _aiacc_wait(self, slot: "Slot") -> None:
        if slot.done:
            return
        if not self._aiacc_settled:
            self._aiacc_submit_missing()
        if not slot.sparse:
            self._aiacc_buckets.wait_for(slot.index)
            turn_sparse(self, slot.index)  # (it may turn sparse itself)
        if slot.sparse:
            finish_sparse(self, slot)
        else:
            self._aiacc_check_grad(slot)
            self._aiacc_unset_absent(slot.index)
        slot.done = True

    def _aiacc_unset_absent(self, index=None) -> None:
        """After the wait: a gradient no rank had this step (None on every rank: the parameter unused in every
        rank's forward, or frozen) is None again, so the optimizer skips the parameter as torch does in one
        process (and DDP): no momentum, weight decay or Adam step moves it, and its state stays as it was.
        Horovod steps it on zeros. (None on some ranks only: their zeros count in the average.)"""
        slots, gone = self._aiacc_slot_list, set(self._aiacc_buckets.absent_everywhere(index))
        for i in gone:
            slots[i].param.grad = None
            slots[i].none = True
        if self._aiacc_fresh:  # those some rank had a gradient for are no longer fresh (see sparse_grads)
            self._aiacc_fresh -= {i for i in self._aiacc_fresh if (index is None or i == index) and i not in gone}

    def _aiacc_check_grad(self, slot: "Slot") -> None:
        if slot.param.grad is not slot.view:
            raise RuntimeError(
                f"the gradient of {slot.name!r} was replaced (model.zero_grad() or an assignment to .grad) "
                "while it was being averaged; zero gradients only after step()")
        if slot.view.data_ptr() != slot.ptr:  # 0: see _aiacc_attach_views; else its .data set while it was averaged
            new_view(slot, self._aiacc_buckets, keep=True)  # (the model converted then): the bucket has the result
            slot.param.grad = slot.view

    def _aiacc_reset(self, slot: "Slot") -> None:
        """A deferred update of ``slot`` was applied: its part of the step is over."""
        slot.reset(self.backward_passes_per_step)
        if not slot.sparse:
            self._aiacc_buckets.release(slot.index)

    def _aiacc_submit_missing(self) -> None:
        """Submit the buckets whose gradients are not all in (parameters unused on this rank, or
        fewer backward passes): the other ranks may have gradients for them. In the first step
        this settles the buckets (a collective) and points every ``p.grad`` into them."""
        detect_change(self)
        buckets = self._aiacc_buckets
        settled = self._aiacc_settled
        # A gradient not handed over this step (fewer than backward_passes_per_step passes, a parameter unused
        # here, a gradient set by hand as after torch.autograd.grad) is reduced as it is, as Horovod's
        # synchronize() does: None counts as zeros (model.zero_grad() sets None). Its bucket view is not
        # ``p.grad`` then, or in the first step there is no view yet: its value goes in now, before the send.
        # A gradient that is None on every rank (no backward of the step reached it: unused, or frozen with
        # requires_grad_(False)) stays None, so the optimizer skips it as in one process (and DDP); see ``synchronize``.
        passes = self.backward_passes_per_step
        for slot in self._aiacc_slot_list:
            if not slot.delay or slot.sparse:  # handed over (its hook ran), or reduced on its own
                continue
            if not slot.param.requires_grad:  # frozen since (see regroup.py)
                self._aiacc_change = True
            grad = slot.param.grad
            if slot.delay == passes and (grad is None or (slot.none and grad is slot.view)):
                buckets.absent(slot.index)  # (None here: zeros in the bucket; None after, unless some rank has it)
            if settled:
                if grad is not slot.view or slot.view.data_ptr() != slot.ptr:
                    hand_over(self, slot)
            elif grad is not None and not buckets.marked(slot.index):
                if grad.is_sparse:
                    submit_sparse(self, slot)
                else:
                    buckets.ready(slot.index, self._aiacc_in_memory_order(slot, grad))
        buckets.submit_rest()
        if not self._aiacc_settled:
            self._aiacc_settled = True
            self._aiacc_attach_views()
        for slot in self._aiacc_slot_list:
            if slot.sparse and slot.handle is None and not slot.done:
                submit_sparse(self, slot)

    def synchronize(self) -> None:
        """Wait until every parameter's gradient is averaged across ranks (and in ``p.grad``).

        With ``overlap_forward``, called between ``step()`` and the next forward, it applies the
        updates ``step()`` deferred (every parameter is then final) and returns.
        """
        sched = self._aiacc_sched
        if sched is not None and sched.pending:
            sched.flush()
            return
        self._aiacc_inflight = False  # (waited for here: param_groups, read below, must not wait too)
        slots = self._aiacc_slot_list
        raced = changed_in_flight(slots)  # (before the buckets not sent yet are)
        early = changed_before_averaging(slots, self.backward_passes_per_step)
        # nothing handed over since the last wait (synchronize() after step()): step() will not average anything again
        handed_any = any(slot.delay != self.backward_passes_per_step for slot in slots)
        self._aiacc_submit_missing()
        try:
            self._aiacc_buckets.wait()
            turn_sparse(self)
            for slot in slots:
                if slot.sparse:
                    finish_sparse(self, slot)
                else:
                    self._aiacc_check_grad(slot)
            self._aiacc_unset_absent()
            if raced or early:  # (once nothing is in flight)
                raise changed_in_flight_error(raced) if raced else changed_before_averaging_error(early)
        finally:
            passes = self.backward_passes_per_step
            for slot in slots:
                slot.reset(passes)
        if self._aiacc_change is not None:
            apply_change(self)
        self._aiacc_synchronized = handed_any

    def _aiacc_discard(self) -> None:
        """Gradients handed over in this step were discarded before ``step()``: a GAN's generator backward computes
        the discriminator's gradients too, which the loop throws away (``netD.zero_grad()`` then a new backward, or
        ``optD.zero_grad()``). Every rank sent them (or sends what is missing now): wait for them all, drop what came
        back, and begin the step again with each ``.grad`` as it is now, as in one process (and DDP); Horovod
        refused it. One allreduce wasted, as under DDP. A gradient kept in its bucket (not thrown away) now holds
        its reduction R(g): averaged again with what the next backward adds, R(R(g) + g') = R(g) + R(g') for an
        Average; for a Sum it is scaled by 1/size first, so that it counts once."""
        slots = self._aiacc_slot_list
        held = [(slot, slot.param.grad) for slot in slots]
        self._aiacc_inflight = False
        self._aiacc_submit_missing()
        try:
            self._aiacc_buckets.wait()
            for slot in slots:
                if slot.sparse:
                    finish_sparse(self, slot)
        finally:
            passes = self.backward_passes_per_step
            for slot, grad in held:
                slot.reset(passes)
                slot.param.grad = grad
        if as_reduce_op(self._aiacc_op) == ReduceOp.SUM:  # (an Average's factors multiply to 1: nothing to do)
            with torch.no_grad():
                for slot, grad in held:
                    if grad is not None and grad is slot.view:
                        grad.div_(getattr(self._aiacc_buckets.engine, "size", 1))

    @property
    def param_groups(self):
        """The optimizer's parameter groups (the user's optimizer's list). Read between ``backward()``
        and ``step()`` while gradients are being averaged, it first waits for them (``synchronize()``),
        so whatever reads the gradients through the optimizer reads the averaged ones: ``GradScaler``'s
        ``scaler.step(optimizer)`` unscales them in place before it calls ``step()`` (it would race the
        engine writing them, and decide on infinities per rank), and does the same inside ``step()`` too
        -- the loop DDP users write works as it is. ``step()`` then does not average them again."""
        d = self.__dict__
        if d.get("_aiacc_inflight") or unscaling_early(d):
            d["_aiacc_inflight"] = False
            sched = d.get("_aiacc_sched")
            if d.get("_aiacc_should_synchronize", True) and (sched is None or not sched.pending):
                self.synchronize()
                d["_aiacc_read_synced"] = True
        return d["param_groups"]

    @param_groups.setter
    def param_groups(self, groups) -> None:
        set_groups(self, groups)  # (parameters changed: regrouped as by add_param_group)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this context ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._aiacc_should_synchronize = False
        try:
            yield
        finally:
            self._aiacc_should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        passes = check_passes(passes)
        sched = self._aiacc_sched
        if sched is not None and sched.pending:  # (after step(), with overlap_forward: that step is over)
            sched.flush()
        if any(slot.delay != self.backward_passes_per_step for slot in self._aiacc_slot_list):
            raise RuntimeError("set_backward_passes_per_step() must be called between steps")
        self.backward_passes_per_step = passes
        for slot in self._aiacc_slot_list:
            slot.reset(self.backward_passes_per_step)

    # ---- the optimizer interface ----------------------------------------------------------------
    def step(self, closure=None):
        count_step(self)  # (the second step compares the parameters across the ranks, once: see same_start.py)
        if closure is not None and self._aiacc_should_synchronize:
            # The closure's backward() produces the gradients: average them before the update
            # reads them (each time the optimizer calls the closure, as LBFGS does).
            if any(slot.delay != self.backward_passes_per_step for slot in self._aiacc_slot_list):
                self.synchronize()

            def closure_then_synchronize():
                loss = closure()
                self.synchronize()
                # the optimizer decides on the loss too (LBFGS' line search and its tolerance): every rank must see
                # the same one, the average (each rank's own split the ranks apart, then left them waiting)
                return averaged_loss(loss, self._aiacc_process_set)

            self._aiacc_synchronized = self._aiacc_read_synced = False
            return super().step(closure_then_synchronize)
        sched = self._aiacc_sched
        if sched is not None and self._aiacc_should_synchronize and not self._aiacc_synchronized:
            # Defer the update of each parameter to its module's next forward (see schedule.py).
            self._aiacc_inflight = False  # (each module's forward waits for its parameters)
            sched.flush()
            self._aiacc_submit_missing()
            if self._aiacc_change is None:  # (else synchronous: synchronize() regroups; see regroup.py)
                sched.defer(self._aiacc_slots.values())
                return None
        if self._aiacc_should_synchronize and not (self._aiacc_read_synced and not self._aiacc_inflight):
            if self._aiacc_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(): gradients are averaged again, which is slow (and wrong "
                              "with op=Sum)", stacklevel=2)
            self.synchronize()
        elif not self._aiacc_should_synchronize:
            check_synchronized(self._aiacc_slot_list, self.backward_passes_per_step)
        self._aiacc_synchronized = self._aiacc_read_synced = False
        return super().step(closure)

    def add_param_group(self, param_group) -> None:
        """torch's, between steps; the group's parameters are averaged from the next step on (see regroup.py)."""
        averaging = check_between_steps(self)
        super().add_param_group(param_group)
        if averaging:
            regroup(self)

    def _aiacc_base_step(self):
        """The wrapped optimizer's own update, without synchronizing (used for deferred updates)."""
        return super().step()

    def state_dict(self):
        if getattr(self, "_aiacc_sched", None) is not None:
            self._aiacc_sched.flush()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        if getattr(self, "_aiacc_sched", None) is not None:
            self._aiacc_sched.flush()
        return super().load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        """Zero the gradients. Once the first step has settled the buckets, the gradients live in
        them and are zeroed in place (one fill per bucket) whatever ``set_to_none`` says: setting
        them to None would cost a copy per gradient in the next backward. With ``set_to_none`` they count as None
        all the same: one that no backward hands over on any rank before the step is None after the wait, so the
        optimizer skips its parameter as torch does."""
        sched = self._aiacc_sched
        if sched is not None and sched.pending:
            # updates still pending: their parameters are zeroed right after the update
            sched.zero_grad_later(set_to_none)
            with only_params(self.param_groups, lambda p: id(p) not in sched.pending):
                return super().zero_grad(set_to_none)
        slots = self._aiacc_slot_list
        if any(slot.delay == 0 and not slot.done for slot in slots):
            # between backward() and step(): those gradients are thrown away (a GAN's generator step computed the
            # discriminator's too); Horovod refused it, as a race with the engine writing them
            self._aiacc_discard()
        passes = self.backward_passes_per_step
        partial = [slot.name for slot in slots if 0 < slot.delay < passes]
        if partial:
            raise RuntimeError(
                f"zero_grad() was called after fewer than backward_passes_per_step={passes} "
                f"backward passes; the gradients accumulated so far for {describe(partial)} would be lost. "
                "Call step() after the last backward pass, then zero_grad() (to drop a last, partial window instead: "
                "synchronize(), then zero_grad())")
        if self._aiacc_taken:
            raise taken_error(self._aiacc_taken)
        if not self._aiacc_settled:
            return super().zero_grad(set_to_none)
        self._aiacc_buckets.zero()
        in_buckets = set()
        for slot in slots:
            if not slot.sparse:
                in_buckets.add(id(slot.param))
                if slot.index in self._aiacc_fresh:  # None, so a sparse gradient comes as it is (see sparse_grads)
                    slot.param.grad, slot.none = None, True
                    continue
                # None for torch (which leaves a None gradient None also with set_to_none=False): if no backward of
                # the step hands it over on any rank, it is None again after the wait (see _aiacc_unset_absent)
                slot.none = set_to_none or slot.param.grad is None
                if slot.param.grad is not slot.view or slot.view.data_ptr() != slot.ptr:
                    if not fits(slot):  # the model converted (a zeroed bucket)
                        new_view(slot, self._aiacc_buckets)
                    slot.param.grad = slot.view
        # sparse gradients and parameters that take no gradient keep the optimizer's own behaviour
        with only_params(self.param_groups, lambda p: id(p) not in in_buckets):
            return super().zero_grad(set_to_none)

    def remove_hooks(self) -> None:
        """Detach this optimizer from the parameters' gradient hooks (it stops averaging)."""
        if self._aiacc_sched is not None:
            self._aiacc_sched.flush()
            self._aiacc_sched.close()
        remove_hooks(self._aiacc_hooks)
        self._aiacc_hooks = []
        release(self._aiacc_slot_list, self)


# torch wraps a class's step() once (Optimizer._patch_step_function, also run by load_state_dict) to call the step
# hooks; the wrapped optimizer's own step() does that when this one calls super().step(): not again here (twice).
_DistributedOptimizer.step.hooked = True


class _OutsideProcessSet(SharedState):
    """The optimizer of a rank outside the ``process_set`` given to ``DistributedOptimizer``: it
    trains on its own gradients (Horovod's behaviour), with the wrapper's methods as no-ops."""

    def synchronize(self) -> None:
        pass

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = check_passes(passes)

    def remove_hooks(self) -> None:
        pass


# torch.compile(opt.step) (torch's compiled-optimizer recipe), or a compiled function calling opt.step(): the
# wrapper's methods wait for the engine, so they run as they are, a graph break around them (see untraced.py)
not_traced(_DistributedOptimizer, _OutsideProcessSet)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step: int = 1,
                         op=Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, process_set=None, overlap_forward=None,
                         bucket_cap_mb=None):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged across all ranks.

    Returns an object of a subclass of ``optimizer``'s class that shares its state and
    parameter groups (learning-rate schedulers keep working); with aiacc disabled
    (``AIACC_ENABLE`` unset or 0) returns ``optimizer`` itself.

    ``named_parameters``: ``model.named_parameters()``; names identify gradients across ranks and
    appear in errors and the timeline. ``compression``: ``Compression.none``, ``.fp16`` or ``.bf16``
    on the wire. ``backward_passes_per_step``: backward passes accumulated locally (summed) before
    the allreduce. ``op``: Average or Sum; ``Adasum`` gives Horovod's Adasum optimizer instead (each rank's
    local step combined with Adasum, see ``aiacc.torch.adasum``). ``gradient_predivide_factor``: divide by this
    before the sum and by ``size / factor`` after it. ``sparse_as_dense``: average sparse gradients as dense.
    ``num_groups`` / ``groups`` are checked as Horovod checks them and change nothing: the
    engine fuses whatever gradients are ready into one buffer by itself. ``overlap_forward``
    (default ``AIACC_OVERLAP_FORWARD``): ``step()`` returns at once and each parameter is updated
    in the forward pre-hook of its module, so communication overlaps the next forward pass too
    (see ``aiacc.torch.schedule``). ``bucket_cap_mb`` (aiacc's, as in DDP; default
    ``AIACC_BUCKET_CAP``, 25 MiB): the largest gradient bucket in MiB.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    aiacc.check_groups(num_groups, groups, "DistributedOptimizer", torch.Tensor)
    as_compressor(compression)  # (its error now, also when switched off; the engine's step would raise it)
    if op is not None and as_reduce_op(op) == ReduceOp.ADASUM:
        passes = check_passes(backward_passes_per_step)
        return adasum_optimizer(optimizer, *parameter_names(optimizer.param_groups, named_parameters), compression,
                                passes, gradient_predivide_factor, sparse_as_dense, process_set)
    # checked also when switched off, so that a mistake shows before the script is launched for real: (op, prescale,
    # postscale) of the gradients' allreduce, or an error naming a bad argument
    check_passes(backward_passes_per_step)
    factors = aiacc.gradient_factors(op, gradient_predivide_factor, "DistributedOptimizer")
    if bucket_cap_mb is not None and not (isinstance(bucket_cap_mb, numbers.Real) and 0 < bucket_cap_mb < math.inf):
        raise ValueError(f"DistributedOptimizer: bucket_cap_mb={bucket_cap_mb!r}; expected a size in MiB > 0")
    names, order = parameter_names(optimizer.param_groups, named_parameters, process_set)
    engine, outside = aiacc.gradient_engine(process_set, "DistributedOptimizer")  # checks the set in every mode
    if outside:
        outside = sharing_state(optimizer, _OutsideProcessSet)
        outside.backward_passes_per_step, outside._aiacc_process_set = int(backward_passes_per_step), process_set
        return outside
    if engine is None:
        return optimizer  # (switched off: no communication, no warning about it)
    if any(name.startswith("_orig_mod.") for name in names.values()):
        warnings.warn("DistributedOptimizer: the model is torch.compile'd as one graph, whose backward hands every "
                      "gradient over at its very end: communication cannot overlap backward (the results are "
                      "right). Compile its blocks one by one instead (for block in model.layers: block.compile()), "
                      "which keeps the overlap; see the README, 'torch.compile'.", stacklevel=2)
    wrapped = sharing_state(optimizer, _DistributedOptimizer)
    overlap_forward = engine.config.overlap_forward if overlap_forward is None else overlap_forward
    cap = engine.config.bucket_cap if bucket_cap_mb is None else int(bucket_cap_mb * (1 << 20))
    wrapped._aiacc_setup(engine, process_set, names, order, compression, int(backward_passes_per_step), factors, sparse_as_dense,
                         bool(overlap_forward), cap)
    guard_wrapped(optimizer, wrapped)
    return wrapped
