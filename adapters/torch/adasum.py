"""``DistributedOptimizer(op=Adasum)``: Horovod's Adasum optimizer for PyTorch.

Adasum combines what each rank's optimizer would do, not the raw gradients. In each parameter's
gradient hook the wrapped optimizer steps that parameter alone on this rank's gradient; the change
(the delta) goes to ``allreduce_async_(op=Adasum)`` in the parameter's own memory; ``step()`` waits
for each combined delta and puts the parameter at where the step began plus that delta. The
optimizer's state (momentum, Adam's moments) stays each rank's own, built from its own gradients, as
in Horovod. Every parameter is an allreduce of its own (Adasum combines tensor by tensor, so nothing
is bucketed), and ``step()`` sends a zero delta for a parameter that got no gradient, so every rank
reduces the same tensors. Needs a power-of-2 number of ranks (``aiacc.adasum``).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List

import torch

import aiacc
from aiacc.adasum import check_ranks
from aiacc.ops import Adasum

from .mpi_ops import allreduce_async_
from .schedule import only_params, remove_hooks
from .shared_state import SharedState, sharing_state
from .untraced import not_traced

__all__ = ["AdasumOptimizer", "adasum_optimizer"]


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
        self._aiacc_delay = {p: self.backward_passes_per_step for p in self._aiacc_params}
        self._aiacc_handles: dict = {}
        owner = weakref.ref(self)  # (a replaced optimizer's hooks stop: they hold it weakly)

        def on_grad(p: torch.Tensor) -> None:
            opt = owner()
            if opt is not None:
                opt._aiacc_on_grad(p)

        hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in self._aiacc_params]
        weakref.finalize(self, remove_hooks, hooks)

    def _aiacc_on_grad(self, p: torch.Tensor) -> None:
        if p in self._aiacc_handles:
            raise RuntimeError(f"the gradient of {self._parameter_names[p]!r} was computed more than "
                               f"backward_passes_per_step={self.backward_passes_per_step} times before step(); "
                               "raise backward_passes_per_step to accumulate gradients locally")
        self._aiacc_delay[p] -= 1
        if self._aiacc_delay[p] == 0:
            self._aiacc_handles[p] = self._aiacc_send_delta(p)

    def _aiacc_send_delta(self, p: torch.Tensor):
        """Step ``p`` alone with this rank's gradient, leave the change in ``p`` and reduce it in place."""
        start = self._aiacc_start[p]
        with torch.no_grad():
            start.copy_(p)
            with only_params(self.param_groups, lambda q: q is p):
                super().step()
            p.sub_(start)
        return allreduce_async_(p.data, name=self._parameter_names[p], op=Adasum,
                                compression=self._aiacc_compression)

    def step(self, closure=None):
        """Wait for every parameter's combined delta and apply it (a parameter without a gradient this
        step sends a zero delta first, as every rank must reduce the same tensors)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p in self._aiacc_params:
            if p not in self._aiacc_handles:
                self._aiacc_handles[p] = self._aiacc_send_delta(p)
        handles, self._aiacc_handles = self._aiacc_handles, {}
        error = None
        for p, handle in handles.items():
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001 - every handle is waited for, then the first error raised
                error = error or exc
                continue
            with torch.no_grad():
                start = self._aiacc_start[p]
                start.add_(p)
                p.copy_(start)
            self._aiacc_delay[p] = self.backward_passes_per_step
        if error is not None:
            raise error
        return loss

    def synchronize(self) -> None:
        """Nothing to do: ``step()`` waits for the deltas (Horovod's Adasum optimizer does the same)."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise AssertionError("skip_synchronize is not supported with DistributedOptimizer(op=Adasum) (as in Horovod)")
        yield  # pragma: no cover

    def zero_grad(self, set_to_none: bool = True):
        if self._aiacc_handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step(): "
                                 "the deltas of this step are still being combined")
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
    return wrapped
