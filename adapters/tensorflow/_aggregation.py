"""``backward_passes_per_step`` of TF1's ``DistributedOptimizer`` in a TF1 graph (Horovod's
``LocalGradientAggregationHelper`` for legacy optimizers, which also runs in graphs only).

Each run of the graph adds its gradients to accumulators of this rank (local variables, ``aggregation_variables_<name>``
as in Horovod: a ``MonitoredSession`` initializes them, a plain ``Session`` needs
``tf.compat.v1.local_variables_initializer()``, as with Horovod) and counts the run; the run that makes the count
``backward_passes_per_step`` reduces the accumulated sums across the ranks (divided by the count with
``average_aggregated_gradients``) and starts the count again, and only that run applies them (``apply_gradients``, in a
``tf.cond``); the others only add ``global_step``'s 1 (Horovod's). The runs in between return each rank's own
gradients. An ``IndexedSlices`` gradient is added to its accumulator row by row (``scatter_add``) and reduced dense
(Horovod refuses it without ``sparse_as_dense``; the accumulator is dense either way).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List

import tensorflow as tf

__all__ = ["Aggregation"]


class Aggregation:
    """The accumulators and run count of one ``DistributedOptimizer`` (made at its first ``compute_gradients``)."""

    def __init__(self, passes: int, average: bool, name: str):
        self.passes = int(passes)
        self.average = bool(average)
        self.name = name
        self.counter = None

    def gradients(self, grads: list, variables: list, reduce: Callable[[list, list], list]) -> list:
        """``grads`` (of ``variables``; None stays None) added to the accumulators; the reduced sums
        (``reduce(values, their variables)`` of the accumulators' values) on the run that completes ``passes``, else
        ``grads`` as they are (dense)."""
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return list(grads)
        with tf.compat.v1.variable_scope(f"aggregation_variables_{self.name}", reuse=tf.compat.v1.AUTO_REUSE):
            counter = tf.compat.v1.get_variable("aggregation_counter", shape=(), dtype=tf.int32, trainable=False,
                                                initializer=tf.compat.v1.zeros_initializer(),
                                                collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
            sums = [self._accumulator(i, grads[i], variables[i]) for i in present]
        self.counter = counter
        clear = tf.cond(tf.equal(counter, 0), lambda: tf.group([s.assign(tf.zeros_like(s)) for s in sums]), tf.no_op)
        with tf.control_dependencies([clear]):
            added = [s.scatter_add(g) if isinstance(g, tf.IndexedSlices) else s.assign_add(g)
                     for s, g in zip(sums, (grads[i] for i in present))]
        with tf.control_dependencies(added):
            count = counter.assign_add(1)

        def reduced() -> List[tf.Tensor]:
            out = reduce([s.read_value() for s in sums], [variables[i] for i in present])
            with tf.control_dependencies([g for g in out if g is not None]):
                reset = counter.assign(0)
            with tf.control_dependencies([reset]):
                return [g / self.passes if self.average else tf.identity(g) for g in out]

        def own() -> List[tf.Tensor]:
            return [tf.convert_to_tensor(grads[i]) for i in present]

        chosen = tf.cond(tf.equal(count, self.passes), reduced, own)
        out = [None] * len(grads)
        for i, g in zip(present, chosen if isinstance(chosen, (list, tuple)) else [chosen]):
            out[i] = g
        return out

    def _accumulator(self, index: int, grad, variable):
        shape = variable.shape
        if not shape.is_fully_defined():
            raise ValueError(f"DistributedOptimizer(backward_passes_per_step={self.passes}): variable "
                             f"{getattr(variable, 'name', index)!r} has no fully defined shape ({shape}); its "
                             "gradients cannot be accumulated")
        return tf.compat.v1.get_variable(str(index), shape=shape, dtype=grad.dtype.base_dtype, trainable=False,
                                         initializer=tf.compat.v1.zeros_initializer(),
                                         collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

    def apply(self, apply: Callable[[], object], grads: list, variables: list, global_step) -> tf.Operation:
        """``apply()`` (the wrapped optimizer's ``apply_gradients`` of ``grads`` to ``variables``) on the run whose
        gradients were reduced; on the others ``global_step`` (if any) counts the run."""
        if self.counter is None:
            raise ValueError("DistributedOptimizer(backward_passes_per_step=...): apply_gradients needs the gradients "
                             "of this optimizer's compute_gradients (or minimize)")
        deps = [t for g in grads if g is not None for t in tf.nest.flatten(g, expand_composites=True)]

        def step_counted():
            if global_step is None:
                return tf.no_op()
            return global_step.assign_add(tf.constant(1, global_step.dtype.base_dtype), read_value=False)

        with tf.control_dependencies(deps):  # (the count read after this run's gradients: read_value, also of a
            # TF1 reference variable, whose plain use reads it whenever the executor likes)
            with _v1_cond_for_references(variables + [global_step]):
                applied = tf.cond(tf.equal(self.counter.read_value(), 0), lambda: _as_op(apply()), step_counted)
        return applied


@contextlib.contextmanager
def _v1_cond_for_references(variables: list):
    """TF1's ``cond`` inside the block where one of ``variables`` is a reference variable (``use_resource=False``) in
    a graph that builds TensorFlow 2's control flow: ``cond_v2`` takes a reference variable into its branch as its
    value, which the optimizer's update ops (``ApplyGradientDescent`` ...) refuse (a ``TypeError``: float32 where
    float32_ref is expected). Horovod's helper builds the same ``tf.cond`` and fails there."""
    if not tf.compat.v1.control_flow_v2_enabled() or not any(
            v is not None and v.dtype != v.dtype.base_dtype for v in variables):
        yield
        return
    tf.compat.v1.disable_control_flow_v2()  # (the process-wide switch that ``tf.cond`` reads as it builds)
    try:
        yield
    finally:
        tf.compat.v1.enable_control_flow_v2()


def _as_op(result):
    return result if isinstance(result, tf.Operation) else tf.group(result)
