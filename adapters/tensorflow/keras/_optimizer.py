"""``DistributedOptimizer`` for Keras 3 optimizers, on Keras' TensorFlow, PyTorch and JAX backends.

On the TensorFlow backend each gradient goes to its gradient bucket as TensorFlow makes it
(``aiacc.tensorflow.gradients``). On the PyTorch backend (``KERAS_BACKEND=torch``) too: a hook on each variable's
torch parameter hands its gradient to its bucket as ``backward()`` makes it, buckets go to the engine while
backward goes on, and ``apply`` waits for them (``_torch_buckets``, which says when ``apply``'s gradients are
the hooked ones and how every rank falls back to one grouped allreduce of what ``apply`` was given when they
are not); with gradient accumulation or Adasum, one grouped allreduce per update. On the JAX backend
(``KERAS_BACKEND=jax``) the train step is one compiled JAX function: its gradients leave it through one host
call per step (``_jax_call.host_call``: an XLA custom call into aiacc's Python) as one flat array per dtype, are
averaged there with the numpy API, and flow back into the step (``_JaxGradientReducer``). Keras' NumPy backend
(which cannot train) is refused by name."""

from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf

import aiacc
from aiacc.compression import Compression
from aiacc.exceptions import TensorMismatchError
from aiacc.mixin import mixin_class
from aiacc.names import describe
from aiacc.ops import Average, Min

from ..gradients import GradientReducer, local_layer_variables, reduce_except_local
from ..mpi_ops import _set_kwargs
from .._same_start import keras_step
from . import _keras2
from ._jax_call import host_call, raise_failed_call
from ._mismatch import explain_group_mismatch
from ._keras2 import _tf_keras, is_keras2_optimizer
from ..mpi_ops import allreduce as _tf_allreduce

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "load_model"]


class _DistributedOptimizer:
    """Mixed into the user's optimizer class: ``apply`` (which ``apply_gradients`` and ``model.fit`` call)
    averages the gradients across ranks first, each handed to its gradient bucket as soon as TensorFlow
    made it (see ``aiacc.tensorflow.gradients``).

    With gradient accumulation (Keras' ``gradient_accumulation_steps``, which Horovod's
    ``backward_passes_per_step`` sets) the micro-batches' gradients stay on the rank: Keras adds them up in
    its accumulators, and the sum is averaged across ranks once per update step, in Keras' update branch,
    where it averages the accumulated gradients and clips them (``_clip_gradients``): communication once
    every N micro-batches, clipping and weight decay on the averaged gradients, as without accumulation.
    """

    def finalize_variable_values(self, var_list):
        """(Keras' fit calls it when it ends.) On JAX, also raises what failed a reduction in the compiled step
        (``_jax_call.raise_failed_call``: fit returned as if it had trained)."""
        super().finalize_variable_values(var_list)
        if isinstance(getattr(self, "_aiacc_reducer", None), _JaxGradientReducer):
            raise_failed_call(var_list)

    def build(self, variables):
        overwritten = [v for v in variables if getattr(v, "overwrite_with_gradient", False)]
        if overwritten and getattr(self, "_aiacc_reducer", None) is not None:
            # Keras assigns their "gradient" (a new amax history, a scale) to them: the ranks' maximum is meant,
            # an average would differ from one process and, under accumulation, the ranks would drift apart
            raise NotImplementedError(
                f"DistributedOptimizer: {_describe(overwritten)} take their gradient as their new value "
                "(overwrite_with_gradient: float8 training, model.quantize('float8')), which aiacc does not "
                "combine across ranks; train without float8 quantization")
        out = super().build(variables)
        reducer = getattr(self, "_aiacc_reducer", None)
        if isinstance(reducer, _TorchGradientReducer) and not self.gradient_accumulation_steps:
            reducer.watch(variables, getattr(self, "_aiacc_local", None))  # (accumulating: the sum, in apply)
        return out

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            variables = list(trainable_variables)
        elif self.built:
            variables = list(self._trainable_variables)
        else:  # the base class raises its own error for this call
            return super().apply(grads, trainable_variables)
        if len(variables) != len(grads):
            # un-averaged gradients would let the ranks drift apart without a word
            which = (f"no gradient for {_describe(variables[len(grads):])}" if len(grads) < len(variables)
                     else f"the variables are {_describe(variables)}")
            raise ValueError(f"DistributedOptimizer: {len(grads)} gradients for {len(variables)} variables ({which}); "
                             "give one gradient (or None) per variable, in the order of the variables")
        if self.gradient_accumulation_steps or getattr(self, "_aiacc_reduced_already", False):
            # (averaged in _clip_gradients / by _lso_apply; at the second call, the ranks' variables compared once)
            return super().apply(keras_step(self, grads, variables, self._iterations), trainable_variables)
        if grads and not self.built and isinstance(self._aiacc_reducer, _TorchGradientReducer):
            with keras.name_scope(self.name, caller=self):  # (as Keras' apply would: its first step in buckets too)
                self.build(variables)
            self.built = True
        grads = keras_step(self, self._aiacc_reduce(grads, variables), variables, self._iterations)  # (_same_start)
        return super().apply(grads, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        if isinstance(self, keras.optimizers.LossScaleOptimizer) and self.built:
            # DistributedOptimizer(LossScaleOptimizer(...)) on JAX: Keras' JAX trainer calls stateless_apply, which a
            # loss-scale optimizer does not route through apply: averaged here, before its finite check (so every
            # rank takes the same branch)
            grads = self._aiacc_reduce(list(grads), list(self._trainable_variables))
        return super().stateless_apply(optimizer_variables, grads, trainable_variables)

    def _backend_apply_gradients(self, grads, trainable_variables):
        if not self.gradient_accumulation_steps:
            return super()._backend_apply_gradients(grads, trainable_variables)
        # Keras builds its update branch in this call (traced once in a graph, run at once eagerly on an
        # update step) and calls _clip_gradients there with the accumulated gradients of these variables
        _untracked(self, "_aiacc_update_vars", list(trainable_variables))
        self._aiacc_reduced = False
        try:
            out = super()._backend_apply_gradients(grads, trainable_variables)
        finally:
            _untracked(self, "_aiacc_update_vars", None)
        if not self._aiacc_reduced and (keras.backend.backend() == "jax" or not tf.executing_eagerly()
                                        or bool(self._aiacc_update_step_now)):  # (JAX: always traced, both branches)
            # (never silently: the ranks would each apply their own gradients and drift apart)
            raise RuntimeError("DistributedOptimizer: this Keras version's gradient accumulation did not pass "
                               "the accumulated gradients through _clip_gradients, where aiacc averages them "
                               "across ranks; use gradient_accumulation_steps=None")
        return out

    def _clip_gradients(self, grads):
        variables = getattr(self, "_aiacc_update_vars", None)
        if variables is not None:  # Keras' update step of accumulated gradients (its mean over the steps)
            grads = list(grads)
            if getattr(self, "_aiacc_sum_passes", False):  # Horovod's backward_passes_per_step: the micro-batches' sum
                n = float(self.gradient_accumulation_steps)
                grads = [None if g is None else g * n for g in grads]  # (n: a Python float, any backend)
            reducer = getattr(self, "_aiacc_reducer", None)
            if isinstance(reducer, _JaxGradientReducer):
                # JAX's accumulation runs this branch on every micro-batch and keeps its result on update steps
                # only (jax.lax.cond for the variables): communicate on those alone
                grads = reducer.on_update_step(self._aiacc_update_step_now,
                                               lambda gs: self._aiacc_reduce(gs, variables), grads)
            elif reducer is not None:
                grads = self._aiacc_reduce(grads, variables)
            self._aiacc_reduced = True
        return super()._clip_gradients(grads)

    def _aiacc_reduce(self, grads, variables) -> list:
        """``grads`` averaged across ranks, except those of local variables (``register_local_var``)."""
        return reduce_except_local(self._aiacc_reducer, grads, variables, getattr(self, "_aiacc_local", None),
                                   getattr(self, "_aiacc_scale_local", True))

    @property
    def _aiacc_update_step_now(self):
        """Eagerly: whether this apply is an update step of Keras' accumulation (as Keras decides it)."""
        return (self._iterations + 1) % self.gradient_accumulation_steps == 0

    def register_local_var(self, var) -> None:
        """Keep the gradient of ``var`` on this rank (Horovod's name): it is not sent, and is divided by the
        number of ranks unless the optimizer was made with ``scale_local_gradients=False``."""
        if getattr(self, "_aiacc_local", None) is None:
            _untracked(self, "_aiacc_local", {})
        self._aiacc_local[id(var)] = var  # held, so that its id is not reused


def _untracked(optimizer, name: str, value) -> None:
    """Set an attribute without Keras' tracking: a list or dict of the model's variables set on an optimizer
    the usual way joins ``optimizer.variables`` (saved with its state; on JAX the trainer's snapshot of those
    variables no longer matches them, and a LossScaleOptimizer's skip branch fails to trace)."""
    object.__setattr__(optimizer, name, value)


BACKENDS = ("tensorflow", "torch", "jax")  # the Keras backends aiacc.keras reduces on


def check_backend(who: str) -> str:
    """Keras' backend, if aiacc.keras works on it; otherwise NotImplementedError naming it."""
    backend = keras.backend.backend()
    if backend not in BACKENDS:
        raise NotImplementedError(f"{who}: Keras runs on the {backend!r} backend (KERAS_BACKEND); aiacc.keras works "
                                  "on 'tensorflow', 'torch' and 'jax'")
    return backend


class _GroupReducer:
    """A backend's reduction of a step's gradients (``None`` stays ``None``) as one group under the optimizer's
    name, with the wrapper's op, factors, compression and process set (a rank outside the set keeps its own
    gradients, as on TensorFlow). ``_reduce(present gradients)`` is the backend's."""

    def __init__(self, reducer: GradientReducer):
        self.process_set = reducer.process_set  # (reduce_except_local reads it)
        self.prefix = reducer.prefix
        self.reducer = reducer

    def __call__(self, grads, sources) -> list:
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present or aiacc.outside_process_set(self.process_set):
            return grads
        for i, g in zip(present, self._reduce([grads[i] for i in present], present, list(sources))):
            grads[i] = g
        return grads


class _TorchGradientReducer(_GroupReducer):
    """The PyTorch backend's reduction: through the gradient buckets the backward pass fills (``_torch_buckets``)
    once the optimizer is built with them; otherwise the step's torch tensors reduced in place as one group
    (``aiacc.torch``)."""

    buckets = None  # the optimizer's _torch_buckets.TorchBuckets

    def watch(self, variables, local) -> None:
        """The optimizer is built on ``variables``: their gradients go to buckets from now on (but for the local
        ones, for Adasum, which combines each tensor on its own, and on a rank outside the process set)."""
        variables = [v for v in variables if id(v) not in (local or {})]
        if self.reducer.adasum or aiacc.outside_process_set(self.process_set) or not variables:
            return
        from ._torch_buckets import TorchBuckets  # noqa: PLC0415 - torch only where Keras runs on it

        self.buckets = TorchBuckets(self.reducer, variables, aiacc.engine_for(self.process_set))

    def __call__(self, grads, sources) -> list:
        if self.buckets is not None:
            return self.buckets.reduce(list(grads), list(sources))
        try:
            return super().__call__(grads, sources)
        except TensorMismatchError as e:  # (it named a gradient by its place in the group: named by variable now)
            from ._torch_buckets import explain_group_mismatch  # noqa: PLC0415

            explain_group_mismatch(self.reducer, list(grads), list(sources), e)
            raise

    def _reduce(self, grads: list, present: list, sources: list) -> list:
        from aiacc.torch import mpi_ops  # noqa: PLC0415 - torch only where Keras runs on it

        r = self.reducer
        return mpi_ops.grouped_allreduce_(grads, name=f"{r.prefix}.gradients", op=r.op, prescale_factor=r.prescale,
                                          postscale_factor=r.postscale, process_set=r.process_set,
                                          compression=r.compression)


class _JaxGradientReducer(_GroupReducer):
    """The JAX backend's reduction. Keras' train step is one jitted JAX function, which cannot call the engine: the
    step's gradients (``None`` stays ``None``) leave it through one host call (``_jax_call.host_call``, whose
    results the update reads: never dropped, never run twice) as one flat array per dtype (``_Flat``: XLA packs
    them), are reduced there with the wrapper's op, factors, compression and process set (the numpy API; gradients
    on an accelerator come to host memory for it), and return into the step, where XLA unpacks them. The first
    reduction of a set of gradients goes tensor by tensor (one grouped allreduce under the optimizer's name), which
    checks that every rank has the same gradients and names any that differ; from then on, the flat arrays (as one
    group; Adasum always tensor by tensor, as it combines each tensor on its own). Eagerly (``run_eagerly=True``)
    the same call runs at once. Each rank runs its steps' calls in step order (every step's variables wait for the
    previous step's reduction), so the ranks' collectives match."""

    def __init__(self, reducer: GradientReducer):
        super().__init__(reducer)
        self._checked = set()  # the gradients' layouts reduced tensor by tensor once (``_Flat.key``)

    def _reduce(self, grads: list, present: list, sources: list) -> list:
        import jax  # noqa: PLC0415 - JAX only where Keras runs on it
        import jax.numpy as jnp  # noqa: PLC0415

        flat = _Flat(grads)
        r = self.reducer
        name = f"{r.prefix}.gradients"
        options = dict(op=r.op, prescale_factor=r.prescale, postscale_factor=r.postscale, compression=r.compression,
                       process_set=r.process_set)
        checked = self._checked

        def reduce_on_host(*flats):
            flats = [np.asarray(f) for f in flats]
            if r.adasum or flat.key not in checked:
                # tensor by tensor: Adasum combines each on its own; and the first time, so that gradients that
                # differ across ranks are named with their shapes and variables (then, the ranks' sets agree)
                arrays = flat.unpack(flats, np)
                try:
                    out = aiacc.grouped_allreduce(arrays, name=name, **options)
                except TensorMismatchError as e:
                    explain_group_mismatch(r, present, [(a.dtype, a.shape) for a in arrays], sources, e)
                    raise
                checked.add(flat.key)
                return flat.pack(out, np)
            return aiacc.grouped_allreduce(flats, name=f"{name}.flat", **options)

        return flat.unpack(host_call(reduce_on_host, flat.structs(jax), *flat.pack(grads, jnp)), jnp)

    @staticmethod
    def on_update_step(update_step, reduce, grads) -> list:
        """``reduce(grads)`` where ``update_step`` (a traced boolean) holds, else ``grads`` as they are."""
        import jax  # noqa: PLC0415

        return jax.lax.cond(update_step, reduce, list, list(grads))


class _Flat:
    """Arrays (JAX's or numpy's) as one flat array per dtype, and back: one array crosses to the host per dtype, and
    aiacc's engine reduces one tensor, not one per gradient (its per-tensor Python); XLA packs and unpacks in a pass
    over the bytes. (Through ``io_callback``, the fallback of ``_jax_call``, each array that crosses also costs JAX
    ~90 us: 19 ms for a model's 211 gradients, 2 MB, jax 0.7 on CPU; through the custom call, a pointer.)"""

    def __init__(self, arrays):
        self.shapes = [tuple(a.shape) for a in arrays]
        self.sizes = [int(np.prod(shape)) for shape in self.shapes]
        self.kinds: dict = {}  # dtype -> the indices of its arrays
        for i, a in enumerate(arrays):
            self.kinds.setdefault(np.dtype(a.dtype), []).append(i)
        self.key = (tuple(self.shapes), tuple((str(d), tuple(ix)) for d, ix in self.kinds.items()))

    def structs(self, jax) -> list:
        return [jax.ShapeDtypeStruct((sum(self.sizes[i] for i in ix),), d) for d, ix in self.kinds.items()]

    def pack(self, arrays, xp) -> list:
        return [xp.concatenate([xp.ravel(arrays[i]) for i in ix]) for ix in self.kinds.values()]

    def unpack(self, flats, xp) -> list:
        out = [None] * len(self.shapes)
        for f, ix in zip(flats, self.kinds.values()):
            at = 0
            for i in ix:
                out[i] = xp.reshape(f[at:at + self.sizes[i]], self.shapes[i])
                at += self.sizes[i]
        return out


def _finite_on_every_rank(reducer, finite):
    """``finite`` (a boolean scalar of the backend: this rank's gradients are all finite) made the same on
    every rank of the reducer's process set: true where it is true on all of them (one small allreduce)."""
    if aiacc.outside_process_set(reducer.process_set):
        return finite
    name = f"{reducer.prefix}.finite"
    if isinstance(reducer, _TorchGradientReducer):
        from aiacc.torch import mpi_ops  # noqa: PLC0415

        return mpi_ops.allreduce(finite.int(), op=Min, name=name, process_set=reducer.process_set).bool()
    if isinstance(reducer, _JaxGradientReducer):
        import jax  # noqa: PLC0415

        def on_host(flag):
            return aiacc.allreduce(np.asarray(flag, np.int32), op=Min, name=name, process_set=reducer.process_set)

        return host_call(on_host, jax.ShapeDtypeStruct((), np.int32), finite) != 0
    return tf.cast(_tf_allreduce(tf.cast(finite, tf.int32), op=Min, name=name, **_set_kwargs(reducer.process_set)),
                   tf.bool)


def _inner_reducer(loss_scale_optimizer):
    """(its inner optimizer, that optimizer's reducer): the reducer None where the inner optimizer is no
    ``DistributedOptimizer`` (or one switched off, which only accumulates)."""
    inner = getattr(loss_scale_optimizer, "inner_optimizer", None)
    return inner, getattr(inner, "_aiacc_reducer", None) if isinstance(inner, _DistributedOptimizer) else None


_keras_check_finite = keras.optimizers.LossScaleOptimizer.check_finite


def _check_finite(self, grads):
    """``LossScaleOptimizer.check_finite`` (the one Keras method aiacc.keras replaces), for a loss-scale optimizer
    around a ``DistributedOptimizer``: what Keras' ``compile`` makes by itself under the ``mixed_float16`` policy.
    Keras checks the rank's own gradients and applies them (reduced across ranks inside that branch) only when they
    are finite; an overflow on some ranks only would have those skip the step and its reduction while the others
    wait in it. Here every rank takes the same branch: the step is skipped, and the loss scale lowered, on every
    rank when any rank's gradients overflow (as ``torch.amp.GradScaler`` after ``synchronize``). Any other
    loss-scale optimizer checks as Keras does."""
    finite = _keras_check_finite(self, grads)
    inner, reducer = _inner_reducer(self)
    if reducer is None or getattr(inner, "_aiacc_reduced_already", False):  # (reduced: the same on every rank)
        return finite
    return _finite_on_every_rank(reducer, finite)


_keras_lso_apply = keras.optimizers.LossScaleOptimizer.apply


def _lso_apply(self, grads, trainable_variables=None):
    """``LossScaleOptimizer.apply`` around a ``DistributedOptimizer`` whose gradients the backward pass hands to
    its buckets (PyTorch backend): Keras unscales the gradients into new tensors before the inner ``apply``, which
    could then not use the buckets; so they are averaged first, here, and then checked (an overflow on any rank
    shows in the average on every rank: every rank skips the step) and unscaled (by a power of 2, exact)."""
    inner, reducer = _inner_reducer(self)
    if not self.built or getattr(reducer, "buckets", None) is None:
        return _keras_lso_apply(self, grads, trainable_variables)
    variables = list(self._trainable_variables if trainable_variables is None else trainable_variables)
    grads = list(grads)
    if len(grads) != len(variables):  # (the inner apply's error)
        return _keras_lso_apply(self, grads, trainable_variables)
    grads = inner._aiacc_reduce(grads, variables)
    _untracked(inner, "_aiacc_reduced_already", True)
    try:
        return _keras_lso_apply(self, grads, trainable_variables)
    finally:
        _untracked(inner, "_aiacc_reduced_already", False)


keras.optimizers.LossScaleOptimizer.check_finite = _check_finite
keras.optimizers.LossScaleOptimizer.apply = _lso_apply


def _describe(variables) -> str:
    return describe([getattr(v, "path", None) or getattr(v, "name", None) or "(unnamed)" for v in variables])




def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=None, scale_local_gradients=True):
    """Wrap a Keras 3 optimizer so that its updates use gradients averaged across ranks (Horovod's API).

    ::

        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
        model.compile(optimizer=opt, loss=..., metrics=[...])   # jit_compile=False where XLA is the default
        model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

    Returns a new optimizer of a subclass of ``type(optimizer)`` built from ``optimizer.get_config()``
    (wrap before the optimizer has variables, i.e. before ``compile``/``fit``). With aiacc disabled
    (``AIACC_ENABLE`` unset/0) it returns ``optimizer`` itself.

    ``name``: the optimizer's new name and the prefix of the engine's tensor names (give each
    DistributedOptimizer its own when a model trains with several). ``compression``, ``sparse_as_dense``,
    ``op`` and ``gradient_predivide_factor`` as in ``DistributedGradientTape``.

    ``backward_passes_per_step=N`` (Horovod's gradient accumulation): ``apply`` is called once per
    micro-batch; the gradients of N calls are added up on the rank (Keras' ``gradient_accumulation_steps``
    accumulators, set to N), and every N-th call averages their sum across ranks and updates the variables
    (the other calls only count). ``optimizer.iterations`` then reads update steps, as under Keras' own
    accumulation (its property: micro-batches // N, which Adam's bias correction uses); Horovod's Keras 2
    wrapper counted every call. ``average_aggregated_gradients=True``:
    their mean instead of their sum. An optimizer given with Keras' own ``gradient_accumulation_steps``
    keeps Keras' rule (the mean of the micro-batches) and is averaged across ranks once per update too.
    Switched off, ``backward_passes_per_step`` > 1 still accumulates: you get this wrapper then, reducing
    nothing, instead of your optimizer. Under the ``mixed_float16`` policy (compile wraps this optimizer in a
    ``LossScaleOptimizer``) a micro-batch whose gradients overflow on any rank is skipped on every rank; a
    ``LossScaleOptimizer`` given here with ``backward_passes_per_step`` > 1 is refused (Keras accumulates in
    its inner optimizer: wrap that one). ``device_dense``, ``device_sparse``,
    ``process_set``: average over its ranks only (a rank outside it keeps its own gradients, as in
    Horovod). ``num_groups`` and ``groups`` are checked as Horovod checks them and change nothing (gradients travel in the core's
    gradient buckets, ``AIACC_BUCKET_CAP``, as with ``DistributedGradientTape``). ``apply`` with a number
    of gradients other than the number of variables raises ValueError naming them.
    ``register_local_var(v)`` keeps ``v``'s gradient on its rank, divided by the number of ranks unless
    ``scale_local_gradients=False``.
    """
    if isinstance(optimizer, str):  # (Keras 2's under TF_USE_LEGACY_KERAS=1: a Keras 3 one failed in tf_keras' compile)
        legacy = _tf_keras() if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes") else None
        optimizer = (legacy or keras).optimizers.get(optimizer)
    keras2 = is_keras2_optimizer(optimizer)
    if not keras2 and not isinstance(optimizer, keras.optimizers.Optimizer):
        got = (f"the class {optimizer.__name__}: pass an instance, {optimizer.__name__}(...)"
               if isinstance(optimizer, type) else type(optimizer).__name__)
        raise TypeError(f"DistributedOptimizer needs a Keras optimizer (keras.optimizers.Optimizer, or Keras 2's "
                        f"tf.keras.optimizers with TF_USE_LEGACY_KERAS=1), got {got}")
    aiacc.check_groups(num_groups, groups, "DistributedOptimizer")
    passes = int(backward_passes_per_step)
    if passes != backward_passes_per_step or passes < 1:
        raise ValueError(f"DistributedOptimizer: backward_passes_per_step={backward_passes_per_step!r} must be a "
                         "whole number >= 1")
    if keras2:
        return _keras2.DistributedOptimizer(optimizer, name, compression, sparse_as_dense, gradient_predivide_factor,
                                            op, passes, average_aggregated_gradients, process_set,
                                            scale_local_gradients)
    if passes > 1 and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # (Keras' own accumulation lives in the inner optimizer; a loss-scale optimizer refuses it)
        raise ValueError(f"DistributedOptimizer: backward_passes_per_step={passes} cannot accumulate in a "
                         "LossScaleOptimizer; wrap its inner optimizer instead: LossScaleOptimizer("
                         f"DistributedOptimizer(opt, backward_passes_per_step={passes})), which is what compile "
                         "makes of DistributedOptimizer(opt, ...) under the mixed_float16 policy")
    config = optimizer.get_config()
    accumulated = config.get("gradient_accumulation_steps")
    if passes > 1 and accumulated and (accumulated != passes or not average_aggregated_gradients):
        # (equal counts, different rules: Horovod's sum and Keras' mean; neither may win silently)
        raise ValueError(f"DistributedOptimizer: backward_passes_per_step={passes} (Horovod's rule: the "
                         "micro-batches' sum, their mean with average_aggregated_gradients=True) and the optimizer's "
                         f"gradient_accumulation_steps={accumulated} (Keras' rule: their mean) disagree; give one "
                         "of them")
    reducer = GradientReducer(name or "DistributedOptimizer", compression, sparse_as_dense, op,
                              gradient_predivide_factor, process_set, "DistributedOptimizer")
    if reducer.adasum and average_aggregated_gradients and passes > 1:
        raise ValueError("DistributedOptimizer: op=Adasum does not take average_aggregated_gradients=True "
                         "(as in Horovod)")
    if getattr(optimizer, "built", False):  # (also when switched off: the error a launched job would meet)
        raise ValueError("DistributedOptimizer: wrap the optimizer before it is built (before compile/fit), "
                         "its state cannot be carried over")
    off = aiacc.switched_off("DistributedOptimizer")
    if off and passes == 1:
        return optimizer
    backend = keras.backend.backend() if off else check_backend("DistributedOptimizer")
    cls = _registered_like(mixin_class(_DistributedOptimizer, type(optimizer)), type(optimizer))
    if name is not None:
        config["name"] = name
    if passes > 1:
        config["gradient_accumulation_steps"] = passes
    wrapped = _keras2.carry_exclusions(optimizer, cls.from_config(config))
    if backend == "torch":
        reducer = _TorchGradientReducer(reducer)
    elif backend == "jax":
        reducer = _JaxGradientReducer(reducer)
    wrapped._aiacc_reducer = None if off else reducer  # (switched off: accumulation only)
    wrapped._aiacc_sum_passes = passes > 1 and not average_aggregated_gradients
    wrapped._aiacc_scale_local = bool(scale_local_gradients)
    return wrapped


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                                sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False, groups=None,
                                process_set=None, local_layers=None, scale_local_gradients=True):
    """:func:`DistributedOptimizer` that keeps the gradients of ``local_layers`` (a Keras layer or a list of
    them) on each rank (Horovod's API, for model-parallel layers): their trainable variables' gradients are
    not sent, and are divided by the number of ranks unless ``scale_local_gradients=False``."""
    local = local_layer_variables(local_layers, "PartialDistributedOptimizer")
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, backward_passes_per_step,
                                   average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    if wrapped is not optimizer:
        for variable in local:
            wrapped.register_local_var(variable)
    return wrapped


def _loader(cls, compression, passes=1, average=False):
    """A stand-in for optimizer class ``cls`` while a model loads: its ``from_config`` builds the optimizer
    wrapped in ``DistributedOptimizer`` (before Keras builds it and loads its saved variables)."""

    def from_config(_klass, config, custom_objects=None):
        if passes > 1:  # the file's accumulation steps are the wrapper's own: it sets them again
            config = {**config, "gradient_accumulation_steps": None}
        optimizer = cls.from_config(config)
        if isinstance(getattr(optimizer, "inner_optimizer", None), _DistributedOptimizer):
            # a LossScaleOptimizer whose inner optimizer came back wrapped (its own stand-in): what compile makes
            # under mixed_float16; wrapped again, every step was reduced twice, and refused with passes > 1
            return optimizer
        return DistributedOptimizer(optimizer, compression=compression, backward_passes_per_step=passes,
                                    average_aggregated_gradients=average)

    return type(cls.__name__, (cls,), {"from_config": classmethod(from_config), "__module__": cls.__module__,
                                       "_aiacc_stand_in": True})


def _registered_like(cls, base):
    """``cls`` saved under ``base``'s Keras name: a class registered with ``register_keras_serializable`` is saved
    as ``package>Name``, and the wrapper (not registered) was saved as ``Name``, which ``keras.models.load_model``
    could not find. Only the class-to-name entry: loading still finds the user's class by that name."""
    from keras.src.saving import object_registration  # noqa: PLC0415 - Keras' registry of names

    registered = keras.saving.get_registered_name(base)
    if registered != base.__name__:
        object_registration.GLOBAL_CUSTOM_NAMES[cls] = registered
    return cls


def _names_of(cls) -> list:
    """The names a saved model may give optimizer class ``cls`` by among custom objects: its own, and the
    registered ``package>Name`` of a class registered with ``register_keras_serializable`` (Keras' built-ins are
    not looked up there: ``_keras2.resolving_as``)."""
    return list(dict.fromkeys([cls.__name__, keras.saving.get_registered_name(cls)]))


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False, backward_passes_per_step=1, average_aggregated_gradients=False):
    """Horovod's ``hvd.load_model``: ``keras.models.load_model(filepath)`` whose optimizer comes back wrapped
    in :func:`DistributedOptimizer` (its saved state loaded into the wrapped one), so that training goes on
    distributed. ``custom_optimizers``: optimizer classes of your own the file may hold; ``custom_objects``
    as for Keras (they win over the wrappers here). ``backward_passes_per_step`` and
    ``average_aggregated_gradients`` (aiacc's, not Horovod's): the wrapper's, which the file does not record
    (it holds Keras' accumulation steps only, whose rule is the mean). When ``tf.keras`` is Keras 2
    (``TF_USE_LEGACY_KERAS=1``) it loads with ``tf.keras.models.load_model`` (``.keras`` and ``.h5`` files) and
    ``legacy_opts`` (Horovod's: the file holds ``tf.keras.optimizers.legacy`` optimizers) is taken and not needed:
    the file records which optimizer class it holds. Keras 3 has no legacy optimizers (True is refused).
    Switched off: Keras' own ``load_model``."""
    if _keras2.tf_keras_is_keras2():
        if aiacc.switched_off("load_model"):
            return tf.keras.models.load_model(filepath, custom_objects=custom_objects)

        def wrap(optimizer):
            return DistributedOptimizer(optimizer, compression=compression,
                                        backward_passes_per_step=backward_passes_per_step,
                                        average_aggregated_gradients=average_aggregated_gradients)

        return _keras2.load_model(filepath, custom_optimizers, custom_objects, wrap)
    if legacy_opts:
        raise ValueError("load_model: legacy_opts=True loads Keras 2's keras.optimizers.legacy optimizers, which "
                         "Keras 3 does not have; leave it False (or run with TF_USE_LEGACY_KERAS=1, Keras 2)")
    if aiacc.switched_off("load_model"):
        return keras.models.load_model(filepath, custom_objects=custom_objects)
    loaders, stand_ins = {}, {}
    classes = _keras2.optimizer_classes(keras.optimizers.Optimizer, lambda cls: issubclass(cls, _DistributedOptimizer))
    for cls in classes + list(custom_optimizers or []):
        stand_ins[cls] = loader = _loader(cls, compression, backward_passes_per_step, average_aggregated_gradients)
        loaders.update((name, loader) for name in _names_of(cls))
    from keras.src.saving import serialization_lib  # noqa: PLC0415 - Keras 3 looks a built-in up by its module
    with _keras2.resolving_as(serialization_lib, "_retrieve_class_or_fn", stand_ins):
        return keras.models.load_model(filepath, custom_objects={**loaders, **(custom_objects or {})})
