"""``hvd.DistributedOptimizer`` and ``hvd.BroadcastGlobalVariablesHook`` of ``aiacc.tensorflow`` (Horovod's).

``DistributedOptimizer`` takes what Horovod's takes: a TF1 ``tf.compat.v1.train.Optimizer`` (graphs, a
``Session`` or ``MonitoredSession``), whose ``compute_gradients`` then returns the gradients averaged across
ranks (through the same :class:`~aiacc.tensorflow.gradients.GradientReducer` as ``DistributedGradientTape``:
gradient buckets, IndexedSlices allgathered or densified, process sets, local variables); or a Keras
optimizer, which goes to :func:`aiacc.keras.DistributedOptimizer` as in Horovod.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

import aiacc
from aiacc import global_process_set
from aiacc.compression import Compression
from aiacc.objects import check_passes
from aiacc.ops import Average

from ._aggregation import Aggregation
from ._engine import after_graph_wait
from ._same_start import LEGACY_FIX, in_tf1_graph, legacy_optimizer_step, wait_hook
from .functions import broadcast_global_variables
from .gradients import GradientReducer, reduce_except_local

__all__ = ["DistributedOptimizer", "BroadcastGlobalVariablesHook"]

_LegacyOptimizer = tf.compat.v1.train.Optimizer


class _DistributedLegacyOptimizer(_LegacyOptimizer):
    """Wraps a TF1 optimizer: ``compute_gradients`` averages the gradients across ranks, everything else
    is the wrapped optimizer's (``self._optimizer``, Horovod's attribute)."""

    def __init__(self, optimizer, name, use_locking, reducer: GradientReducer, scale_local_gradients: bool,
                 aggregation: Optional[Aggregation] = None, off: bool = False):
        super().__init__(name=name, use_locking=use_locking)
        self._aiacc_off = off
        self._optimizer = optimizer
        self._aiacc_reducer = reducer
        self._aiacc_local = {}
        self._aiacc_scale_local = bool(scale_local_gradients)
        self._aiacc_aggregation = aggregation
        self.process_set = reducer.process_set or global_process_set

    def register_local_var(self, var) -> None:
        """Keep the gradient of ``var`` on this rank (divided by the number of ranks unless
        ``scale_local_gradients=False``), as Horovod does for model-parallel variables."""
        self._aiacc_local[id(var)] = var  # held, so that its id is not reused

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``compute_gradients``, the gradients averaged across ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = (list(t) for t in zip(*pairs))
        aggregation = self._aiacc_aggregation
        # (switched off, a job of one rank: the accumulated gradients as they are)
        reduce = (lambda g, _: g) if self._aiacc_off else self._aiacc_reduce
        if aggregation is None:
            grads = reduce(grads, variables)
        elif in_tf1_graph():
            grads = aggregation.gradients(grads, variables, reduce)
        else:
            raise NotImplementedError(
                f"DistributedOptimizer: backward_passes_per_step={aggregation.passes} of a TF1 optimizer "
                f"({type(self._optimizer).__name__}) runs in a TF1 graph (a Session), as Horovod's; eagerly or in "
                "tf.function use a Keras optimizer, or accumulate the gradients before compute_gradients returns them")
        return list(zip(grads, variables))

    def _aiacc_reduce(self, grads: list, variables: list) -> list:
        reducer, local = self._aiacc_reducer, self._aiacc_local
        # (at the second call, or a TF1 graph's second run, the ranks' variables are compared once: _same_start;
        # traced, in the reduction's wait)
        hook = wait_hook(reducer, variables, lambda: set(local), "DistributedOptimizer", LEGACY_FIX)
        with after_graph_wait(hook):
            grads = reduce_except_local(reducer, grads, variables, local, self._aiacc_scale_local)
        return legacy_optimizer_step(self, reducer, grads, variables, hook)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's; with ``backward_passes_per_step``, only on the runs whose gradients were reduced
        (the others count ``global_step``)."""
        if self._aiacc_aggregation is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        grads_and_vars = list(grads_and_vars)
        return self._aiacc_aggregation.apply(
            lambda: self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name),
            [g for g, _ in grads_and_vars], [v for _, v in grads_and_vars], global_step)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Horovod's ``hvd.DistributedOptimizer`` of ``horovod.tensorflow``.

    A TF1 optimizer (``tf.compat.v1.train.Optimizer``): a wrapper whose ``compute_gradients`` averages the
    gradients across ranks (the ranks of ``process_set``; a rank outside it keeps its own), ``op`` Average,
    Sum or Adasum, ``compression``, ``sparse_as_dense``, ``gradient_predivide_factor`` and
    ``register_local_var`` as in ``DistributedGradientTape``; ``apply_gradients`` and the slots are the
    wrapped optimizer's. ``backward_passes_per_step`` N > 1 (TF1 graphs only, as Horovod's; eagerly and in
    ``tf.function`` a ``NotImplementedError``): the gradients of N runs are summed on each rank, reduced on the N-th
    (divided by N with ``average_aggregated_gradients``) and applied on that run only (``_aggregation``). A Keras
    optimizer: :func:`aiacc.keras.DistributedOptimizer`
    (Horovod's behaviour). Switched off (``AIACC_ENABLE`` unset/0) a TF1 optimizer is returned as it is (with
    ``backward_passes_per_step`` > 1 the wrapper, which accumulates as in a job of one rank).
    ``device_dense``, ``device_sparse``, ``num_groups`` and ``groups`` are accepted for Horovod compatibility
    (``aiacc.check_groups``: Horovod's checks)."""
    aiacc.check_groups(num_groups, groups, "DistributedOptimizer")
    if isinstance(optimizer, _LegacyOptimizer):
        passes = check_passes(backward_passes_per_step)
        name = name or f"Distributed{type(optimizer).__name__}"
        reducer = GradientReducer(name, compression, sparse_as_dense, op, gradient_predivide_factor, process_set,
                                  "DistributedOptimizer")
        off = aiacc.switched_off("DistributedOptimizer")
        if off and passes == 1:
            return optimizer  # (with passes > 1 the wrapper still accumulates, as the Keras wrappers: a job of one)
        aggregation = Aggregation(passes, average_aggregated_gradients, name) if passes > 1 else None
        return _DistributedLegacyOptimizer(optimizer, name, use_locking, reducer, scale_local_gradients, aggregation,
                                           off)
    import keras  # noqa: PLC0415 - only a Keras optimizer needs Keras

    from .keras._keras2 import is_keras2_optimizer  # noqa: PLC0415

    if isinstance(optimizer, (str, keras.optimizers.Optimizer)) or is_keras2_optimizer(optimizer):
        from .keras import PartialDistributedOptimizer  # noqa: PLC0415

        return PartialDistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                           gradient_predivide_factor, op, backward_passes_per_step,
                                           average_aggregated_gradients, groups, process_set, local_layers=None,
                                           scale_local_gradients=scale_local_gradients)
    raise TypeError(f"DistributedOptimizer needs a TF1 optimizer (tf.compat.v1.train.Optimizer) or a Keras "
                    f"optimizer, got {type(optimizer).__name__}")


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Horovod's TF1 hook for ``MonitoredTrainingSession`` / ``MonitoredSession``: when the session is
    created, every global variable takes ``root_rank``'s value (after initialization or a restore)."""

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
