"""``DistributedOptimizer(op=Adasum)``: Horovod's Adasum optimizer for PyTorch.

Adasum combines what each rank's optimizer would do, not the raw gradients. In each parameter's
gradient hook the wrapped optimizer steps that parameter alone on this rank's gradient; the change
(the delta) goes to ``allreduce_async_(op=Adasum)`` in a buffer of its own, and the parameter is put
back where the step began; ``step()`` waits for each combined delta and adds it. The optimizer's state
(momentum, Adam's moments) stays each rank's own, built from its own gradients, as in Horovod. Every
parameter is an allreduce of its own (Adasum combines tensor by tensor, so nothing is bucketed), and
``step()`` sends a zero delta for a parameter that got no gradient, so every rank reduces the same
tensors. Needs a power-of-2 number of ranks (``aiacc.adasum``).

Gradients thrown away between backward and ``step()``, as a GAN's loop does (the generator's backward
computes the discriminator's gradients too): ``opt.zero_grad()``, or ``netD.zero_grad()`` then a new
backward, waits for the deltas already sent (every rank sent them), drops what came back, restores the
optimizer's state of those parameters and begins the step again, as the Average path does; Horovod
refuses ``opt.zero_grad()`` there, and with ``netD.zero_grad()`` its next forward reads the deltas in
the parameters' memory. ``step()`` does the same when a gradient sent was set to None, replaced or changed
in place since (``model.zero_grad()``, clipping, a GradScaler's ``unscale_``, then ``step()``): the step takes
the gradients as they are then, as in one process. Costs: a delta buffer per parameter (Horovod sends the
parameter's own memory), a copy of each gradient sent (its values tell a change: see ``_aiacc_thrown``) and a
copy of each parameter's optimizer state per step, kept until ``step()`` to undo the local step.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import weakref
from typing import Dict, List

import torch

import aiacc
from aiacc.adasum import check_ranks
from aiacc.ops import Adasum

from .mpi_ops import allreduce_async_
from .same_start import count_step
from .schedule import only_params, remove_hooks
from .shared_state import SharedState, guard_wrapped, sharing_state
from .untraced import not_traced

__all__ = ["AdasumOptimizer", "adasum_optimizer"]

_made = itertools.count()  # Adasum optimizers made (the same sequence on every rank)


class AdasumOptimizer(SharedState):
    """Mixed in front of the user's optimizer class by ``DistributedOptimizer(op=Adasum)``."""

    def _aiacc_adasum_setup(self, names: Dict[torch.Tensor, str], order: List[torch.Tensor], compression,
                            backward_passes_per_step: int) -> None:
        check_ranks(aiacc.size(), "DistributedOptimizer(op=Adasum)")
        self._aiacc_compression = compression  # the deltas travel compressed (Horovod compresses them too)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._parameter_names = names  # (Horovod's attribute)
        self._aiacc_params = [p for p in order if p.requires_grad]
        self._aiacc_start = {p: torch.zeros_like(p, requires_grad=False) for p in self._aiacc_params}
        self._aiacc_delta = {p: torch.zeros_like(p, requires_grad=False) for p in self._aiacc_params}
        # the optimizer's state of each parameter before its local step (None: it had none), and the gradient
        # that step took, while its delta is in flight: a gradient thrown away undoes the step (_aiacc_discard)
        self._aiacc_saved: dict = {}
        # p -> (the gradient its local step took, its version, a copy of its values): see _aiacc_thrown
        self._aiacc_sent: dict = {}
        self._aiacc_copies: dict = {}  # p -> the buffer that copy is kept in (reused from step to step)
        self._aiacc_discards = 0  # steps begun again because gradients sent were thrown away (a test counts them)
        self._aiacc_delay = {p: self.backward_passes_per_step for p in self._aiacc_params}
        self._aiacc_handles: dict = {}
        self._aiacc_serial = next(_made)  # (names of parameters it takes in later: see _aiacc_take_new)
        owner = weakref.ref(self)  # (a replaced optimizer's hooks stop: they hold it weakly)

        def on_grad(p: torch.Tensor) -> None:
            opt = owner()
            if opt is not None:
                opt._aiacc_on_grad(p)

        def before_grad(p: torch.Tensor):
            def hook(_grad) -> None:  # (before torch accumulates it in p.grad)
                opt = owner()
                if opt is not None and p in opt._aiacc_handles and opt._aiacc_thrown(p):
                    opt._aiacc_discard()
            return hook

        self._aiacc_on_grad_hook, self._aiacc_before_grad = on_grad, before_grad
        self._aiacc_hooks = []
        for p in self._aiacc_params:
            self._aiacc_hook(p)
        weakref.finalize(self, remove_hooks, self._aiacc_hooks)

    def _aiacc_hook(self, p: torch.Tensor) -> None:
        self._aiacc_hooks.append(p.register_hook(self._aiacc_before_grad(p)))
        self._aiacc_hooks.append(p.register_post_accumulate_grad_hook(self._aiacc_on_grad_hook))

    def _aiacc_take_new(self) -> None:
        """Parameters trainable now that were not when it was wrapped (unfrozen since, or in a group added with
        ``add_param_group``) are taken in: this step sends their deltas, their hooks send them from the next one.
        ``step()`` applies the combined deltas only, so they were never trained (Horovod's Adasum optimizer leaves
        them so too); every rank takes the same in (whether a parameter trains is the same on every rank)."""
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.requires_grad and p not in self._aiacc_delay:
                    self._parameter_names.setdefault(p, f"adasum{self._aiacc_serial}.param_groups.{gi}.{pi}")
                    self._aiacc_params.append(p)
                    self._aiacc_start[p] = torch.zeros_like(p, requires_grad=False)
                    self._aiacc_delta[p] = torch.zeros_like(p, requires_grad=False)
                    self._aiacc_delay[p] = self.backward_passes_per_step
                    self._aiacc_hook(p)

    def _aiacc_thrown(self, p: torch.Tensor) -> bool:
        """Whether the gradient ``p`` sent was thrown away since: set to None (``netD.zero_grad()``), replaced, or
        changed in place (``netD.zero_grad(set_to_none=False)``, clipping), as its values tell. Not its version
        counter: a GradScaler's ``unscale_`` and ``p.grad.data.clamp_(...)`` change it without a new version (the
        step applied deltas of the gradients as they were, silently), and gradients that autograd made as views of
        one tensor (``torch.cat`` of parameters) share one counter, so accumulating into one looked like a change
        to the others (every step sent twice)."""
        grad, version, copy_ = self._aiacc_sent[p]
        if p.grad is not grad:
            return True
        if copy_ is None:  # (sparse: no copy; its version counter)
            return grad is not None and grad._version != version
        return not torch.equal(grad, copy_)

    def _aiacc_on_grad(self, p: torch.Tensor) -> None:
        if p in self._aiacc_handles and p.grad is not self._aiacc_sent[p][0]:
            # set to None or replaced after it was sent (changed in place: seen before accumulation, before_grad)
            self._aiacc_discard()
        if p in self._aiacc_handles:
            raise RuntimeError(f"the gradient of {self._parameter_names[p]!r} was computed more than "
                               f"backward_passes_per_step={self.backward_passes_per_step} times before step(); "
                               "raise backward_passes_per_step to accumulate gradients locally")
        self._aiacc_delay[p] -= 1
        if self._aiacc_delay[p] == 0:
            self._aiacc_handles[p] = self._aiacc_send_delta(p)

    def _aiacc_send_delta(self, p: torch.Tensor):
        """Step ``p`` alone with this rank's gradient, reduce the change in its delta buffer and put ``p`` back
        where it was (its forward until ``step()`` reads what one process reads)."""
        start, delta = self._aiacc_start[p], self._aiacc_delta[p]
        self._aiacc_save_state(p)
        grad = p.grad
        copy_ = None if grad is None or grad.is_sparse else self._aiacc_copy(p, grad)
        version = None if grad is None else grad._version
        with torch.no_grad():
            start.copy_(p)
            with only_params(self.param_groups, lambda q: q is p):
                super().step()
            torch.sub(p, start, out=delta)
            p.copy_(start)
            if copy_ is not None and grad._version != version:
                # the optimizer changed the gradient in place (SGD's nesterov with foreach): put back as backward
                # left it, which step() compares with and, were the step begun again, steps on
                grad.copy_(copy_)
        self._aiacc_sent[p] = (grad, None if grad is None else grad._version, copy_)
        return allreduce_async_(delta, name=self._parameter_names[p], op=Adasum,
                                compression=self._aiacc_compression)

    def _aiacc_copy(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """A copy of ``grad``'s values, in the buffer of ``p`` kept for it (made anew when it no longer fits)."""
        buf = self._aiacc_copies.get(p)
        if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype or buf.device != grad.device:
            buf = self._aiacc_copies[p] = torch.empty_like(grad, memory_format=torch.preserve_format)
        with torch.no_grad():
            buf.copy_(grad)
        return buf

    def _aiacc_save_state(self, p: torch.Tensor) -> None:
        state = self.state.get(p)
        if not state:
            self._aiacc_saved[p] = None
            return
        old = self._aiacc_saved.get(p) or {}
        saved = {}
        for key, value in state.items():
            if torch.is_tensor(value):
                buf = old.get(key)
                if buf is None or buf.shape != value.shape or buf.dtype != value.dtype or buf.device != value.device:
                    buf = value.detach().clone()
                else:
                    buf.copy_(value)
                saved[key] = buf
            else:
                saved[key] = copy.deepcopy(value)
        self._aiacc_saved[p] = saved

    def _aiacc_restore_state(self, p: torch.Tensor) -> None:
        saved = self._aiacc_saved.pop(p, None)
        if saved is None:
            self.state.pop(p, None)
            return
        state = self.state[p]
        for key in [k for k in state if k not in saved]:
            del state[key]
        with torch.no_grad():
            for key, value in saved.items():
                now = state.get(key)
                if torch.is_tensor(value) and torch.is_tensor(now) and now.shape == value.shape \
                        and now.dtype == value.dtype and now.device == value.device:
                    now.copy_(value)
                else:
                    state[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)

    def _aiacc_discard(self) -> None:
        """Gradients sent in this step were thrown away before ``step()`` (see the module's doc): wait for every
        delta in flight (every rank sent them), drop them, undo the local steps (each parameter is where the step
        began already) and begin the step again, each ``.grad`` as it is now."""
        def dropped(p, _combined: bool) -> None:
            self._aiacc_restore_state(p)
            self._aiacc_delay[p] = self.backward_passes_per_step

        self._aiacc_discards += 1
        self._aiacc_wait_all(dropped)

    def _aiacc_wait_all(self, then) -> None:
        """Wait for every delta in flight (none is left in flight after), ``then(p, combined)`` for each in turn
        (``combined`` False where its wait raised); the first error is raised once all were waited for."""
        handles, self._aiacc_handles = self._aiacc_handles, {}
        self._aiacc_sent = {}
        error = None
        for p, handle in handles.items():
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001 - every handle is waited for, then the first error raised
                error = error or exc
                then(p, False)
                continue
            then(p, True)
        if error is not None:
            raise error

    def step(self, closure=None):
        """Wait for every parameter's combined delta and apply it (a parameter without a gradient this
        step sends a zero delta first, as every rank must reduce the same tensors)."""
        count_step(self)  # (the second step compares the parameters across the ranks, once: see same_start.py)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(self._aiacc_thrown(p) for p in self._aiacc_handles):
            # a gradient sent was set to None (model.zero_grad()), replaced or changed in place (zeroed, clipped)
            # since: as in one process, the step takes the gradients as they are now (each rank throws the same
            # away, as each runs the same loop)
            self._aiacc_discard()
        self._aiacc_take_new()
        for p in self._aiacc_params:
            if p not in self._aiacc_handles:
                self._aiacc_handles[p] = self._aiacc_send_delta(p)

        def apply(p, combined: bool) -> None:
            if combined:  # (a delta whose wait raised is not applied, and the parameter keeps its count)
                with torch.no_grad():
                    p.add_(self._aiacc_delta[p])  # (p is where the step began)
                self._aiacc_delay[p] = self.backward_passes_per_step

        self._aiacc_wait_all(apply)
        return loss

    def synchronize(self) -> None:
        """Nothing to do: ``step()`` waits for the deltas (Horovod's Adasum optimizer does the same)."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise AssertionError("skip_synchronize is not supported with DistributedOptimizer(op=Adasum) (as in Horovod)")
        yield  # pragma: no cover

    def zero_grad(self, set_to_none: bool = True):
        if self._aiacc_handles:  # between backward() and step(): those gradients are thrown away
            self._aiacc_discard()
        return super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = int(passes)
        for p in self._aiacc_delay:
            self._aiacc_delay[p] = self.backward_passes_per_step


not_traced(AdasumOptimizer)  # (as DistributedOptimizer: see untraced.py)


def adasum_optimizer(optimizer, names: Dict[torch.Tensor, str], order: List[torch.Tensor], compression,
                     backward_passes_per_step: int, gradient_predivide_factor, sparse_as_dense, process_set):
    """``DistributedOptimizer(op=Adasum)`` of ``optimizer`` (its parameters' ``names``, in model ``order``); an
    error naming what Adasum does not take; ``optimizer`` itself when aiacc is switched off."""
    if float(gradient_predivide_factor) != 1.0:
        raise ValueError("DistributedOptimizer: gradient_predivide_factor applies to op=Average only (got op=Adasum)")
    if process_set is not None and process_set is not aiacc.global_process_set:
        raise NotImplementedError("DistributedOptimizer(op=Adasum) runs on every rank of the job; process_set is "
                                  "not supported with it")
    if sparse_as_dense:
        raise NotImplementedError("DistributedOptimizer(op=Adasum): Adasum combines dense deltas; sparse_as_dense "
                                  "does not apply")
    engine, _ = aiacc.gradient_engine(None, "DistributedOptimizer")
    if engine is None:
        return optimizer
    wrapped = sharing_state(optimizer, AdasumOptimizer)
    wrapped._aiacc_adasum_setup(names, order, compression, backward_passes_per_step)
    guard_wrapped(optimizer, wrapped)
    return wrapped
