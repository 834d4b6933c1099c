"""Keras 3 on PyTorch (``KERAS_BACKEND=torch``): a ``DistributedOptimizer``'s gradients go to the core's gradient
buckets as autograd makes them, so that communication overlaps ``backward()``.

Keras' torch trainer runs a step as ``model.zero_grad()`` (every ``.grad`` None), ``loss.backward()``,
``grads = [v.value.grad for v in model.trainable_weights]``, ``optimizer.apply(grads, variables)``. A Keras
variable's ``value`` is a ``torch.nn.Parameter`` (the same object at every read), so when the optimizer is built
(``fit`` builds it before its first step, a custom loop in its first ``apply``) each variable's parameter gets a
``register_post_accumulate_grad_hook``. Autograd calls it once the parameter's ``.grad`` is final in a backward
pass; it copies that gradient into the variable's place in its bucket (``aiacc.buckets.GradientBuckets``, the
layer ``aiacc.torch`` and ``aiacc.mxnet`` use), and a bucket goes to the engine as one request when its last
gradient is in, while autograd computes the layers below::

    backward:  [grad dense_3][grad dense_2]──►bucket 0 full: submit    [grad dense_1][grad dense]──►(last bucket: held)
    engine:                                └───── allreduce bucket 0 ─────┘
    apply():   what was handed in? ─► flags into the last bucket ─► submit it, wait for all ─► Keras' update

The first step learns the order the gradients arrive in and settles the buckets in ``apply`` (a collective that
also checks that every rank has the same variables); from the second step on the buckets go during backward.
Nothing is written into the tensors handed to ``apply``: Keras' update reads the averaged gradients from the
buckets (views, no copy), and ``v.value.grad`` keeps this rank's own gradient.

What ``apply`` reduces is decided per variable, from the tensor it was handed for it:

* the very tensor the hook copied, not changed in place since (the same object, its ``_version`` as it was):
  its bucket holds it already;
* anything else (``torch.autograd.grad``'s, a ``LossScaleOptimizer``'s unscaled copy, one made by hand, the
  hooked one changed in place -- clipped, scaled --, None) while its bucket has not gone: copied into the
  bucket now (None as zeros);
* anything else once its bucket has gone (a gradient changed in place after backward; a second backward pass
  before ``apply``, which is not the step's): the buckets cannot carry what this rank was given. It says so
  in a flag.

The flags travel at the end of the bucket that fills last (``flags_last``), which waits for ``apply``: one per
variable (this rank has a gradient for it) and one "redo". Every rank thus learns from the same reduction what
every rank decided, without a request of its own. When any rank asks for a redo, every rank drops the buckets'
results and reduces the gradients ``apply`` was given as one grouped allreduce (this wrapper's way before the
buckets); otherwise the buckets' results are the gradients. A variable no rank has a gradient for stays None
(Keras leaves it alone, as in one process); one that some ranks have counts as zeros on the others (the
average over the global batch). Each ``apply`` waits for every bucket, so no bucket's data outlives its step.
After ``REDOS_BEFORE_OFF`` redos in a row (the same ones on every rank) the hooks stop handing gradients over
(a warning says so once): a custom step that changes its gradients before ``apply`` then costs one reduction
per step, filled in ``apply``, without overlap.

Not used with ``backward_passes_per_step`` / ``gradient_accumulation_steps`` (the update reduces the sum Keras
accumulates inside ``apply``, which no hook sees) nor ``op=Adasum`` (tensor by tensor): those keep one grouped
allreduce per update. Not seen: a gradient changed after backward through ``.data`` or numpy (torch's version
counter does not count those) -- change gradients with torch ops, or before the hooks (a hook of your own).
"""

from __future__ import annotations

import warnings
import weakref

import keras
import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

import aiacc
from aiacc.buckets import GradientBuckets, ParamSpec
from aiacc.exceptions import TensorMismatchError
from aiacc.torch import mpi_ops
from aiacc.torch.arrays import from_array, to_numpy

from ._mismatch import explain_group_mismatch as _explain
from ._mismatch import label, with_paths

__all__ = ["TorchBuckets", "REDOS_BEFORE_OFF", "explain_group_mismatch"]

REDOS_BEFORE_OFF = 3  # redos in a row after which the hooks stop handing gradients over

# parameter -> (the TorchBuckets, weakly, whose hook hands its gradient over; its index there): the newest one.
# An optimizer built later over the same variables (compile with a new DistributedOptimizer) takes them over, so
# that an older one still alive sends no buckets in the newer one's backward passes (on some ranks only, maybe:
# where the garbage collector has not freed it yet; the other ranks would never meet those requests)
_owners = WeakIdKeyDictionary()


def _remove(handles) -> None:
    for h in handles:
        if h is not None:
            h.remove()


def explain_group_mismatch(reducer, grads: list, sources: list, error: TensorMismatchError) -> None:
    """A grouped allreduce of the gradients that are not None (``op=Adasum``, gradient accumulation) failed on every
    rank with ``error``: raised again naming the variables (``_mismatch.explain_group_mismatch``)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    tensors = [_tensor(grads[i]) for i in present]
    _explain(reducer, present, [(t.dtype, t.shape) for t in tensors], sources, error)


def _tensor(g):
    """``g`` (a gradient handed to ``apply``: a torch tensor, or what Keras' ops take) as a dense torch tensor."""
    if not isinstance(g, torch.Tensor):
        g = keras.ops.convert_to_tensor(g)
    return g.to_dense() if g.is_sparse else g


class TorchBuckets:
    """The gradients of one ``DistributedOptimizer``'s variables in gradient buckets (see the module's docstring).
    ``reducer``: the optimizer's ``GradientReducer`` (prefix, op, factors, compression, process set)."""

    def __init__(self, reducer, variables, engine):
        self.reducer = reducer
        self.variables = list(variables)
        self.params = [v.value for v in self.variables]
        self.index = {id(v): i for i, v in enumerate(self.variables)}
        n = len(self.variables)
        self.labels = [label(reducer.prefix, i, v) for i, v in enumerate(self.variables)]
        process_set = reducer.process_set
        self.buckets = GradientBuckets(
            engine, [ParamSpec(label, tuple(p.shape), to_numpy(p, label).dtype, "cuda" if p.is_cuda else "cpu")
                     for label, p in zip(self.labels, self.params)],
            op=reducer.op, prescale=reducer.prescale, postscale=reducer.postscale, compression=reducer.compression,
            cap=engine.config.bucket_cap, engine_of=lambda: aiacc.engine_for(process_set), flags=n + 1,
            flags_last=True)
        self.views = None  # per variable, a torch tensor over its place in its bucket (once settled)
        self.hooked = [None] * n  # per variable: (the .grad its hook copied, weakly; its _version then) this step
        self.arrival = []  # before the buckets are settled: the variables in the order their hooks ran
        self.stale = False  # a hook ran again for a gradient whose bucket had gone: this rank must redo
        self.on = True  # the hooks hand gradients over
        self.redos = 0  # redos in a row
        self.redo_count = 0  # redos so far (tests read it)
        me = weakref.ref(self)

        def hook_for(i):
            def on_grad(p):
                buckets = me()
                if buckets is not None:
                    buckets._on_grad(i, p)
            return on_grad

        self.handles = [p.register_post_accumulate_grad_hook(hook_for(i)) if p.requires_grad else None
                        for i, p in enumerate(self.params)]
        weakref.finalize(self, _remove, list(self.handles))
        for i, p in enumerate(self.params):
            old = _owners.get(p)
            other = old[0]() if old is not None else None
            if other is not None and other is not self and other.handles[old[1]] is not None:
                other.handles[old[1]].remove()  # (its apply fills that bucket place itself from now on)
                other.handles[old[1]] = None
            _owners[p] = (me, i)

    # ---- the hook: autograd calls it when a parameter's .grad is final in a backward pass ---------------
    def _on_grad(self, i: int, p) -> None:
        g = p.grad
        if not self.on or g is None:
            return
        settled = self.views is not None
        if self.hooked[i] is not None and settled and self.buckets.submitted(i):
            self.stale = True  # its bucket went with the earlier gradient
            return
        first = self.hooked[i] is None
        if settled:
            self._put(i, g)
        self.hooked[i] = (weakref.ref(g), g._version)
        if not first:  # (again before its bucket went: the newer gradient replaced the older one in it)
            return
        if settled:
            self.buckets.ready(i)
        else:
            self.arrival.append(i)

    def _put(self, i: int, g) -> None:
        with torch.no_grad():
            if g is None:
                self.views[i].zero_()
            else:
                self.views[i].copy_(_tensor(g))

    def _checked(self, i: int, g):
        """``g``, handed to ``apply`` for variable ``i``, as a dense torch tensor of its shape (else an error, raised
        before anything of the step goes to the buckets)."""
        t = _tensor(g)
        if tuple(t.shape) != tuple(self.params[i].shape):
            raise ValueError(f"DistributedOptimizer: the gradient of {self.variables[i].path!r} has shape "
                             f"{tuple(t.shape)}, the variable {tuple(self.params[i].shape)}")
        return t

    def _same(self, i: int, g) -> bool:
        """Whether ``g`` is the gradient the hook of variable ``i`` copied, unchanged since."""
        hooked = self.hooked[i]
        return hooked is not None and g is not None and hooked[0]() is g and g._version == hooked[1]

    # ---- apply ------------------------------------------------------------------------------------------
    def reduce(self, grads: list, sources: list) -> list:
        """``grads`` (of ``sources``, variables of the optimizer) reduced across ranks."""
        n = len(self.variables)
        at, given = {}, {}  # variable -> its place in the call; its gradient as a dense torch tensor (or None)
        for pos, (g, v) in enumerate(zip(grads, sources)):
            i = self.index.get(id(v))
            if i is None or i in at:
                raise ValueError(f"DistributedOptimizer: {getattr(v, 'path', v)!r} is "
                                 f"{'not a variable the optimizer was built with' if i is None else 'given twice'}")
            at[i], given[i] = pos, None if g is None else self._checked(i, g)
        flags = np.zeros(n + 1, np.float32)
        buckets = self.buckets
        settled = self.views is not None
        alive = []  # (first step) the tensors the buckets copy when they settle
        try:
            for i in range(n):
                pos = at.get(i)
                flags[i] = given.get(i) is not None
                if settled and buckets.submitted(i):  # it holds the hook's copy
                    flags[n] = flags[n] or (pos is not None and not self._same(i, grads[pos]))
                    continue
                if settled:
                    if pos is not None and not self._same(i, grads[pos]) or pos is None and not buckets.marked(i):
                        self._put(i, given.get(i))  # (a variable not in this call: zeros)
                    if not buckets.marked(i):
                        buckets.ready(i)
            if not settled:  # in the order the hooks saw them, then the last variables first (backprop's order)
                order = {i: k for k, i in enumerate(self.arrival)}
                for i in sorted(at, key=lambda i: (order.get(i, n), -i)):
                    p = self.params[i]
                    t = torch.zeros_like(p) if given[i] is None else given[i].detach().to(p.device, p.dtype)
                    alive.append(t.contiguous())
                    buckets.ready(i, to_numpy(alive[-1], self.labels[i]))
            flags[n] = flags[n] or self.stale
            buckets.set_flags(flags)
            buckets.wait()  # (submits the rest: the first time, settles the buckets, a collective)
        except TensorMismatchError as e:  # (the ranks' variables differ: named by label, and by path here)
            raise with_paths(e, self.labels, self.variables) from e
        finally:
            self.hooked = [None] * n
            self.arrival, self.stale = [], False
        if not settled:
            self.views = [from_array(buckets.view(i), p.dtype) for i, p in enumerate(self.params)]
        anyone = buckets.flags_set()
        if anyone[n]:
            return self._redo(given, at, anyone, list(grads))
        self.redos = 0
        out = list(grads)
        for i, pos in at.items():
            out[pos] = self.views[i] if anyone[i] else None
        return out

    def _redo(self, given: dict, at: dict, anyone, out: list) -> list:
        """Some rank's buckets could not carry the gradients its ``apply`` was given: every rank reduces those
        (zeros for one it has not) as one grouped allreduce, the way of this wrapper without buckets."""
        self.redos += 1
        self.redo_count += 1
        if self.redos == REDOS_BEFORE_OFF:
            self.on = False
            if getattr(self.buckets.engine, "rank", 0) == 0:
                warnings.warn(
                    f"DistributedOptimizer {self.reducer.prefix!r}: in {REDOS_BEFORE_OFF} steps in a row, apply() was "
                    "not given the gradients backward() had handed to the engine (changed in place after backward, "
                    "or a second backward pass before apply()); every rank reduced the gradients again. From now on "
                    "its gradients are reduced in apply(), without overlapping backward()", stacklevel=5)
        todo = [i for i in sorted(at) if anyone[i]]
        tensors = [torch.zeros_like(self.params[i]) if given[i] is None else given[i].detach() for i in todo]
        r = self.reducer
        with torch.no_grad():
            reduced = mpi_ops.grouped_allreduce(tensors, name=f"{r.prefix}.gradients", op=r.op,
                                                prescale_factor=r.prescale, postscale_factor=r.postscale,
                                                process_set=r.process_set, compression=r.compression) if todo else []
        for i in at:
            out[at[i]] = None
        for i, t in zip(todo, reduced):
            out[at[i]] = t
        return out


# Keras' jit_compile=True on this backend wraps its train step in torch.compile: dynamo traced the reduction into
# the engine (np.copyto on fake tensors: "'dst' must be an array", on every rank); it runs as it is, a graph break
# around it, as aiacc.torch's optimizer does (adapters/torch/untraced.py)
from aiacc.torch.untraced import not_traced  # noqa: E402

not_traced(TorchBuckets)
