"""``DistributedTrainer``: a ``gluon.Trainer`` whose gradients go through aiacc's engine.

Overlap with backpropagation. ``loss.backward()`` only queues the backward
pass; ``step()`` (via ``allreduce_grads``) hands every gradient to
:func:`aiacc.mxnet.gradients.reduce_gradients`, which has MXNet's dependency
engine call back the moment each gradient is final and submits it there, so
the engine communicates the last layers' gradients while MXNet still computes
the first layers'. ``step()`` returns to the optimizer only once every
gradient is averaged (in place, in MXNet's own memory).

Priorities: gradients of layers near the input are needed first by the next
forward pass, so they get the highest priority (they are also the last ones
MXNet finishes). Names are the parameter names (plus ``prefix``), so they
match across ranks that build the same model.

With aiacc disabled (``AIACC_ENABLE`` unset or 0) the trainer is exactly a
``gluon.Trainer`` with its default kvstore: the same updates, bit for bit.
"""

from __future__ import annotations

import logging
import warnings
from typing import List

import mxnet as mx

import aiacc
from aiacc import Average, Compression
from aiacc.compression import as_compressor
from aiacc.exceptions import NotInitializedError

from .gradients import reduce_gradients
from .optimizer import DistributedOptimizer

logger = logging.getLogger(__name__)

__all__ = ["DistributedTrainer", "forward_order"]


def forward_order(params) -> List[mx.gluon.Parameter]:
    """The parameters in the order they were created (ParameterDict / dict) or given (list)."""
    if isinstance(params, (dict, mx.gluon.ParameterDict)):
        return list(params.values())
    if isinstance(params, (list, tuple)):
        return list(params)
    raise ValueError(f"DistributedTrainer: params must be a ParameterDict, a dict or a list of Parameters, "
                     f"got {type(params).__name__}")


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` that averages gradients across ranks with aiacc's engine (Horovod's API).

    ``compression``: ``Compression.none`` / ``.fp16`` / ``.bf16`` (casts on the wire only).
    ``gradient_predivide_factor``: gradients are divided by it before the sum and by
    ``size / factor`` after it. ``prefix``: put before every tensor name, for programs with
    more than one trainer over parameters of the same names. ``num_groups`` is accepted for
    Horovod compatibility and ignored: the engine fuses gradients by itself.

    Example::

        import aiacc.mxnet as hvd
        hvd.init()
        net = build_net(); net.initialize()
        hvd.broadcast_parameters(net.collect_params(), root_rank=0)
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])       # per-rank batch size, as with gluon.Trainer
    """

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor: float = 1.0, prefix=None, num_groups: int = 0):
        if not aiacc.is_initialized():
            raise NotInitializedError("aiacc.mxnet.DistributedTrainer was created before aiacc.mxnet.init()")
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer takes a plain optimizer, not a DistributedOptimizer; "
                          "it has been unwrapped", stacklevel=2)
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(f"DistributedTrainer: prefix must be a string, got {type(prefix).__name__}")
        factors = aiacc.average_factors(Average, gradient_predivide_factor)
        compression = as_compressor(compression)
        forward = forward_order(params)
        on = aiacc.get_engine() is not None
        # disabled: exactly gluon.Trainer, with its default kvstore ('device': several local contexts)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None if on else "device")
        self._aiacc_on = on
        self._aiacc_compression = compression
        self._aiacc_op, self._aiacc_prescale, self._aiacc_postscale = factors
        self._aiacc_prefix = prefix or ""
        n = len(forward)
        # (parameter, gradient name, priority) in the order MXNet finishes the gradients;
        # near-input = highest priority
        self._aiacc_backward = [(p, f"{self._aiacc_prefix}grad.{p.name}", float(n - i))
                                for i, p in reversed(list(enumerate(forward)))]

    def _allreduce_grads(self):
        """Average every gradient across ranks, each submitted as soon as MXNet has computed it."""
        if not self._aiacc_on:
            return super()._allreduce_grads()
        items = []
        for param, name, priority in self._aiacc_backward:
            if param.grad_req == "null":
                continue
            grads = param.list_grad()
            if len(grads) != 1:
                raise ValueError(f"parameter {param.name!r} is on {len(grads)} contexts; aiacc.mxnet trains "
                                 "with one context per process (launch one rank per device)")
            items.append((name, grads[0], priority))
        reduce_gradients(items, op=self._aiacc_op, prescale=self._aiacc_prescale, postscale=self._aiacc_postscale,
                         compression=self._aiacc_compression)
