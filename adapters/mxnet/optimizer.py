"""``DistributedOptimizer`` for MXNet's Module API, and ``broadcast_parameters``.

The Module API calls ``optimizer.update(index, weight, grad, state)`` (or, for
optimizers that aggregate updates, with lists of up to
``MXNET_OPTIMIZER_AGGREGATION_SIZE`` indices). The wrapper submits each
gradient to aiacc's engine (named after the parameter, via ``idx2name``),
waits for the averaged values, written in place into the gradient NDArray,
and delegates to the wrapped optimizer. Every attribute read or written on the
wrapper is the wrapped optimizer's, so Module's bookkeeping (``idx2name``, learning-rate
multipliers) reaches the real optimizer; but ``rescale_grad`` set on the wrapper stays on it, as on
Horovod's (a ``gluon.Trainer`` around the wrapper sets its ``1/batch`` there: the wrapped optimizer's own
``rescale_grad`` applies, as under Horovod).

One request per gradient, not per bucket (``DistributedTrainer``'s way): the
optimizer is handed a few gradients at a time and must apply their update
before it returns, with no hook that tells it the step's other gradients, so
there is no bucket to fill; gradients stay in MXNet's memory, reduced in place.

``process_set``: the ranks that average the gradients (default: every rank). As in Horovod, a
rank outside the set updates with its own gradients (:func:`aiacc.outside_process_set`).

With aiacc disabled, ``DistributedOptimizer(opt)`` returns ``opt`` itself.
"""

from __future__ import annotations

import types

import mxnet as mx

import aiacc
from aiacc import Average, Collective, global_process_set
from aiacc.buckets import registration_priority
from aiacc.names import gradient_name
from aiacc.same_start import check_same_start, user_site

from .gradients import reduce_gradients
from .tensors import writable_view

__all__ = ["DistributedOptimizer", "broadcast_parameters"]

_OWN = frozenset({"_optimizer", "_aiacc_op", "_aiacc_prescale", "_aiacc_postscale", "_aiacc_gpf", "_aiacc_set",
                  "_aiacc_first"})
FIX = ("Broadcast rank 0's parameters before training: hvd.broadcast_parameters(arg_params, root_rank=0) and "
       "mod.set_params(arg_params, aux_params) (Module), hvd.broadcast_parameters(net.collect_params(), root_rank=0) "
       "(Gluon).")


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wrap an ``mx.optimizer.Optimizer`` so each update uses gradients averaged across ranks.

    ``gradient_predivide_factor``: gradients are divided by it before the sum and by
    ``size / factor`` after it. ``num_groups`` (a count >= 0) is accepted for Horovod compatibility
    and changes nothing (the engine fuses by itself). ``process_set``: the ranks that average the
    gradients; a rank outside it updates with its own (as in Horovod).

    Example::

        opt = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / batch_size)
        mod.init_optimizer(optimizer=hvd.DistributedOptimizer(opt))
    """

    def __new__(cls, optimizer, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                process_set=global_process_set):
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps an mx.optimizer.Optimizer, got {type(optimizer).__name__}")
        aiacc.gradient_factors(Average, gradient_predivide_factor, "DistributedOptimizer")  # validate in every mode
        aiacc.check_groups(num_groups, None, "DistributedOptimizer")
        # the core's error for a set that is not registered, in every mode
        if isinstance(optimizer, DistributedOptimizer) or aiacc.gradient_engine(process_set,
                                                                                "DistributedOptimizer").off:
            return optimizer
        return object.__new__(cls)

    def __init__(self, optimizer, gradient_predivide_factor: float = 1.0, num_groups: int = 0,  # noqa: ARG002
                 process_set=global_process_set):
        if optimizer is self:  # __new__ handed back an optimizer that was already wrapped
            return
        op, pre, post = aiacc.gradient_factors(Average, gradient_predivide_factor, "DistributedOptimizer")
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_aiacc_op", op)
        object.__setattr__(self, "_aiacc_prescale", pre)
        object.__setattr__(self, "_aiacc_postscale", post)
        object.__setattr__(self, "_aiacc_gpf", float(gradient_predivide_factor))
        object.__setattr__(self, "_aiacc_set", process_set)
        # index -> weight of the updates of the first step, until the first update of the second (``_same_start``)
        object.__setattr__(self, "_aiacc_first", {})

    # ---- transparency: the wrapped optimizer's state is the only state ------------------------
    def __getattr__(self, item):
        if item in _OWN:  # not set yet (e.g. during unpickling)
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, key, value):
        # rescale_grad set on the wrapper stays on it, as Horovod's wrapper keeps every attribute set on it: a
        # gluon.Trainer holding the wrapper sets its 1/batch there at each step(batch), while the wrapped optimizer
        # keeps the rescale_grad it was made with (Horovod's Gluon recipe sets 1/batch there; both applied, the
        # gradients were divided by the batch size twice)
        if key in _OWN or key == "rescale_grad":
            object.__setattr__(self, key, value)
        else:
            setattr(self._optimizer, key, value)

    def __reduce__(self):  # Updater.get_states(dump_optimizer=True) pickles the optimizer
        process_set = None if self._aiacc_set is global_process_set else self._aiacc_set
        return (_rebuild, (self._optimizer, self._aiacc_gpf, process_set))

    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)

    def _set_current_context(self, device_id):
        self._optimizer._set_current_context(device_id)

    # ---- the reduction -------------------------------------------------------------------------
    def _allreduce(self, index, grad) -> None:
        if aiacc.outside_process_set(self._aiacc_set):
            return
        indices = list(index) if isinstance(index, (list, tuple)) else [index]
        grads = list(grad) if isinstance(grad, (list, tuple)) else [grad]
        idx2name = self._optimizer.idx2name or {}
        # Module numbers the parameters in the order the model uses them: the core's priority rule
        items = [(gradient_name(str(idx2name.get(i, i))), g,
                  registration_priority(i, len(idx2name)) if isinstance(i, int) else 0.0)
                 for i, g in zip(indices, grads)]
        reduce_gradients(items, op=self._aiacc_op, prescale=self._aiacc_prescale, postscale=self._aiacc_postscale,
                         process_set=self._aiacc_set)

    def _same_start(self, index, weight) -> None:
        """Did the ranks start from the same parameters (``aiacc.same_start``)? The updates of the first step are
        remembered (index -> weight); the first update of an index seen before is the second step's first, before
        which the remembered weights (every parameter the optimizer updates, after the first step's update) are
        compared across the ranks once, on every rank at the same update (the order of the updates is the model's)."""
        first = self._aiacc_first
        indices = list(index) if isinstance(index, (list, tuple)) else [index]
        if not any(i in first for i in indices):
            first.update(zip(indices, weight if isinstance(index, (list, tuple)) else [weight]))
            return
        object.__setattr__(self, "_aiacc_first", None)
        engine = None if aiacc.outside_process_set(self._aiacc_set) else aiacc.engine_for(self._aiacc_set)
        if engine is None or not engine.config.check_same_start:
            return
        idx2name = self._optimizer.idx2name or {}  # (Module's; a gluon.Trainer gives its Parameters in param_dict)
        params = getattr(self._optimizer, "param_dict", None) or {}
        check_same_start(((str(idx2name.get(i) or getattr(params.get(i), "name", None) or i), w.asnumpy())
                          for i, w in sorted(first.items(), key=lambda kv: str(kv[0]))), "DistributedOptimizer", FIX,
                         self._aiacc_set, where=user_site())  # (the script's call, past MXNet's and aiacc's frames)

    def update(self, index, weight, grad, state):
        if self._aiacc_first is not None:
            self._same_start(index, weight)
        self._allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        if self._aiacc_first is not None:
            self._same_start(index, weight)
        self._allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)


def _rebuild(optimizer, gradient_predivide_factor, process_set=None):
    return DistributedOptimizer(optimizer, gradient_predivide_factor,
                                process_set=global_process_set if process_set is None else process_set)


# ---- broadcast_parameters ----------------------------------------------------------------------
def _broadcast_after_init(param, root_rank: int, name: str) -> None:
    """Parameters with deferred initialisation get their broadcast right after MXNet creates them."""
    init_impl = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        init_impl(*args, **kwargs)
        _broadcast_arrays([(name, self.list_data())], root_rank)

    param._init_impl = types.MethodType(init_then_broadcast, param)


def _broadcast_arrays(named, root_rank: int) -> None:
    handles = []
    try:
        for name, arrays in named:
            if len(arrays) != 1:
                raise ValueError(f"parameter {name!r} is on {len(arrays)} contexts; aiacc.mxnet trains with one "
                                 "context per process")
            view = writable_view(arrays[0], name, "parameter")
            handles.append(aiacc.submit(Collective.BROADCAST, view, name=name, root=root_rank, outputs=[view]))
    finally:
        aiacc.synchronize_all(handles)


class InvalidParamsError(TypeError, ValueError):
    """``broadcast_parameters`` given what it cannot broadcast: a ``TypeError``, and the ``ValueError`` Horovod
    raises there ('invalid params of type')."""


def broadcast_parameters(params, root_rank: int = 0, prefix=None) -> None:
    """Overwrite every rank's parameters with ``root_rank``'s, in place.

    ``params``: a Gluon ``ParameterDict`` (``net.collect_params()``) or a dict of NDArrays or
    Parameters (``arg_params`` of ``Module.get_params()``). Tensors are matched across ranks by
    their key (sorted). Parameters whose initialisation is deferred (shape unknown until the
    first forward pass) are broadcast as soon as MXNet creates them. The ranks first exchange their keys
    (one small collective): keys that only some ranks have are a ``TensorMismatchError`` on every rank
    naming them and the ranks, a value neither a Parameter nor an NDArray is a ``TypeError`` (``ValueError``) on
    every rank naming it and its rank, and nothing is broadcast.
    """
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise InvalidParamsError(f"broadcast_parameters: params must be a gluon ParameterDict or a dict, "
                                 f"got {type(params).__name__}")
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"broadcast_parameters: prefix must be a string, got {type(prefix).__name__}")
    prefix = prefix or ""
    root_rank = aiacc.check_root(root_rank, "broadcast_parameters")
    items = sorted(params.items())
    wrong = [f"{key!r} is a {type(p).__name__}, not a Parameter or NDArray" for key, p in items
             if not isinstance(p, (mx.gluon.Parameter, mx.nd.NDArray))]
    if aiacc.switched_off("broadcast_parameters"):
        if wrong:
            raise InvalidParamsError(f"broadcast_parameters: {wrong[0]}")
        return
    # every rank the same keys, each a Parameter or an NDArray: else the same error on every rank, naming the keys or
    # the values and the ranks (each rank waited for broadcasts the others never send)
    aiacc.check_same_keys([key for key, _ in items], "broadcast_parameters", f"{prefix}broadcast_parameters.keys",
                          wrong=wrong, wrong_error=InvalidParamsError)
    named = []
    for key, p in items:
        name = f"{prefix}param.{key}"
        if isinstance(p, mx.gluon.Parameter):
            try:
                named.append((name, p.list_data()))
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(p, root_rank, name)
        else:
            named.append((name, [p]))
    _broadcast_arrays(named, root_rank)
