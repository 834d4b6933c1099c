"""Averaging gradients across ranks: ``DistributedGradientTape`` and the reducer the Keras optimizer shares.

Buckets: the reducer registers the sources it differentiates once with the core's gradient buckets (see
``_buckets``): per step each dense gradient is copied into its slot of a bucket (one numpy call), a bucket goes to
the engine as ONE request when its last gradient is in, and the results are views of the buckets that TensorFlow
adopts without a copy. The engine's work per step follows the number of buckets (``AIACC_BUCKET_CAP``), not of
gradients. The first step settles the buckets (a collective in its wait). ``IndexedSlices`` gradients (embeddings)
stay outside the buckets and are allgathered (or reduced densely with ``sparse_as_dense``); so is a dense gradient
whose shape is not known while tracing, on its own. With ``op=Adasum`` no gradient is bucketed: each is combined with
Adasum on its own (the rule is per tensor), as Horovod's TensorFlow 2 tape and Keras optimizer do on CPU.

None gradients (a variable not connected to this rank's loss in this step): the gradient goes in its bucket all
the same, as zeros with a 0 in the bucket's presence elements (``GradientBuckets(presence=True)``, as
aiacc.torch's optimizer), so ranks whose graphs differ (a layer called on rank 0 only) reduce the same buckets and
every rank gets the sum over the number of ranks; a gradient no rank had comes back None (read from the presence
elements after the wait). In a graph whether a gradient is None is fixed when the function is traced, and its
result cannot become None as it runs: there a gradient None on this rank stays None (a layer no rank calls: as
one process), still sent as zeros so that the buckets match another rank's graph that has it, and the wait
raises on this rank if another rank had it in that step (this rank would skip the update the others apply).
The ranks never agree on it while tracing: that would be a collective in every trace, which hangs where one rank
traces alone (a partial last batch on one rank only, a Python argument that differs). A gradient this rank has had
as IndexedSlices, or of another dtype than its variable, and None in a later step travels as the others' do, and so
does one whose kind (dense, IndexedSlices) or dtype changes on some ranks only (see ``_kinds``). One of at least
``UNUSED_OUT_BYTES`` that no rank had in a step leaves the buckets for good and travels as an embedding's from then on
(``_buckets.SourceBuckets._unused``): an unused embedding table costs two allgathers of nothing, not its size in zeros.

Overlap: inside ``tf.function`` every gradient gets its own submit op, created in the order backprop produces the
gradients (the order ``tape.gradient`` built them: the last layer's first); one collect op, after every submit, waits
for all of them (see ``_engine.Batch``). On host-only TensorFlow, control edges (``_ordering``) make each submit run
before any backprop work that only later gradients need, so every gradient is handed over as soon as it exists, each
bucket is sent as soon as its last gradient is in, and the engine sends it while TensorFlow computes the earlier
layers' gradients; TensorFlow's executor alone computed the weight gradients, and so ran every submit, at the end of
backprop (measured; see ``_ordering``). With a GPU the executor only launches kernels and no edge is added. Eagerly,
``tape.gradient`` returns all gradients at once, so they are handed over together, last variables first.

Names are ``<prefix>.<index>.<variable name>`` (a bucket is named after its first and last gradient:
``bucket[<first>..<last>]``): the same on every rank and on every step (so the engine's response cache
agrees on them with one bit), and free of Keras' per-process layer numbering. Priorities: gradients of
the first variables (near the input) are needed first by the next forward pass.
"""

from __future__ import annotations

import copy
import re
import weakref
from typing import List, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf

import aiacc
from aiacc import devices, global_process_set
from aiacc.adasum import check_ranks
from aiacc.buckets import ParamSpec, registration_priority
from aiacc.compression import Compression, as_compressor
from aiacc.mixin import mixin_class
from aiacc.ops import Adasum, Average, Collective

from ._bridge import check_dtype
from ._buckets import WIRE, buckets_for, outside_spec
from ._engine import Batch, after_graph_wait
from ._kinds import DENSE as _DENSE, HAD as _HAD, SPARSE as _SPARSE, empty_slices, every_row, merge_rows, seen_for
from ._kinds import OWN, first_out, sparse_shape
from ._same_start import tape_hook, tape_step
from .compression import _numpy_dtype
from .mpi_ops import _differentiable, _set_kwargs, _set_size, scale_gathered

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "GradientReducer", "reduce_except_local",
           "local_layer_variables", "AUTO_NAME"]


# what Keras names a variable made without a name (``variable``, ``variable_4``; ``add_weight()`` in a custom layer):
# numbered per process, so a rank that made one more such variable first (another layer, a model for evaluation)
# numbers the same variable otherwise. Left out of the names the ranks compare (the gradient's place in the list
# names it): it failed valid jobs ("gradient 0 has different names across ranks (rank 0: '....0.variable'; rank 1:
# '....0.variable_1')"). (An unnamed eager tf.Variable is 'Variable' in every process: kept.)
AUTO_NAME = re.compile(r"variable(_\d+)?")
# Keras 2 (and TF1 graphs) put the layer's name, numbered per process, in its variables' names (``dense_24/kernel``):
# a rank that made one more layer first (a model for evaluation) failed at its first step ("gradient 0 has different
# names across ranks (rank 0: '....0.dense_1/kernel'; rank 1: '....0.dense/kernel')"). The number is left out.
SCOPE_NUMBER = re.compile(r"_\d+(?=/)")


def _label(source) -> str:
    name = getattr(source, "name", None)  # eager tensors have none (AttributeError)
    if not isinstance(name, str) or not name:
        return ""
    name = name.split(":")[0]
    return "" if AUTO_NAME.fullmatch(name) else f".{SCOPE_NUMBER.sub('', name)}"


class _SourceLabels:
    """The ``labels`` of a reduction's ``Batch`` (engine name -> ``variable 'model/dense/kernel'``, added to an error
    that names the gradient by position, see ``_engine.labelled``), made only when an error is raised."""

    def __init__(self, names: Sequence[str], sources: Sequence):
        self._names, self._sources = names, sources

    def __len__(self) -> int:
        return len(self._names)

    def items(self):
        for name, source in zip(self._names, self._sources):
            path = getattr(source, "path", None) or getattr(source, "name", None)
            if isinstance(path, str) and path:
                yield name, f"variable {path.split(':')[0]!r}"


def _cast(g, dtype):
    """Gradient ``g`` (dense or IndexedSlices) as ``dtype``."""
    if tf.as_dtype(dtype) == g.dtype:
        return g
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(g.values, dtype), g.indices, g.dense_shape)
    return tf.cast(g, dtype)


def _zeros_like(source):
    """The zero gradient of ``source`` (a variable, Keras' too, or a watched tensor)."""
    shape = getattr(source, "shape", None)
    if isinstance(shape, (tf.TensorShape, tuple, list)) and tf.TensorShape(shape).is_fully_defined():
        return tf.zeros(tf.TensorShape(shape), tf.as_dtype(source.dtype))
    return tf.zeros_like(tf.convert_to_tensor(source))


@tf.autograph.experimental.do_not_convert  # a loop over the graph's ops, while tf.function traces
def _backprop_order(grads: Sequence) -> List[int]:
    """Indices of the gradients that are not None, in the order backprop makes them: in a graph, the order
    in which ``tape.gradient`` created them (it builds backprop from the loss backwards); eagerly, and for
    ties, the last variables first."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if tf.executing_eagerly() or not present:
        return present[::-1]
    graph = tf.compat.v1.get_default_graph()
    created = {op: k for k, op in enumerate(graph.get_operations())}

    def position(i):
        g = grads[i]
        op = getattr(g.values if isinstance(g, tf.IndexedSlices) else g, "op", None)  # None: not a graph tensor
        return created.get(op, -1), -i

    return sorted(present, key=position)


_calls_in_graph: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> {prefix: reductions traced}


def _call_prefix(prefix: str, process_set=None) -> str:
    """The names' prefix of one reduction. While a function is traced, the k-th reduction under the same prefix on
    the same process set in its graph gets ``<prefix>#k`` (k >= 1): two tapes (a GAN's generator and discriminator,
    whose variables have the same short names) or two ``gradient()`` calls of a persistent tape in one step are in
    flight together and must not share names or buckets. Tracing runs the same code on every rank, so every rank of
    the set numbers them alike (per set, as names are scoped: a rank with a tape on each of two overlapping sets was
    #1 on the second, its peer there had none), and each step of the traced function reuses them. Eagerly each
    ``gradient()`` returns only when its reduction is done, so the prefix is used as it is."""
    if tf.executing_eagerly():
        return prefix
    counts = _calls_in_graph.setdefault(tf.compat.v1.get_default_graph(), {})
    key = (prefix, tuple(getattr(process_set, "ranks", None) or ()))
    k = counts.get(key, 0)
    counts[key] = k + 1
    return f"{prefix}#{k}" if k else prefix


def _may_be_differentiated() -> bool:
    """Whether the reduced gradients may be differentiated: while a tape records (eagerly), always in a graph
    (a function may be differentiated by the tape it is called under). Eagerly without a tape the reduction
    skips ``tf.custom_gradient`` (an identity op per gradient)."""
    if not tf.executing_eagerly():
        return True
    try:
        from tensorflow.python.eager import record  # noqa: PLC0415
    except ImportError:  # (a TensorFlow that moved it: differentiable always)
        return True
    return record.could_possibly_record()


def _host_only() -> bool:
    """True without a GPU: there ``_ordering`` makes each gradient's submit run when it exists."""
    return not tf.config.list_logical_devices("GPU")


_NONE, _SINGLE, _BUCKET, _ABSENT, _VACANT, _MARKED, _ROWS = ("none", "single", "bucket", "absent", "vacant", "marked",
                                                             "rows")  # (how a gradient travels)


# In a graph, bucket gradients that backprop makes one after the other share one submit op, up to this many
# bytes or gradients: the op (a numpy_function, ~40 us) costs more than copying 256 KiB, and a group holds
# back its first gradient only while backprop makes the others (small ones: little compute).
GROUP_BYTES = 256 << 10
GROUP_MAX = 16

# A gradient of at least this many bytes that no rank had in a step (an embedding table nobody looked up) leaves the
# buckets for good and travels as an embedding's from then on (``_buckets.SourceBuckets._unused``): None costs two
# allgathers of nothing instead of its size in zeros. Before it has had a gradient anywhere nothing tells a table from
# a dense kernel (both are None in the first step), so the first such step still sends it in its bucket. Smaller
# ones stay in their buckets: there their zeros cost less than two more requests a step (at 10 GB/s 64 KiB is ~7 us
# on the wire, below one collective's latency), and a small variable unused once and later dense stays allreduced.
UNUSED_OUT_BYTES = 64 << 10


class _Gradient(NamedTuple):
    """One gradient of a reduction."""

    kind: str  # _NONE: no gradient; _SPARSE: IndexedSlices, allgathered; _SINGLE: dense, of a shape unknown
    # while tracing, reduced on its own; _BUCKET: dense, in its bucket; _ABSENT: None on this rank, in its bucket
    # (zeros, and a 0 in its presence element), which other ranks may have; _VACANT: None on this rank, of a
    # gradient it has had as IndexedSlices: allgathered empty (see _kinds); _MARKED: IndexedSlices of one in a bucket;
    # _ROWS: dense here, of one out of the buckets: allgathered as every row
    tensor: object  # what travels (densified with sparse_as_dense)
    spec: ParamSpec  # its name and priority, and for a _BUCKET gradient its place in the buckets


class GradientReducer:
    """Reduces a list of gradients (``None`` entries stay ``None``) across ranks."""

    def __init__(self, prefix: str, compression=Compression.none, sparse_as_dense: bool = False, op=Average,
                 gradient_predivide_factor: float = 1.0, process_set=None, what: str = "DistributedGradientTape"):
        # over the ranks of process_set; a rank outside it keeps its own gradients (Horovod's behaviour)
        self.process_set = None if process_set is global_process_set else process_set
        self.prefix = prefix
        as_compressor(compression)  # (its error now, also when switched off; the first step would raise it)
        self.compression, self.sparse_as_dense = compression, bool(sparse_as_dense)
        self.op, self.prescale, self.postscale = aiacc.gradient_factors(op, gradient_predivide_factor, what,
                                                                        adasum=True)
        self.adasum, self.what = self.op == Adasum, what
        self._backward: Optional[GradientReducer] = None  # reduces the gradients of the reduced gradients
        # a None gradient of a variable (of a known shape and a float dtype) goes in its bucket as absent: the average
        # of the ranks that have it (zeros from the others), None where no rank has it (not for jacobians: their
        # shapes are not the sources')
        self.presence = not self.adasum
        if self.adasum and aiacc.is_initialized() and not aiacc.outside_process_set(self.process_set):
            check_ranks(_set_size(self.process_set), f"{what}(op=Adasum)")  # now, not at the first step

    def _gradient(self, prefix: str, i: int, g, source, n: int, seen: dict) -> _Gradient:
        name = f"{prefix}.{i}{_label(source)}"
        priority = registration_priority(i, n)
        outside = outside_spec(name, priority)  # in no bucket: only its name counts
        wire = seen.get((i, WIRE))  # (left the buckets unused: the dtype every rank sends, see _buckets._unused)
        if wire is not None and g is not None and not self.sparse_as_dense:
            g = _cast(g, wire)
        if g is None and seen.get(i) == _SPARSE and not self.sparse_as_dense:
            empty = empty_slices(source, wire)
            if empty is not None:
                return _Gradient(_VACANT, empty, outside)
        if g is None:
            spec = self._absent_spec(name, source, priority) if self.presence else None
            if spec is not None and isinstance(seen.get(i), np.dtype):  # (the dtype it had here: see _kinds)
                spec = spec._replace(dtype=seen[i])
            if spec is not None:
                seen.setdefault(i, spec.dtype)  # (in a bucket: IndexedSlices later is marked there, see _kinds)
            if spec is None:
                return _Gradient(_NONE, None, outside_spec(name, priority, "none"))
            return _Gradient(_ABSENT, None, spec)
        if seen.get(i) == _SPARSE and not isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense:
            return _Gradient(_ROWS, every_row(g), outside)  # dense here, out of the buckets (see _kinds)
        if isinstance(g, tf.IndexedSlices) and self.sparse_as_dense:
            g = tf.convert_to_tensor(g)
            shape = getattr(source, "shape", None)
            if not g.shape.is_fully_defined() and shape is not None and shape.is_fully_defined():
                g = tf.ensure_shape(g, shape)  # densified: the variable's shape, so that it goes in a bucket
        if isinstance(g, tf.IndexedSlices):
            if self.adasum:  # (Horovod's error, in the wrapper's name)
                raise NotImplementedError(f"{self.what}(op=Adasum): gradient {name!r} is a tf.IndexedSlices; Adasum "
                                          "combines dense gradients only: pass sparse_as_dense=True")
            if isinstance(seen.get(i), np.dtype) and self.presence:  # in a bucket so far: marked there (see _kinds)
                spec = self._absent_spec(name, source, priority)
                if spec is not None:
                    return _Gradient(_MARKED, g, spec._replace(dtype=seen[i]))
            seen[i] = _SPARSE
            return _Gradient(_SPARSE, g, outside)  # op is Average or Sum, as allgathers need
        g = tf.convert_to_tensor(g)
        check_dtype(g, name)
        if self.adasum or not g.shape.is_fully_defined():
            return _Gradient(_SINGLE, g, outside_spec(name, priority, "single"))
        if isinstance(seen.get(i), np.dtype) and seen[i] != _numpy_dtype(g.dtype):
            g = tf.cast(g, seen[i])  # another dtype here now: its bucket's (see _kinds)
        seen[i] = _numpy_dtype(g.dtype)
        return _Gradient(_BUCKET, g, ParamSpec(name, tuple(g.shape.as_list()), seen[i], devices.CPU, priority))

    @staticmethod
    def _absent_spec(name: str, source, priority: float) -> Optional[ParamSpec]:
        """The bucket place of a None gradient of ``source``: the variable's shape and dtype, as its gradient would
        have on another rank; None where they are not known (a tensor of unknown shape, no float dtype)."""
        shape, dtype = getattr(source, "shape", None), getattr(source, "dtype", None)
        try:
            shape, dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
        except (TypeError, ValueError):
            return None
        if not shape.is_fully_defined() or not dtype.is_floating:
            return None
        return ParamSpec(name, tuple(shape.as_list()), _numpy_dtype(dtype), devices.CPU, priority)

    @tf.autograph.experimental.do_not_convert  # plain Python while a function is traced (AutoGraph warned)
    def __call__(self, grads: Sequence, sources: Sequence) -> List:
        if aiacc.outside_process_set(self.process_set):
            return list(grads)
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        if not dense or not _may_be_differentiated():
            return self._reduce(grads, sources)
        # Differentiable (a gradient penalty differentiates the reduced gradients, Horovod's ops have gradients):
        # the adjoint of a reduction with Average or Sum and its factors is the same reduction of the upstream
        # gradients, done by a second reducer of its own names. IndexedSlices gradients stay constants.
        out: List = []

        @tf.custom_gradient
        def reduce(*xs):
            full = list(grads)
            for i, x in zip(dense, xs):
                full[i] = x
            out.extend(self._reduce(full, sources))

            def grad(*dys):
                _differentiable(self.op, f"the gradients of {self.what} {self.prefix!r}")
                if self._backward is None:
                    self._backward = GradientReducer(f"{self.prefix}.grad", self.compression, False, self.op, 1.0,
                                                     self.process_set, self.what)
                    self._backward.prescale, self._backward.postscale = self.prescale, self.postscale
                return self._backward([tf.zeros_like(xs[k]) if dy is None else dy for k, dy in enumerate(dys)],
                                      [sources[i] if i < len(sources) else None for i in dense])

            return [out[i] for i in dense], grad

        for i, y in zip(dense, reduce(*[grads[i] for i in dense])):
            out[i] = y
        return out

    def _reduce(self, grads: Sequence, sources: Sequence) -> List:
        n = len(grads)
        on_set = _set_kwargs(self.process_set)
        prefix = _call_prefix(self.prefix, self.process_set)
        # (and the sources' dtypes: a float64 model's reduction after a float32 one took its record, summed in float32)
        labels = tuple((_label(s), str(getattr(s, "dtype", ""))) for s in sources[:n]) + ("",) * (n - len(sources))
        seen = seen_for((prefix, getattr(self.process_set, "process_set_id", 0), labels))
        # a gradient out of the buckets new to the record is in its first step (see _kinds.first_out); a traced one may
        # be (the record is written while tracing, and tf.function traces twice where the first trace made variables)
        known = set(seen) if tf.executing_eagerly() else set()
        gradients = [self._gradient(prefix, i, g, sources[i] if i < len(sources) else None, n, seen)
                     for i, g in enumerate(grads)]
        outside = [i for i, gr in enumerate(gradients) if gr.kind not in (_BUCKET, _ABSENT, _MARKED)]
        absent = [i for i, gr in enumerate(gradients) if gr.kind == _ABSENT]
        own = [] if self.adasum else [i for i, gr in enumerate(gradients) if gr.kind in (_SINGLE, _NONE)]
        buckets = None
        if len(outside) < n or first_out([gr.kind == _SPARSE for gr in gradients], own, known):
            buckets = buckets_for([gr.spec for gr in gradients], outside, self.op, self.prescale, self.postscale,
                                  self.compression, self.process_set, prefix, seen, {
                                      i: sparse_shape(gr.tensor, sources[i] if i < len(sources) else None)
                                      for i, gr in enumerate(gradients) if gr.kind in (_SPARSE, _VACANT)},
                                  0 if self.sparse_as_dense or not self.presence else UNUSED_OUT_BYTES, self.what)
        batch = Batch(_SourceLabels([gr.spec.label for gr in gradients], sources))
        if buckets is not None and len(outside) == n:  # (all out of the buckets here: the first step's check, and
            batch.join(buckets)  # another rank's buckets if it has some of them in buckets, need this rank)
        taken = [()] * n  # per gradient: the indices of its submits in the batch
        if absent:  # (before any gradient goes in: their buckets say they are absent here)
            for i, at in zip(absent, batch.absent(buckets, absent, [tf.as_dtype(gradients[i].spec.dtype)
                                                                    for i in absent],
                                                  [gradients[i].spec.shape for i in absent])):
                taken[i] = (at,)
        group: List[int] = []  # consecutive bucket gradients not handed over yet: one submit op (in a graph)
        group_bytes = 0

        def flush():
            nonlocal group_bytes
            if group:
                for j, at in zip(group, batch.ready(buckets, group, [gradients[j].tensor for j in group],
                                                          [gradients[j].spec.label for j in group], absent)):
                    taken[j] = (at,)
                group.clear()
                group_bytes = 0

        vacant = [i for i, gr in enumerate(gradients) if gr.kind == _VACANT]  # (first: nothing to wait for)
        for i in vacant + _backprop_order(grads):
            kind, g, spec = gradients[i]
            name, priority = spec.label, spec.priority
            if kind == _BUCKET:
                group.append(i)
                group_bytes += int(np.prod(spec.shape)) * spec.dtype.itemsize
                if len(group) >= GROUP_MAX or group_bytes >= GROUP_BYTES:
                    flush()
                continue
            flush()
            if kind == _MARKED:
                had = tf.concat([tf.cast(g.indices, tf.int64), tf.constant([_HAD], tf.int64)], 0)
                taken[i] = (batch.ready_sparse(buckets, i, g.values, had, name, absent),)
            elif kind in (_SPARSE, _VACANT, _ROWS):  # indices as int64 on the wire (a rank without it knows no dtype)
                values, indices = tf.convert_to_tensor(g.values), tf.cast(g.indices, tf.int64)
                if kind != _VACANT:  # (this rank had it: see _kinds)
                    indices = tf.concat([indices, tf.constant([_DENSE if kind == _ROWS else _HAD], tf.int64)], 0)
                taken[i] = (batch.submit(Collective.ALLGATHER, [values], f"{name}.values", [[None] + values.shape[1:]],
                                         priority=priority, **on_set),
                            batch.submit(Collective.ALLGATHER, [indices], f"{name}.indices", [[None]],
                                         priority=priority, vacant=name if kind == _VACANT else "", **on_set))
            else:
                taken[i] = (batch.submit(Collective.ALLREDUCE, [g], name, [g.shape], op=self.op, prescale=self.prescale,
                                         postscale=self.postscale, compression=self.compression, priority=priority,
                                         **on_set),)
        flush()
        results = batch.collect(in_submit_order=_host_only())
        seen.update({(i, OWN): True for i in own})  # (once its first step went through: see _kinds.first_out)
        out = list(grads)
        for i, (gr, where) in enumerate(zip(gradients, taken)):
            if gr.kind in (_ABSENT, _MARKED, _BUCKET) and len(results[where[0]]) == 2:  # out of its bucket (_kinds)
                values, indices = results[where[0]]
                kept = indices >= 0
                if gr.kind == _ABSENT and bool(tf.reduce_all(kept)):  # (eagerly: in a graph its result has 1 array)
                    continue  # no rank had it
                indices, shape = tf.boolean_mask(indices, kept), tf.constant(gr.spec.shape, tf.int64)
                if gr.kind == _MARKED:
                    indices, shape = tf.cast(indices, gr.tensor.indices.dtype), gr.tensor.dense_shape
                out[i] = tf.IndexedSlices(values, indices, dense_shape=shape)  # (scaled: see _buckets._gather)
            elif gr.kind in (_SPARSE, _VACANT, _ROWS):
                marks = results[where[1]][0]
                kept = marks >= 0
                if gr.kind == _VACANT and (not batch.eager or bool(tf.reduce_all(kept))):
                    continue  # no rank had it (eagerly), or None when traced (a graph: the wait checked the rest)
                values = scale_gathered(results[where[0]][0], self.op, self.prescale, self.postscale, self.process_set)
                values, indices = merge_rows(values, tf.boolean_mask(marks, kept), marks, gr.tensor.dense_shape[0])
                if gr.kind == _SPARSE:
                    indices = tf.cast(indices, gr.tensor.indices.dtype)
                out[i] = tf.IndexedSlices(values, indices, dense_shape=gr.tensor.dense_shape)
            elif where and (gr.kind != _ABSENT or batch.eager):  # (in a graph a gradient None here stays None)
                out[i] = results[where[0]][0]
        return out


def reduce_except_local(reducer, grads: list, sources: list, local: Optional[dict], scale_local: bool) -> list:
    """``reducer(grads, sources)``, except that the gradients of sources in ``local`` (by ``id``) stay on
    this rank, divided by the number of ranks where ``scale_local`` (Horovod's local variables and
    layers: ``register_local_source``, ``PartialDistributed*``)."""
    if not local:
        return reducer(grads, sources)
    shared = [i for i, s in enumerate(sources) if id(s) not in local]
    flat = list(grads)
    for i, g in zip(shared, reducer([grads[i] for i in shared], [sources[i] for i in shared])):
        flat[i] = g
    if scale_local:
        n = float(_set_size(reducer.process_set))
        for i in set(range(len(flat))) - set(shared):
            g = flat[i]
            if isinstance(g, tf.IndexedSlices):
                flat[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
            elif g is not None:
                flat[i] = g / n
    return flat


def local_layer_variables(local_layers, who: str) -> list:
    """The trainable variables of ``local_layers`` (a Keras layer, a list of them, or None)."""
    import keras  # noqa: PLC0415 - only the partial wrappers need Keras

    from .keras._keras2 import is_keras2_layer  # noqa: PLC0415 - Keras 2's (tf.keras with TF_USE_LEGACY_KERAS=1)

    def is_layer(layer):
        return isinstance(layer, keras.layers.Layer) or is_keras2_layer(layer)

    if local_layers is None:
        return []
    if is_layer(local_layers):
        local_layers = [local_layers]
    elif not all(is_layer(layer) for layer in local_layers):
        raise ValueError(f"{who}: every local layer must be a keras.layers.Layer")
    return [variable for layer in local_layers for variable in layer.trainable_weights]


class _DistributedTape:
    """Mixed into the user's tape class: ``gradient`` returns gradients averaged across ranks."""

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE, use_generic_names=False):
        # Horovod's fourth argument is use_generic_names (its tape has no unconnected_gradients): a bool there is
        # that. It names Horovod's ops by position; aiacc's gradient buckets are named so always.
        if isinstance(unconnected_gradients, bool):
            unconnected_gradients = tf.UnconnectedGradients.NONE
        zero = tf.UnconnectedGradients(unconnected_gradients) == tf.UnconnectedGradients.ZERO
        # ZERO: the zeros are made here. TensorFlow makes them of the source's dtype, which a Keras variable
        # (model.trainable_variables) gives as a string: its gradient() failed with "AttributeError: 'str' object
        # has no attribute '_type_enum'", so the remedy for a layer used on some ranks only did not run
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=tf.UnconnectedGradients.NONE if zero else unconnected_gradients)
        if zero:
            grads = tf.nest.pack_sequence_as(grads, [_zeros_like(s) if g is None else g for g, s in zip(
                tf.nest.flatten(grads), tf.nest.flatten(sources))])
        if getattr(self, "_aiacc_undistributed", False):
            return grads
        # (at the second call for these sources, the ranks' variables are compared once: _same_start; traced, in the
        # reduction's wait)
        hook = tape_hook(self, self._aiacc_reducer, sources)
        with after_graph_wait(hook):
            grads = self._aiacc_reduce(self._aiacc_reducer, grads, sources)
        return tape_step(self, self._aiacc_reducer, grads, sources, hook)

    def _aiacc_reduce(self, reducer, grads, sources):
        flat = reduce_except_local(reducer, tf.nest.flatten(grads), tf.nest.flatten(sources),
                                   getattr(self, "_aiacc_local", None), self._aiacc_scale_local)
        return tf.nest.pack_sequence_as(grads, flat)

    # TensorFlow's jacobians call gradient() once per row inside pfor, which cannot vectorize aiacc's graph ops
    # (a ValueError about a TensorDataset). Each row averaged is the whole jacobian averaged (Horovod's result),
    # so the tape's own jacobian is computed first and reduced once.
    def jacobian(self, target, sources, *args, **kwargs):
        return self._aiacc_reduce(self._aiacc_jacobian_reducer(), self._aiacc_local_only(
            super().jacobian, target, sources, *args, **kwargs), sources)

    def batch_jacobian(self, target, source, *args, **kwargs):
        return self._aiacc_reduce(self._aiacc_jacobian_reducer(), self._aiacc_local_only(
            super().batch_jacobian, target, source, *args, **kwargs), source)

    def _aiacc_local_only(self, method, *args, **kwargs):
        self._aiacc_undistributed = True
        try:
            return method(*args, **kwargs)
        finally:
            self._aiacc_undistributed = False

    def _aiacc_jacobian_reducer(self) -> GradientReducer:
        """The tape's reducer under names of its own (a jacobian has other shapes than the gradients)."""
        if getattr(self, "_aiacc_jacobians", None) is None:
            self._aiacc_jacobians = copy.copy(self._aiacc_reducer)
            self._aiacc_jacobians.prefix = f"{self._aiacc_reducer.prefix}.jacobian"
            self._aiacc_jacobians._backward = None
            self._aiacc_jacobians.presence = False  # (a jacobian's shape is not its source's)
        return self._aiacc_jacobians

    def register_local_source(self, source) -> None:
        """Keep the gradient of ``source`` (a variable) on this rank: it is not sent, and ``gradient``
        returns it divided by the number of ranks (``scale_local_gradients=False``: unchanged)."""
        if getattr(self, "_aiacc_local", None) is None:
            self._aiacc_local = {}
        self._aiacc_local[id(source)] = source  # held, so that its id is not reused

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``gradient()``, split into ([(local source, gradient)], [(other source, gradient)])."""
        grads = self.gradient(target, sources, output_gradients=output_gradients, use_generic_names=use_generic_names)
        local = getattr(self, "_aiacc_local", None) or {}
        pairs = list(zip(sources, grads))
        return [p for p in pairs if id(p[0]) in local], [p for p in pairs if id(p[0]) not in local]


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True, name=None):
    """A tape whose ``gradient()`` averages the gradients across ranks (Horovod's API).

    Use after the ``with tf.GradientTape() as tape:`` block::

        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    ``tape.register_local_source(variable)`` keeps that variable's gradient on its rank (not sent; divided by
    the number of ranks unless ``scale_local_gradients=False``), as Horovod does for model-parallel layers.
    ``process_set``: average over its ranks only; a rank outside it keeps its own gradients (Horovod's
    behaviour).

    ``compression``: ``hvd.Compression.fp16``/``bf16`` on the wire. ``sparse_as_dense``: reduce
    IndexedSlices gradients (embeddings) densely instead of allgathering them. ``op``: Average (default),
    Sum, or Adasum: each dense gradient combined with Adasum on its own, outside the buckets (Horovod's
    TensorFlow 2 behaviour; floating-point CPU gradients, a power-of-2 number of ranks, IndexedSlices
    only with ``sparse_as_dense``). ``gradient_predivide_factor``: divide by this before the sum and by ``size/factor`` after it.
    ``name``: prefix of the engine's tensor names (give each tape its own when a step uses several).
    Dense gradients travel in gradient buckets of up to ``AIACC_BUCKET_CAP`` bytes, one set per list of
    sources; the results are views of the buckets (see ``aiacc.tensorflow._buckets`` for their lifetime).
    ``device_dense``, ``device_sparse``, ``num_groups`` and ``groups`` are accepted for Horovod
    compatibility (``aiacc.check_groups``: Horovod's checks); the buckets group gradients by size. With aiacc disabled (``AIACC_ENABLE`` unset/0)
    this returns ``gradtape`` itself.
    """
    if not isinstance(gradtape, tf.GradientTape):  # (on and off alike; it was an AttributeError on '__dict__')
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, not {type(gradtape).__name__}")
    aiacc.check_groups(num_groups, groups, "DistributedGradientTape")
    reducer = GradientReducer(name or "DistributedGradientTape", compression, sparse_as_dense, op,
                              gradient_predivide_factor, process_set)
    aiacc.api.check_process_set(reducer.process_set, "DistributedGradientTape")  # (made each step: checked now)
    if aiacc.switched_off("DistributedGradientTape"):
        return gradtape
    cls = mixin_class(_DistributedTape, type(gradtape), __name__)
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    # wrapped inside its ``with`` block, the copy is not the tape the block pops: it records nothing itself (as
    # Horovod's new tape on the same recording), else its gradient() popped the recording again (a segfault)
    tape._recording = False
    tape._aiacc_reducer = reducer
    tape._aiacc_scale_local = bool(scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True, name=None):
    """:func:`DistributedGradientTape` whose ``gradient()`` keeps the gradients of ``local_layers`` (a Keras
    layer or a list of them) on each rank: their trainable variables are registered as local sources."""
    local = local_layer_variables(local_layers, "PartialDistributedGradientTape")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients,
                                   name)
    if tape is not gradtape:
        for variable in local:
            tape.register_local_source(variable)
    return tape
