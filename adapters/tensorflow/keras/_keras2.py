"""``DistributedOptimizer`` for Keras 2 optimizers: the ``tf_keras`` package, which ``tf.keras`` is when TensorFlow
runs with ``TF_USE_LEGACY_KERAS=1`` (how Keras 2 scripts run on a current TensorFlow), its optimizers
(``tf.keras.optimizers.*``) and the older ``tf.keras.optimizers.legacy.*``.

Horovod's Keras 2 wrapper, on aiacc's gradient buckets: a subclass of the optimizer's class (same name, built from
its config) whose ``compute_gradients`` / ``_compute_gradients`` / ``get_gradients`` (what ``minimize`` and
``model.fit`` call) return the gradients averaged across ranks, through the same
:class:`~aiacc.tensorflow.gradients.GradientReducer` as ``DistributedGradientTape``. ``apply_gradients`` of
gradients computed elsewhere applies them as given, as in Horovod (average them with ``DistributedGradientTape``).
``backward_passes_per_step=N``: Horovod's rule, its attributes too (``_agg_helper.counter``): each call adds its
gradients to per-variable sums on the rank, every N-th call averages the sums across ranks (their mean over the
N calls with ``average_aggregated_gradients=True``) and ``apply_gradients`` updates the variables; the other
calls only count ``iterations`` (which counts every call, as Horovod's wrapper did).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Callable, Optional

import tensorflow as tf

import aiacc
from aiacc.compression import Compression
from aiacc.ops import Average

from .._same_start import keras_step
from ..gradients import GradientReducer, _label, reduce_except_local

__all__ = ["is_keras2_optimizer", "is_keras2_layer", "DistributedOptimizer", "load_model"]


def _tf_keras():
    """The ``tf_keras`` module if this process imported it (``tf.keras`` under ``TF_USE_LEGACY_KERAS=1``), else None:
    a Keras 2 object cannot exist without it, so nothing is imported here."""
    return sys.modules.get("tf_keras")


def is_keras2_optimizer(optimizer) -> bool:
    tf_keras = _tf_keras()
    return tf_keras is not None and isinstance(optimizer, (tf_keras.optimizers.Optimizer,
                                                           tf_keras.optimizers.legacy.Optimizer))


def is_keras2_layer(layer) -> bool:
    tf_keras = _tf_keras()
    return tf_keras is not None and isinstance(layer, tf_keras.layers.Layer)


def _key(variable):
    return variable.ref() if hasattr(variable, "ref") else id(variable)


class _Accumulation:
    """Horovod's ``LocalGradientAggregationHelper`` for Keras 2: per-variable sums on the rank (``tf.Variable``s,
    made at the first call), ``counter`` of the calls since the last reduction; works eagerly and in a
    ``tf.function`` (``tf.cond`` on the counter, the same on every rank)."""

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool, reduce: Callable):
        self.passes, self.average, self.sparse_as_dense, self.reduce = passes, average, sparse_as_dense, reduce
        self.counter = tf.Variable(0, trainable=False, dtype=tf.int32, name="aiacc_backward_passes")
        self._sums: dict = {}

    def _sum_for(self, variable, grad):
        key = _key(variable)
        acc = self._sums.get(key)
        if acc is None:
            shape = grad.shape if grad.shape.is_fully_defined() else variable.shape
            with tf.init_scope():  # (made once, outside any function being traced)
                acc = tf.Variable(tf.zeros(shape, grad.dtype), trainable=False, name="aiacc_gradient_sum")
            self._sums[key] = acc
        return acc

    def compute_gradients(self, grads, variables) -> list:
        present, sums = [], []
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:  # (Horovod's rule, with the variable named)
                    what = _label(v)[1:] or f"variable {i}"
                    raise ValueError(f"DistributedOptimizer: the gradient of {what} is a tf.IndexedSlices, which "
                                     f"backward_passes_per_step={self.passes} cannot add up; pass sparse_as_dense=True")
                g = tf.convert_to_tensor(g)
            acc = self._sum_for(v, g)
            acc.assign_add(g)
            present.append(i)
            sums.append(acc.read_value())
        self.counter.assign_add(1)
        chosen = [variables[i] for i in present]

        def reduce_and_clear():
            reduced = self.reduce(list(sums), chosen)
            if self.average:
                reduced = [r / self.passes for r in reduced]
            reduced = [tf.identity(r) for r in reduced]  # (read before the sums are cleared)
            with tf.control_dependencies(reduced):
                self.counter.assign(0)
                for v in chosen:
                    acc = self._sums[_key(v)]
                    acc.assign(tf.zeros_like(acc))
            return reduced

        out = list(grads)
        if present:
            results = tf.cond(tf.equal(self.counter, self.passes), reduce_and_clear, lambda: list(sums))
            for i, r in zip(present, results):
                out[i] = r
        else:  # (nothing to reduce: only the count)
            tf.cond(tf.equal(self.counter, self.passes), lambda: self.counter.assign(0), lambda: self.counter)
        return out


class _Keras2DistributedOptimizer:
    """Mixed into a Keras 2 optimizer's class (one class per wrap, Horovod's way, so that ``from_config`` copies
    are distributed too): the gradients its ``compute_gradients`` returns are averaged across ranks."""

    _aiacc_settings: Optional[dict] = None  # the wrap's: reducer, passes, average, sparse_as_dense, scale_local

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = type(self)._aiacc_settings
        object.__setattr__(self, "_aiacc_local", {})  # (not tracked: Keras 2 tracks attributes set on it)
        object.__setattr__(self, "_aiacc_reducer", s["reducer"])
        object.__setattr__(self, "_aiacc_scale_local", s["scale_local"])
        object.__setattr__(self, "process_set", s["process_set"])
        helper = None
        if s["passes"] > 1:
            helper = _Accumulation(s["passes"], s["average"], s["sparse_as_dense"], self._aiacc_reduce)
        object.__setattr__(self, "_agg_helper", helper)

    def register_local_var(self, var) -> None:
        """Keep the gradient of ``var`` on this rank, divided by the number of ranks unless
        ``scale_local_gradients=False`` (Horovod's method)."""
        self._aiacc_local[id(var)] = var  # held, so that its id is not reused

    def _aiacc_reduce(self, grads, variables) -> list:
        if self._aiacc_reducer is None:  # switched off: accumulation only
            return list(grads)
        return reduce_except_local(self._aiacc_reducer, list(grads), list(variables), self._aiacc_local,
                                   self._aiacc_scale_local)

    def _aiacc_allreduce(self, grads, variables) -> list:
        if self._agg_helper is not None:
            return self._agg_helper.compute_gradients(list(grads), list(variables))
        return self._aiacc_reduce(grads, variables)

    def compute_gradients(self, loss, var_list, tape=None):
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        base = super()
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):  # tf.keras.optimizers.legacy
            pairs = base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        else:
            pairs = base.compute_gradients(loss, var_list, tape=tape)
        pairs = list(pairs)
        if not pairs:
            return pairs
        grads, variables = (list(t) for t in zip(*pairs))
        # (at the second call, the ranks' variables are compared once: _same_start)
        return list(zip(keras_step(self, self._aiacc_allreduce(grads, variables), variables, self.iterations),
                        variables))

    def get_gradients(self, loss, params):
        return keras_step(self, self._aiacc_allreduce(super().get_gradients(loss, params), params), params,
                          self.iterations)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        helper = self._agg_helper
        base = super()
        if helper is None:
            return base.apply_gradients(grads_and_vars, *args, **kwargs)
        grads_and_vars = list(grads_and_vars)
        iterations = self.iterations  # (made now, not inside a branch)

        def update():
            base.apply_gradients(grads_and_vars, *args, **kwargs)
            return tf.identity(iterations)

        def count():
            iterations.assign_add(1)
            return tf.identity(iterations)

        result = tf.cond(tf.equal(helper.counter, 0), update, count)
        # in a graph an op, as the base class returns (assign_add(read_value=False)): a LossScaleOptimizer around this
        # one pairs it with its skip branch's op in a cond ("true_fn and false_fn ... must have the same ... structure")
        return result if tf.executing_eagerly() else tf.group(result)


def DistributedOptimizer(optimizer, name, compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, passes=1, average_aggregated_gradients=False,
                         process_set=None, scale_local_gradients=True):
    """The Keras 2 form of :func:`aiacc.keras.DistributedOptimizer` (its arguments already checked there)."""
    base = type(optimizer)
    reducer = GradientReducer(name or f"Distributed{base.__name__}", compression, sparse_as_dense, op,
                              gradient_predivide_factor, process_set, "DistributedOptimizer")
    if reducer.adasum and average_aggregated_gradients and passes > 1:
        raise ValueError("DistributedOptimizer: op=Adasum does not take average_aggregated_gradients=True "
                         "(as in Horovod)")
    off = aiacc.switched_off("DistributedOptimizer")
    if off and passes == 1:
        return optimizer
    settings = {"reducer": None if off else reducer, "passes": passes, "average": bool(average_aggregated_gradients),
                "sparse_as_dense": bool(sparse_as_dense), "scale_local": bool(scale_local_gradients),
                "process_set": process_set or aiacc.global_process_set}
    cls = type(base.__name__, (_Keras2DistributedOptimizer, base),
               {"__module__": base.__module__, "_aiacc_settings": settings})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return carry_exclusions(optimizer, cls.from_config(config))


def carry_exclusions(optimizer, wrapped):
    """``wrapped`` (rebuilt from ``optimizer``'s config) with the variables ``optimizer.exclude_from_weight_decay()``
    excluded (AdamW's bias and norm weights), which Keras (3 and 2) keeps outside ``get_config()``: before, the
    wrapper decayed them, without a word. Returns ``wrapped``."""
    for key, value in vars(optimizer).items():
        if key.startswith("_exclude_from_weight_decay") and not key.endswith("_cache"):
            setattr(wrapped, key, copy.copy(value))
    return wrapped


def tf_keras_is_keras2() -> bool:
    """Whether ``tf.keras`` is Keras 2 (the ``tf_keras`` package: TensorFlow runs with ``TF_USE_LEGACY_KERAS=1``)."""
    return tf.keras.__name__.startswith("tf_keras")


def optimizer_classes(base, skip: Callable[[type], bool]) -> list:
    """The optimizer classes below ``base`` loaded so far, but for those ``skip`` names (the wrappers) and the
    stand-ins of an earlier ``load_model`` (alive until the garbage collector frees them: a second load would take
    a stand-in for the class and wrap twice). Keras 3's and Keras 2's ``load_model``."""
    out = []
    for cls in base.__subclasses__():
        if not (skip(cls) or getattr(cls, "_aiacc_stand_in", False)):
            out.append(cls)
        out.extend(optimizer_classes(cls, skip))
    return out


def _keras2_skip(cls) -> bool:
    """Keras 2's wrappers, and its loss-scale optimizers (their inner optimizer is wrapped: what ``compile`` makes
    under ``mixed_float16``)."""
    return issubclass(cls, _Keras2DistributedOptimizer) or hasattr(cls, "inner_optimizer")


def _loader(cls, wrap: Callable):
    """A stand-in for optimizer class ``cls`` while a model loads: its ``from_config`` builds the optimizer
    wrapped (before Keras makes its variables and loads the saved ones into them)."""

    def from_config(_klass, config, custom_objects=None):
        return wrap(cls.from_config(config, custom_objects=custom_objects))

    return type(cls.__name__, (cls,), {"from_config": classmethod(from_config), "__module__": cls.__module__,
                                       "_aiacc_stand_in": True})


@contextlib.contextmanager
def resolving_as(module, function: str, stand_ins: dict):
    """While a model loads, the classes that Keras' ``module.function`` finds (it returns a class, or a class
    and its config) resolve to their stand-ins. Keras finds a built-in optimizer by its module (a ``.keras``
    file), its registered name (``Custom>Adam``) or a name among its own (an ``.h5`` file), before or instead of
    the custom objects, so without this a file saved with a plain ``Adam`` came back unwrapped and trained apart
    on every rank. (Keras' private lookup; a Keras without it keeps the custom objects' way only.)"""
    find = getattr(module, function, None)
    if find is None:
        yield
        return

    def find_stand_in(*args, **kwargs):
        found = find(*args, **kwargs)
        if isinstance(found, tuple):
            return (stand_ins.get(found[0], found[0]),) + found[1:]
        return stand_ins.get(found, found) if isinstance(found, type) else found

    setattr(module, function, find_stand_in)
    try:
        yield
    finally:
        setattr(module, function, find)


def load_model(filepath, custom_optimizers, custom_objects, wrap: Callable):
    """``aiacc.keras.load_model`` when ``tf.keras`` is Keras 2: ``tf.keras.models.load_model`` whose optimizer
    (``tf.keras.optimizers.*`` or ``.legacy.*``: the class the file records, whatever ``legacy_opts`` says) comes
    back wrapped by ``wrap``, its saved state loaded into the wrapped one. The classes Keras 2 finds, in ``.keras``
    files (``serialization_lib``) and ``.h5`` files (the legacy ``serialization``), resolve to stand-ins that wrap.
    ``custom_optimizers``: classes of your own, also found by their names (Horovod's way) or registered names;
    ``custom_objects`` win over those."""
    tf_keras = _tf_keras()
    from tf_keras.src.saving import serialization_lib  # noqa: PLC0415 - Keras 2's lookups of classes
    from tf_keras.src.saving.legacy import serialization

    classes = (optimizer_classes(tf_keras.optimizers.Optimizer, _keras2_skip)
               + optimizer_classes(tf_keras.optimizers.legacy.Optimizer, _keras2_skip) + list(custom_optimizers or []))
    stand_ins = {cls: _loader(cls, wrap) for cls in classes}
    names = {name: stand_ins[cls] for cls in custom_optimizers or []
             for name in (cls.__name__, tf_keras.saving.get_registered_name(cls))}
    with resolving_as(serialization_lib, "_retrieve_class_or_fn", stand_ins), \
            resolving_as(serialization, "class_and_config_for_serialized_keras_object", stand_ins):
        return tf_keras.models.load_model(filepath, custom_objects={**names, **(custom_objects or {})})

_SYNC_BN: dict = {}


def sync_batch_normalization():
    """Horovod's ``hvd.SyncBatchNormalization`` for Keras 2 (``tf.keras`` is ``tf_keras``): a subclass of its
    ``BatchNormalization`` whose training statistics are the global batch's (one allreduce of the per-channel sum,
    sum of squares and row count, so per-rank batch sizes may differ), as the Keras 3 layer of ``aiacc.keras``."""
    if "class" not in _SYNC_BN:
        tf_keras = sys.modules["tf_keras"]

        class SyncBatchNormalization(tf_keras.layers.BatchNormalization):
            __doc__ = sync_batch_normalization.__doc__

            def __init__(self, fused=False, process_set=None, **kwargs):
                if fused in (True, None):
                    raise ValueError("SyncBatchNormalization does not support fused=True (Horovod's rule); leave it "
                                     "False")
                if kwargs.get("renorm"):
                    raise ValueError("SyncBatchNormalization: renorm=True is not supported")
                super().__init__(fused=False, **kwargs)
                self.process_set = process_set or aiacc.global_process_set

            def _moments(self, inputs, reduction_axes, keep_dims, mask=None):
                if aiacc.set_size(self.process_set) == 1:
                    return super()._moments(inputs, reduction_axes, keep_dims=keep_dims, mask=mask)
                if mask is not None:
                    raise ValueError(f"SyncBatchNormalization {self.name!r}: masked inputs are not supported")
                x = tf.cast(inputs, tf.float32) if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
                count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), reduction_axes)), x.dtype)
                total = tf.reduce_sum(x, reduction_axes, keepdims=keep_dims)
                squares = tf.reduce_sum(tf.square(x), reduction_axes, keepdims=keep_dims)
                local = tf.concat([tf.reshape(total, [-1]), tf.reshape(squares, [-1]), tf.reshape(count, [1])], 0)
                from aiacc.tensorflow import Sum, allreduce  # noqa: PLC0415 - (aiacc.tensorflow imports this module)

                reduced = allreduce(local, op=Sum, name=f"{self.name}.moments", process_set=self.process_set)
                channels = tf.size(total)
                n = reduced[-1]
                mean = tf.reshape(reduced[:channels] / n, tf.shape(total))
                variance = tf.maximum(tf.reshape(reduced[channels:2 * channels] / n, tf.shape(total)) - tf.square(mean),
                                      0.0)
                return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)

        _SYNC_BN["class"] = SyncBatchNormalization
    return _SYNC_BN["class"]
