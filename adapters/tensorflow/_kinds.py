"""How each rank last had each gradient of a reduction, so that a gradient whose kind or dtype varies across ranks or
steps travels as the other ranks' do (``GradientReducer``'s part; see ``_buckets`` for the buckets' side).

The buckets of a reduction are found by what its gradients are (``_buckets.buckets_for``), and a None gradient goes in
them as the variable's shape and dtype. Gradients differ from that in kind (an embedding's IndexedSlices stays out of
the buckets, allgathered) or dtype (cast by the user before Keras' apply_gradients, float16 to halve the bytes), and a
rank whose gradient was of another kind or dtype than another rank's set other buckets up while the others sent their
old ones: every rank waited until the stall inspector. So each rank remembers, per reduction (its names' prefix,
process set and gradients' names), how it last had each gradient (``seen``: index -> ``SPARSE``, or the numpy dtype it
has in its bucket), and from the second step on:

- None, last IndexedSlices: an empty IndexedSlices (the same allgathers as the other ranks');
- None, last in a bucket: in its bucket as that dtype (zeros, and a 0 in its presence element);
- dense, last IndexedSlices (the gradient is out of the buckets): every row as IndexedSlices (``every_row``);
- dense of another dtype than its bucket's: cast to the bucket's (a new cast on one rank only; the result has the
  bucket's dtype on every rank, so the ranks apply the same update);
- IndexedSlices, last in a bucket: marked there (``GradientBuckets.sparse``, in the same allreduce, as aiacc.torch's);
  it leaves the buckets on every rank after the wait and is allgathered then (``_buckets.SourceBuckets.ready_sparse``);
  a rank that gave it dense in that step adds its part through the bucket (``_buckets.SourceBuckets._gather``).

Every gathered list of indices carries a mark from each rank that had the gradient (``HAD``; ``DENSE`` where it was
dense there), taken out after the gather: a gradient no rank had is None again (eagerly; in a graph it was None when
traced and stays None, and another rank's mark is an error in the wait, as for a dense gradient, see ``_engine``).
Where some rank had it dense, the result is every row once (``merge_rows``), as one process's dense sum (Keras' Adam
steps IndexedSlices with repeated rows otherwise than their sum). In the first step (nothing remembered) a None
gradient's dtype is the variable's, a guess that the buckets' first-step collective replaces with the dtype of the
ranks that had it (``GradientBuckets.guess_dtype``), and an embedding None on some ranks and IndexedSlices on others
is allgathered after it (``_buckets.SourceBuckets._check_kinds``); so is one dense on some ranks and IndexedSlices on
others there, the dense ranks sending every row with a ``DENSE`` mark, once one more collective has checked that the
ranks have it of the same dtype and shape (``sparse_shape``: the IndexedSlices ranks'; ``_check_mixed``).
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

import tensorflow as tf

from ._buckets import DENSE, HAD, SPARSE

__all__ = ["seen_for", "empty_slices", "every_row", "merge_rows", "sparse_shape", "first_out", "HAD", "DENSE", "SPARSE",
           "OWN"]

OWN = "own"  # ``seen[(i, OWN)]``: gradient i went through a first step reduced on its own here (see ``first_out``)

_SEEN: "collections.OrderedDict[tuple, dict]" = collections.OrderedDict()
_SEEN_SIZE = 64  # reductions remembered; the least recently used is dropped


def seen_for(key: tuple) -> dict:
    """How this rank last had each gradient of one reduction: index -> SPARSE, or the numpy dtype it has in its
    bucket."""
    found = _SEEN.get(key)
    if found is None:
        found = _SEEN[key] = {}
        while len(_SEEN) > _SEEN_SIZE:
            _SEEN.popitem(last=False)
    else:
        _SEEN.move_to_end(key)
    return found


def empty_slices(source, dtype=None) -> Optional[tf.IndexedSlices]:
    """An IndexedSlices gradient of ``source`` with no rows (what a rank without it sends), of ``dtype`` (default: the
    source's); None where its shape past the first dimension or its dtype is not known."""
    shape, dtype = getattr(source, "shape", None), getattr(source, "dtype", None) if dtype is None else dtype
    try:
        shape, dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
    except (TypeError, ValueError):
        return None
    if shape.rank is None or shape.rank < 1 or not shape[1:].is_fully_defined() or not dtype.is_floating:
        return None
    dense_shape = tf.constant(shape.as_list(), tf.int64) if shape.is_fully_defined() else tf.shape(
        tf.convert_to_tensor(source), out_type=tf.int64)
    return tf.IndexedSlices(tf.zeros([0] + shape[1:].as_list(), dtype), tf.zeros([0], tf.int64), dense_shape)


def every_row(g) -> tf.IndexedSlices:
    """A dense gradient as IndexedSlices of every row (of a gradient out of the buckets: see the module's doc)."""
    g = tf.convert_to_tensor(g)
    shape = tf.shape(g, out_type=tf.int64)
    return tf.IndexedSlices(g, tf.range(shape[0]), shape)


def merge_rows(values, indices, marks, rows):
    """Gathered ``values`` and their ``indices`` (the marks taken out); where ``marks`` (the gathered indices) hold a
    ``DENSE`` mark, every one of ``rows`` rows once instead, the sum of its slices. Returns (values, indices)."""
    def merged():
        return (tf.math.unsorted_segment_sum(values, indices, rows),
                tf.range(tf.cast(rows, indices.dtype), dtype=indices.dtype))

    dense = tf.reduce_any(tf.equal(marks, DENSE))
    if tf.executing_eagerly():
        return merged() if bool(dense) else (values, indices)
    return tf.cond(dense, merged, lambda: (values, indices))


def sparse_shape(g: tf.IndexedSlices, source) -> tuple:
    """(numpy dtype, shape) of an IndexedSlices gradient ``g`` of ``source`` as known without running it (the
    variable's static shape, else ``g``'s constant dense_shape; None for an unknown dimension, or shape), for the
    first step's check of a gradient dense on other ranks (``_buckets.SourceBuckets._check_mixed``)."""
    shape = tf.TensorShape(getattr(source, "shape", None))
    if not shape.is_fully_defined():
        static = tf.get_static_value(g.dense_shape)
        shape = shape if static is None else tf.TensorShape([int(d) for d in static])
    return g.values.dtype.as_numpy_dtype, None if shape.rank is None else tuple(shape.as_list())


def first_out(sparse: Sequence[bool], own: Sequence[int], known: set) -> bool:
    """Whether a gradient of a reduction that is out of the buckets on this rank is in its first step, so that a rank
    with no bucket at all still registers its sources and meets the buckets' first-step collective (``Batch.join``),
    which another rank with some of them in buckets waits in (else both waited until the stall inspector), and which
    checks on every rank that the kinds and the tables' shapes agree (``_buckets.SourceBuckets._check_kinds``).
    ``sparse``: per gradient, IndexedSlices here; ``own``: those reduced on their own here (dense of a shape unknown
    while traced, None of a source of unknown shape), marked ``(i, OWN)`` in the record once their first step went
    through; ``known``: the record's keys before this step (eagerly; empty in a graph, where this runs once per trace:
    the wait skips settled buckets). After the first step it is False: no cost, no collective."""
    return any(s and i not in known for i, s in enumerate(sparse)) or any((i, OWN) not in known for i in own)
