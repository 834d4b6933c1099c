"""``DistributedTrainer``: a ``gluon.Trainer`` whose gradients go through aiacc's engine.

Overlap with backpropagation. MXNet computes asynchronously: ``loss.backward()``
returns after *queueing* the backward pass, and MXNet's worker threads are
still producing gradients, last layer first, when ``trainer.step()`` starts.
``step()`` walks the gradients in backward order (the reverse of the order the
parameters were created or given in) and, for each one, waits for that
gradient alone (``to_dlpack_for_read``, GIL released) and submits it at once.
While it waits for the next gradient, the engine is already reducing the
previous ones::

    MXNet worker   | grad L | grad L-1 | ...... | grad 1 |
    step() thread      submit L  submit L-1        submit 1  wait all | update
    aiacc engine           [reduce L][reduce L-1]       ...   [reduce 1]

Priorities: gradients of layers near the input are needed first by the next
forward pass, so they get the highest priority (they are also the last ones
MXNet finishes). The optimizer runs only after every handle has completed;
until then nothing else reads or writes a gradient (MXNet's next backward
is queued by the user only after ``step()`` returns), so the engine may
reduce in place in MXNet's own gradient memory.

With aiacc disabled (``AIACC_ENABLE`` unset or 0) the trainer is exactly a
``gluon.Trainer`` with its default kvstore: the same updates, bit for bit.
"""

from __future__ import annotations

import logging
import warnings
from typing import List

import mxnet as mx

import aiacc
from aiacc import Average, Collective, Compression
from aiacc.compression import as_compressor
from aiacc.exceptions import NotInitializedError

from .tensors import writable_view

logger = logging.getLogger(__name__)

__all__ = ["DistributedTrainer", "forward_order", "wait_all"]


def forward_order(params) -> List[mx.gluon.Parameter]:
    """The parameters in the order they were created (ParameterDict / dict) or given (list)."""
    if isinstance(params, (dict, mx.gluon.ParameterDict)):
        return list(params.values())
    if isinstance(params, (list, tuple)):
        return list(params)
    raise ValueError(f"DistributedTrainer: params must be a ParameterDict, a dict or a list of Parameters, "
                     f"got {type(params).__name__}")


def wait_all(handles) -> None:
    """Wait for every handle (none stays in flight), then raise the first error if any."""
    first = None
    for h in handles:
        try:
            h.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others finished
            if first is None:
                first = exc
    if first is not None:
        raise first


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
        from .optimizer import DistributedOptimizer  # noqa: PLC0415 - avoid an import cycle

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
        # (parameter, priority) in the order MXNet finishes the gradients; near-input = highest priority
        self._aiacc_backward = [(p, float(n - i)) for i, p in reversed(list(enumerate(forward)))]

    def _allreduce_grads(self):
        """Submit each gradient as soon as MXNet has computed it; return when all are averaged."""
        if not self._aiacc_on:
            return super()._allreduce_grads()
        handles = []
        try:
            for param, priority in self._aiacc_backward:
                if param.grad_req == "null":
                    continue
                grads = param.list_grad()
                if len(grads) != 1:
                    raise ValueError(f"parameter {param.name!r} is on {len(grads)} contexts; aiacc.mxnet trains "
                                     "with one context per process (launch one rank per device)")
                name = f"{self._aiacc_prefix}grad.{param.name}"
                # Waits for this gradient only; nothing reads it until step() has waited below.
                view = writable_view(grads[0], name, "gradient", exclusive=False)
                handles.append(aiacc.submit(
                    Collective.ALLREDUCE, view, name=name, op=self._aiacc_op, prescale=self._aiacc_prescale,
                    postscale=self._aiacc_postscale, compression=self._aiacc_compression, priority=priority,
                    outputs=[view]))
        except BaseException:
            try:
                wait_all(handles)  # never leave the engine writing into gradients behind our back
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        wait_all(handles)
