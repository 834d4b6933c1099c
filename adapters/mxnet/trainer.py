"""``DistributedTrainer``: a ``gluon.Trainer`` whose gradients go through aiacc's engine.

Gradients live in the core's gradient buckets (:mod:`aiacc.mxnet.gradients`):
after the first step every ``Parameter``'s gradient NDArray is a view of its
bucket, MXNet's backward writes into it, and the engine sums each bucket
in place as ONE request, so a step costs the engine one request per bucket
(``AIACC_BUCKET_CAP``; the first bucket, the last layers' gradients, holds at
most 1 MiB) and no gradient is copied.

Sum, not average, as Horovod's DistributedTrainer: the optimizer's
``rescale_grad`` takes the ``1 / size``. So ``p.grad()`` after
``allreduce_grads()`` (or ``step()``) is what one process on the whole batch
has with per-sample losses and ``step(per_rank_batch)``, and a clip between
``allreduce_grads()`` and ``update()`` (``clip_global_norm``) clips as that
process does (it saw 1/size of it: every clipped step differed).

Parameters unused on some ranks. A gradient this rank's backward did not reach
since the last step is stale to gluon, which would skip its update here while
the ranks whose data used it apply it (the ranks drift apart). It is sent as
zeros instead, and the ranks sum a flag per gradient (a slot each at the end
of a float bucket's buffer, so no request of its own; see
:mod:`aiacc.buckets`): a gradient any rank computed is marked fresh on every
rank (so every rank updates with the average, as one process on the whole
batch); one no rank computed gets its old value back and stays stale
(skipped with ``ignore_stale_grad=True``, else gluon's ``UserWarning``).

Overlap with backpropagation. ``loss.backward()`` only queues the backward
pass; ``step()`` (via ``allreduce_grads``) has MXNet's dependency engine call
back the moment the gradients of a bucket are final and submits the bucket
there, so the engine communicates the last layers' gradients while MXNet still
computes the first layers'. ``step()`` returns to the optimizer only once every
bucket is averaged.

Priorities: gradients of layers near the input are needed first by the next
forward pass, so they get the highest priority (they are also the last ones
MXNet finishes); a bucket has the highest of its gradients'. Names are the
parameter names (plus ``prefix``; a repeated name gets ``#k``), so they match across ranks that
build the same model; the first step checks that every rank has the same parameters
(an error names the parameter and the ranks).

With aiacc disabled (``AIACC_ENABLE`` unset or 0) the trainer is exactly a
``gluon.Trainer`` with its default kvstore: the same updates, bit for bit.
"""

from __future__ import annotations

import logging
import warnings
from typing import List

import mxnet as mx

import aiacc
from aiacc import Average, Compression, Sum, global_process_set
from aiacc.compression import as_compressor
from aiacc.names import gradient_name
from aiacc.same_start import check_same_start

from .gradients import ParameterGradients
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


def _unique(params) -> List[str]:
    """The parameters' names, the k-th repeat of a name (two blocks made with the same ``prefix``, which
    gluon.Trainer accepts) as ``<name>#<k>``: the same on every rank that builds the same model."""
    seen: dict = {}
    out = []
    for p in params:
        k = seen[p.name] = seen.get(p.name, -1) + 1
        out.append(f"{p.name}#{k}" if k else p.name)
    return out


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` that averages gradients across ranks with aiacc's engine (Horovod's API).

    ``compression``: ``Compression.none`` / ``.fp16`` / ``.bf16`` (casts on the wire only).
    ``gradient_predivide_factor``: gradients are divided by it before the sum (``p.grad()``
    holds the sum over ranks / factor) and the optimizer's ``rescale_grad`` by ``size / factor``.
    ``prefix``: put before every tensor name, for programs with more than one trainer over
    parameters of the same names. ``num_groups`` (a count >= 0) is accepted for Horovod
    compatibility and changes nothing: gradients travel in buckets of ``AIACC_BUCKET_CAP`` bytes.
    ``process_set``: the ranks that average the gradients (default: every rank); as in Horovod,
    a rank outside the set updates with its own gradients.

    The gradients live in the buckets from the first ``step()`` on: ``Parameter.grad()`` is an
    NDArray over bucket memory, and ``zero_grad()`` and the optimizers work on it as usual. A
    gradient MXNet replaces later (``cast``, a change of ``grad_req``) is copied into its bucket
    once and pointed back at it.

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
                 gradient_predivide_factor: float = 1.0, prefix=None, num_groups: int = 0,
                 process_set=global_process_set):
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer takes a plain optimizer, not a DistributedOptimizer; "
                          "it has been unwrapped", stacklevel=2)
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(f"DistributedTrainer: prefix must be a string, got {type(prefix).__name__}")
        aiacc.gradient_factors(Average, gradient_predivide_factor, "DistributedTrainer")  # Horovod's checks
        aiacc.check_groups(num_groups, None, "DistributedTrainer")
        compression = as_compressor(compression)
        forward = forward_order(params)
        # the core's error for a set that is not registered, in every mode
        on = not aiacc.gradient_engine(process_set, "DistributedTrainer").off
        # disabled: exactly gluon.Trainer, with its default kvstore ('device': several local contexts)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None if on else "device")
        self._aiacc_on = on
        self._aiacc_compression = compression
        # Horovod's semantics: the ranks' gradients are summed (each divided by the factor first) and the optimizer's
        # rescale_grad takes factor / size (_check_and_rescale_grad), so that what allreduce_grads() leaves in
        # p.grad() is what one process on the whole batch has: what a clip between it and update() must see
        self._aiacc_predivide = float(gradient_predivide_factor)
        self._aiacc_prefix = prefix or ""
        self._aiacc_set = process_set
        # in forward order: the core's buckets give those nearer the input the higher priority
        self._aiacc_forward = [(p, gradient_name(name, self._aiacc_prefix))
                               for p, name in zip(forward, _unique(forward))]
        self._aiacc_grads = None  # ParameterGradients, built by the first step (shapes are known then)
        self._aiacc_summed = []  # (parameter, factor / size): grad_req='add' gradients summed, until _update

    def _check_and_rescale_grad(self, scale):
        """gluon sets the optimizer's ``rescale_grad`` to ``scale`` (``1 / batch_size``) here, in ``step()`` and
        ``update()``; the reduction summed the ranks' gradients, so it also takes ``factor / size``, as
        Horovod's ``_scale`` does (the size now: it may change, e.g. after an elastic reset). A rank outside the
        process set trains on its own gradients."""
        if self._aiacc_on and not aiacc.outside_process_set(self._aiacc_set):
            scale = scale * self._aiacc_predivide / aiacc.engine_for(self._aiacc_set).size
        return super()._check_and_rescale_grad(scale)

    def _allreduce_grads(self):
        """Sum every gradient across ranks, each bucket submitted as soon as MXNet has computed it."""
        if not self._aiacc_on:
            return super()._allreduce_grads()
        if aiacc.outside_process_set(self._aiacc_set):
            return None
        active = [item for item in self._aiacc_forward if item[0].grad_req != "null"]
        params = [p for p, _ in active]
        grads = self._aiacc_grads
        if grads is None or not grads.matches(params):
            # first step, or the parameters that take gradients (or their shapes) changed: new buckets, once
            # every rank has made the same change
            self._aiacc_grads = None
            if grads is not None:
                grads.retire([name for _, name in active])
            grads = self._aiacc_grads = ParameterGradients(
                params, [name for _, name in active], op=Sum, prescale=1.0 / self._aiacc_predivide, postscale=1.0,
                compression=self._aiacc_compression, process_set=self._aiacc_set)
        # a gradient this rank's backward did not reach since the last step (a branch only some ranks' data
        # takes) is stale: gluon would skip its update here while the ranks it reached apply it. It counts as
        # zeros instead, and the ranks tell each other which gradients any of them computed (a flag each, in
        # a bucket that is sent anyway): those are fresh on every rank, the rest stale everywhere, as one
        # process sees it, and keep the gradient they had (as gluon leaves it). A grad_req='add' one keeps its
        # share of what it carries over from earlier steps (the average _update left: the ranks' shares sum to
        # the total); zeroed, the total lost (size - 1) / size of it
        fresh = [p._data[0]._fresh_grad for p in params]
        kept = {}
        for i, p in enumerate(params):
            if not fresh[i]:
                kept[i] = p._grad[0].copy()
                if p.grad_req != "add":
                    p._grad[0][:] = 0
        computed = grads.reduce(fresh)
        for i, k in kept.items():
            if computed[i]:
                params[i]._data[0]._fresh_grad = True
            else:
                k.copyto(params[i]._grad[0])
        # grad_req='add': the next backward adds to what is left in p.grad(); left as the sum, a script that does
        # not zero it between steps would have it summed again (size times). _update leaves the average instead
        self._aiacc_summed = [(p, self._aiacc_predivide / grads.engine.size)
                              for i, p in enumerate(params) if p.grad_req == "add" and (fresh[i] or computed[i])]

    def _update(self, ignore_stale_grad=False):
        self._aiacc_updates = getattr(self, "_aiacc_updates", 0) + 1
        if self._aiacc_updates == 2 and self._aiacc_on and not aiacc.outside_process_set(self._aiacc_set) \
                and aiacc.engine_for(self._aiacc_set).config.check_same_start:
            # before the second update, once: did the ranks start from the same parameters? (aiacc.same_start;
            # grad_req='null' ones, BatchNorm's running statistics, may differ)
            check_same_start(((p.name, p.data().asnumpy()) for p, _ in self._aiacc_forward if p.grad_req != "null"),
                             "DistributedTrainer", "Broadcast rank 0's parameters before training: "
                             "hvd.broadcast_parameters(net.collect_params(), root_rank=0).", self._aiacc_set, 4)
        super()._update(ignore_stale_grad)
        summed, self._aiacc_summed = self._aiacc_summed, []
        for p, scale in summed:  # queued by MXNet after the optimizer's reads
            p._grad[0].__imul__(scale)
