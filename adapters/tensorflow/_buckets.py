"""The gradients of a list of sources (variables) in the core's buckets: the numpy side.

A ``DistributedGradientTape`` or Keras ``DistributedOptimizer`` knows what it differentiates. Each list
of sources (their names, shapes and dtypes, and which of their gradients are dense) is registered once
with the core's bucket layer (:class:`aiacc.buckets.GradientBuckets`): the first step learns the order in
which the gradients arrive and settles the buckets in its wait (a collective that also checks that every
rank has the same sources). Per step, per gradient and per bucket::

    TF gradient ──► submit op: ready(i, array)   one numpy copy into its slot in a bucket; the bucket's
                                                 last gradient sends the bucket as ONE request
    wait op:   buckets.wait() ──► result(i)      a view of the reduced bucket memory, 64-byte aligned,
                                                 which TensorFlow adopts without a copy

so a gradient is copied once per step (TensorFlow computes it into memory of its own) and the engine's
work follows the number of buckets (``AIACC_BUCKET_CAP``), not of gradients.

Lifetime of the results. They are views of the buckets, which the next step's gradients overwrite. In a
``tf.function`` step (``model.fit``, a compiled custom loop) the results are consumed by the optimizer
within the same call, and TensorFlow has let go of them when the next step's first submit runs
(``numpy_function`` drops the arrays of freed tensors before it calls Python). A caller may still hold
them (an eager loop's ``grads`` is rebound only after the next ``gradient()`` returns; a function may
return them). So each result is a fresh numpy view, watched by a weak reference; a gradient whose last
result is still alive when its next gradient goes in first moves its bucket to new memory
(``GradientBuckets.renew``, one copy of that bucket), and the old memory stays with whoever holds it.
Results are never overwritten under their holder, and the usual step pays no copy out.

One object per list of sources is kept in a small table (by the sources' names, shapes, dtypes and
gradient kinds, and the reduction's options), so a tape built anew every step finds its buckets again.
Two gradient calls over the same list must not be in flight at once: in one traced function the reducer
names each further call under the same prefix apart (``gradients._call_prefix``), so two tapes or a
persistent tape asked twice get buckets of their own; eagerly each call is done before the next starts.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import List, Optional, Sequence, Tuple

import numpy as np

import aiacc
from aiacc import devices
from aiacc.buckets import GradientBuckets, ParamSpec, check_same_gradients
from aiacc.compression import as_compressor
from aiacc.names import BUCKET_SETUP_PREFIX
from aiacc.ops import Collective, ReduceOp
from aiacc.tensors import dtype_name
from aiacc.exceptions import TensorMismatchError

__all__ = ["SourceBuckets", "buckets_for", "outside_spec", "SPARSE", "HAD", "DENSE", "WIRE"]

SPARSE = "sparse"  # what a reduction's ``seen`` (``_kinds``) holds for a gradient that travels sparse
HAD, DENSE = -1, -2  # the marks a rank adds to a gathered list of indices: it had the gradient sparse; dense, in the
# bucket it left this step (see ``_kinds``)
WIRE = "wire"  # ``seen[(i, WIRE)]``: the dtype in which every rank sends gradient i, which left the buckets unused

_TABLE_SIZE = 32  # lists of sources kept; the least recently used is dropped (traced functions keep theirs)
_table: "collections.OrderedDict[tuple, SourceBuckets]" = collections.OrderedDict()
_table_lock = threading.Lock()
# (setup, process set id) -> the set of sources this rank stepped last under that reduction's name (see
# ``SourceBuckets._retire_previous``)
_current: dict = {}


# how a gradient in no bucket travels, told by the shape of its placeholder spec (see ``outside_spec``)
_OUT_SHAPES = {SPARSE: (), "single": (0,), "none": (0, 0)}
_OUT_KINDS = {(): "IndexedSlices", (0,): "dense of a shape unknown while traced",
              (0, 0): "None, of a source of unknown shape"}


def outside_spec(label: str, priority: float, how: str = SPARSE) -> ParamSpec:
    """The spec of a gradient in no bucket: only its name counts, and how it travels, which the ranks compare in the
    first step (``SourceBuckets._check_kinds``): ``SPARSE`` (IndexedSlices, allgathered), ``"single"`` (dense of a
    shape unknown while traced: allreduced on its own) or ``"none"`` (None of a source of unknown shape: not sent)."""
    return ParamSpec(label, _OUT_SHAPES[how], np.dtype(np.float32), devices.CPU, priority)


def buckets_for(specs: Sequence[ParamSpec], excluded: Sequence[int], op, prescale: float, postscale: float,
                compression, process_set=None, setup: str = "", seen: Optional[dict] = None,
                sparse_shapes: Optional[dict] = None, unused_out: int = 0, what: str = "") -> "SourceBuckets":
    """The buckets of these sources (``excluded``: indices whose gradients go in no bucket), on the engine
    of ``process_set`` (default: the job's). ``setup``: what names the first step's collective, the same on
    every rank whatever its sources (the reduction's prefix, see ``SourceBuckets``). ``seen``: the reduction's
    record of how its gradients travel (``_kinds``), told of those that leave the buckets. ``sparse_shapes``: index ->
    (numpy dtype, shape) of the variable of each IndexedSlices gradient (``_kinds.sparse_shape``), for the first step's
    check of one dense on other ranks (``SourceBuckets._check_mixed``). ``unused_out``: a gradient of at least
    this many bytes (0: none) that no rank had in a step leaves the buckets (``SourceBuckets._unused``). ``what``: the
    wrapper, named in the error of a rank that changes its sources alone (``SourceBuckets._retire_previous``)."""
    # (compression as the core's singleton: hvd.Compression.none and the default are equal, and a key that differed
    # on one rank only made that rank alone set its buckets up again, a collective the others never joined)
    key = (tuple(specs), tuple(excluded), int(op), float(prescale), float(postscale), as_compressor(compression),
           getattr(process_set, "process_set_id", 0), setup)
    with _table_lock:
        found = _table.get(key)
        if found is None:
            # presence: a gradient None on some ranks only is zeros there, and None where no rank had it
            options = dict(op=op, prescale=prescale, postscale=postscale, compression=compression,
                           presence=ReduceOp(int(op)) in (ReduceOp.AVERAGE, ReduceOp.SUM))
            found = _table[key] = SourceBuckets(specs, excluded, options, process_set, setup, what)
            found.key = key
            while len(_table) > _TABLE_SIZE:
                _table.popitem(last=False)
        else:
            _table.move_to_end(key)
        if seen is not None:
            found.seen = seen
        if sparse_shapes is not None:
            found.sparse_shapes = sparse_shapes
        found.unused_out = int(unused_out)
        return found


def _left(found: "SourceBuckets", left: Sequence[int], dtypes: Optional[dict] = None) -> None:
    """Gradients ``left`` of ``found`` left its buckets for good (IndexedSlices on some rank, see ``SourceBuckets``),
    and gradients ``dtypes`` (index -> numpy dtype) that this rank had none of in the first step are in them as the
    dtype of the ranks that had them: its reduction's record says how they travel, and ``found`` is also the buckets
    of the key under which the next steps look them up, so that no rank sets buckets up again alone."""
    for i in left:
        found.seen[i] = SPARSE
    specs, excluded = list(found.key[0]), set(found.key[1]) | set(left)
    for i, dtype in (dtypes or {}).items():
        found.seen[i] = dtype
        specs[i] = specs[i]._replace(dtype=dtype)
    for i in left:
        specs[i] = outside_spec(specs[i].label, specs[i].priority)
    found.key = (tuple(specs), tuple(sorted(excluded))) + found.key[2:]
    with _table_lock:
        _table[found.key] = found


class SourceBuckets:
    """The buckets of one list of sources, on the running engine (new buckets if aiacc was restarted).

    Called from TensorFlow's threads (each submit op runs on an inter-op thread): one lock serialises
    them. ``renewed`` counts the buckets moved because a result was still held (a test reads it).
    """

    def __init__(self, specs: Sequence[ParamSpec], excluded: Sequence[int], options: dict, process_set=None,
                 setup: str = "", what: str = ""):
        self.process_set = process_set
        self.setup = setup
        self.what = what or "the reduction"
        self._slot = (setup, getattr(process_set, "process_set_id", 0))  # its key in ``_current``
        self._previous: Optional[SourceBuckets] = None  # (first step) the set this rank stepped under its name before
        self.specs = list(specs)
        self.excluded = frozenset(excluded)
        self.options = options
        self.engine = None
        self.buckets: Optional[GradientBuckets] = None
        self._held: list = [None] * len(self.specs)  # per gradient: a weak reference to its last result
        self._open = False  # a step has handed gradients over and not waited yet
        self._absent_now: frozenset = frozenset()  # the gradients this rank has none of in this step
        self._gone: frozenset = frozenset()  # (after the wait) those no rank had
        self._lock = threading.Lock()
        self.renewed = 0
        self.key: tuple = ()  # (set by buckets_for) its key in the table
        self.seen: dict = {}  # (set by buckets_for) its reduction's record, see ``_left``
        self.unused_out = 0  # (set by buckets_for) see ``_unused``
        self._sparse: dict = {}  # this step: index -> (values, indices) of a gradient given by ``ready_sparse``
        self.gathered: dict = {}  # (after the wait) index -> the gathered (values, indices) of those out of the buckets
        self.sparse_shapes: dict = {}  # (set by buckets_for) see there
        self._first: dict = {}  # the first step (until its wait): index -> the dense gradient given (see _check_mixed)

    def _begin_step(self, absent: Sequence[int] = ()) -> GradientBuckets:
        engine = aiacc.engine_for(self.process_set, self.what)
        if self.buckets is None or engine is not self.engine:  # the first step, or aiacc was restarted
            self.engine = engine
            # Named by the reduction's prefix (``gradients._call_prefix``: the k-th reduction of a traced function
            # is the same on every rank), not by a number counted as sets are made (the sets of two tapes in one
            # tf.function are made as their ops run, in an order that differs across ranks) nor by what the set
            # holds: ranks whose lists differ (a layer more on one rank, a sublist) meet in this collective and get
            # the error that says how, at once; named by its first gradient and count they waited for each other
            # until the stall check (60 s).
            self.buckets = GradientBuckets(engine, self.specs, cap=engine.config.bucket_cap,
                                           setup_name=f"{BUCKET_SETUP_PREFIX}{self.setup}", regroup_hint=(
                                               f" ({self.what} {self.setup!r}: freeze, unfreeze or add layers, or change "
                                               "the list of variables, on every rank in the same step)"), **self.options)
            for i in self.excluded:
                self.buckets.exclude(i)
            self._held = [None] * len(self.specs)
        buckets = self.buckets
        previous = _current.get(self._slot)
        if previous is not self:  # (one look a step) another list of sources than the last step's under this name
            _current[self._slot] = self
            self._previous = None if buckets.established else previous
        # this rank has no gradient of ``absent`` this step: zeros in its bucket and a 0 in its presence element
        # (before any bucket goes). Their places hold last step's results: renewed first where still held.
        self._absent_now = frozenset(absent)
        for i in absent:
            if not buckets.established:  # (its dtype is the variable's: the ranks that have it may have cast it)
                buckets.guess_dtype(i)
            else:
                if buckets.excluded(i):  # (IndexedSlices on another rank: the first step's check said so)
                    continue
                self._renew_if_held(buckets, i)
                buckets.view(i).fill(0)
            buckets.absent(i)
        self._open = True
        return buckets

    def _renew_if_held(self, buckets: GradientBuckets, index: int) -> None:
        held = self._held[index]
        if held is not None and held() is not None:  # last step's result is still in use
            for i in buckets.renew(index):
                self._held[i] = None
            self.renewed += 1

    # ---- per gradient: the submit op ---------------------------------------------------------------
    def ready(self, index: int, array: np.ndarray, absent: Sequence[int] = ()) -> None:
        """Gradient ``index`` of this step is ``array`` (TensorFlow's memory): copied into its bucket.
        ``absent``: the gradients this rank has none of in this step (the same in every call of a step)."""
        with self._lock:
            buckets = self.buckets if self._open else self._begin_step(absent)
            if buckets.established and buckets.excluded(index):  # (it left the buckets: a graph traced before)
                rows = np.arange(array.shape[0] if array.ndim else 0, dtype=np.int64)
                self._sparse[index] = (np.array(array), np.append(rows, DENSE))  # (as the reducer sends it now)
                return
            if buckets.established:
                self._renew_if_held(buckets, index)
            else:
                # kept until the first wait settles the buckets; a numpy_function input is TensorFlow's
                # memory, which it may reuse once the op has returned
                array = self._first[index] = np.array(array)
            buckets.ready(index, array)

    def ready_sparse(self, index: int, values: np.ndarray, indices: np.ndarray, absent: Sequence[int] = ()) -> None:
        """Gradient ``index``, in a bucket, is IndexedSlices on this rank this step (``indices`` ending with -1, see
        ``_kinds``): it is marked in its bucket (``GradientBuckets.sparse``), and after the wait it leaves
        the buckets on every rank, and every rank allgathers its slices of it (none where it had none)."""
        with self._lock:
            buckets = self.buckets if self._open else self._begin_step(absent)
            self._sparse[index] = (np.array(values), np.array(indices))  # (TensorFlow's memory: kept past the op)
            if not (buckets.established and buckets.excluded(index)):  # (it left in an earlier step: only gathered)
                if buckets.established:  # zeros in its place: what the bucket sums there is the dense ranks' part
                    self._renew_if_held(buckets, index)
                    buckets.view(index).fill(0)
                buckets.sparse(index)
                buckets.ready(index)

    # ---- per step: the wait op ---------------------------------------------------------------------
    def wait(self, absent: Sequence[int] = ()) -> None:
        """Wait for every bucket (the first step settles them: a collective on every rank). ``absent``: as for
        :meth:`ready` (a step in which this rank has none of the gradients begins here)."""
        with self._lock:
            buckets = self.buckets if self._open else self._begin_step(absent)
            self._open = False
            first = not buckets.established
            given, self._first = self._first, {}
            try:
                if first:
                    self._retire_previous()
                buckets.wait()
            except BaseException:
                if not buckets.established:  # failed before the buckets were settled: start again next step
                    self.buckets = None
                self._sparse = {}
                raise
            # (read after the wait, which resets the marks: the presence elements stay in the buffers)
            left, moved = buckets.leave_sparse()  # (some rank had IndexedSlices of a bucketed one: the same on all)
            for i in moved:
                self._held[i] = None  # (new memory, which nobody holds)
            # what the bucket summed where those were (the ranks that gave them dense: their part), and those this
            # rank gave dense (in the bucket) while another rank marked them
            departed, buckets.departed = buckets.departed, {}
            dense = [i for i in left if i not in self._sparse and i not in self._absent_now]
            self._gone = frozenset(buckets.absent_everywhere())  # (one look per bucket)
            unused = self._unused(buckets)
            if unused:
                for i in buckets.leave(unused):
                    self._held[i] = None
                left = left + unused
            dtypes = {}
            if first:
                try:
                    left += self._check_kinds(buckets, given)
                except TensorMismatchError:
                    self.buckets = None  # (the next step sets up again, and meets the same check)
                    self._sparse = {}
                    raise
                dtypes = {i: np.dtype(buckets.params[i].dtype) for i in self._absent_now if not buckets.excluded(i)
                          and np.dtype(buckets.params[i].dtype) != self.specs[i].dtype}
                for i, dtype in dtypes.items():  # (None here: the dtype of the ranks that had it, see guess_dtype)
                    self.specs[i] = self.specs[i]._replace(dtype=dtype)
            self._gather([i for i in sorted(set(self._absent_now) | set(self._sparse) | set(dense))
                          if buckets.excluded(i) and i not in self.excluded], departed, dense)
            if left or dtypes:
                _left(self, left, dtypes)
            for i in unused:  # (nobody had it: its dtype is the bucket's on every rank, kept on the wire, as there)
                self.seen[(i, WIRE)] = self.specs[i].dtype

    def _retire_previous(self) -> None:
        """(The first step's wait, before the buckets settle.) Where this rank stepped another list of sources under
        this reduction's name before (a layer frozen, unfrozen or built, a variable more or fewer: the tape's sources
        or the optimizer's variables changed), and those buckets are settled, it retires them
        (``GradientBuckets.retire``: they are sent once more, marked), so that a rank that did not change meets the
        mark in its next step's wait: every rank raises an error naming the ranks that changed and those that did
        not, and the gradients, instead of waiting for each other until the stall inspector (the ranks that changed
        set new buckets up, the others sent their old ones). Where every rank changed, to the same list, it costs that
        allreduce and a gather, once; the new buckets' first step follows. Going back to a list already settled (a
        GAN's two tapes under one name, a persistent tape asked for two lists) costs nothing: no first step, no
        retire; there a rank that goes back alone is not told apart from the others' old buckets."""
        previous, self._previous = self._previous, None
        if previous is None or not previous.settled or not previous.buckets.presence:
            return
        previous.buckets.retire([spec.label for spec in self.specs])

    def _unused(self, buckets: GradientBuckets) -> List[int]:
        """The gradients no rank had in this step that leave the buckets for good (every rank read the same presence
        elements, so every rank takes the same out): those of at least ``unused_out`` bytes. From the next step on
        each travels as an embedding's does (``_kinds``): an IndexedSlices of no rows where it is None (two
        allgathers of nothing instead of its size in zeros, every step: an embedding table no rank looks up), its
        slices where it is IndexedSlices, every row where it is dense (allgathered, where a bucket allreduced it: the
        price of a variable unused in a step on every rank and later used densely). In this step its result is
        gathered empty (None eagerly, as before)."""
        if not self.unused_out or not self._gone:
            return []
        return [i for i in sorted(self._gone) if not buckets.excluded(i) and len(self.specs[i].shape) >= 1
                and int(np.prod(self.specs[i].shape)) * self.specs[i].dtype.itemsize >= self.unused_out]

    def _gather(self, indices: Sequence[int], departed: Optional[dict] = None, dense: Sequence[int] = ()) -> None:
        """The gradients ``indices`` of this step, out of the buckets now and given to them as None, IndexedSlices or
        (``dense``: in the bucket they left this step, whose sum there is in ``departed``) dense: each rank allgathers
        its slices (a rank without: none; ``dense``: none and a ``DENSE`` mark), as the reducer allgathers a sparse
        gradient (the same names). ``gathered`` holds the results: the values scaled as the reduction's, and the
        indices with one negative mark per rank that had the gradient; where a rank had it dense, the bucket's sum
        comes first, as every row of the variable."""
        sparse, self._sparse, self.gathered = self._sparse, {}, {}
        kwargs = {} if self.process_set is None or self.process_set is aiacc.global_process_set else {
            "process_set": self.process_set}
        handles = []
        for i in indices:
            spec = self.specs[i]
            values, ids = sparse.get(i) or (np.zeros((0,) + tuple(spec.shape[1:]), spec.dtype),
                                            np.full(int(i in dense), DENSE, np.int64))
            handles.append((i, [aiacc.submit(Collective.ALLGATHER, a, name=f"{spec.label}.{what}",
                                             priority=spec.priority, **kwargs)
                                for a, what in ((values, "values"), (ids, "indices"))]))
        op, pre, post = ReduceOp(int(self.options["op"])), self.options["prescale"], self.options["postscale"]
        factor = float(pre) * float(post) / (self.engine.size if op == ReduceOp.AVERAGE else 1)
        for i, pair in handles:
            values, ids = (h.wait() for h in pair)
            if factor != 1.0:  # (as ``mpi_ops.scale_gathered``: the same float arithmetic)
                values = values * np.asarray(factor, values.dtype)
            if (ids == DENSE).any():  # some rank had it dense: every row once, the sum (see ``_kinds``)
                full = np.zeros(self.specs[i].shape, values.dtype)
                np.add.at(full, ids[ids >= 0], values)
                if i in departed:  # (it left its bucket this step: the dense ranks' part is there, the same on all)
                    full += departed[i].astype(values.dtype, copy=False)
                values, ids = full, np.append(np.arange(full.shape[0], dtype=np.int64), DENSE)
            self.gathered[i] = (values, ids)

    def _check_kinds(self, buckets: GradientBuckets, given: dict) -> List[int]:
        """The first step's gradients in a bucket on some ranks and out of the buckets on others (``given``: the dense
        ones this rank gave, by index). Where the others had IndexedSlices (None on some ranks, dense on others, or
        both), every rank allgathers its part of it after the wait (``_gather``), as in a later step: a rank without
        it none, a rank that had it dense every row with a ``DENSE`` mark (once the ranks agree on its dtype and
        shape: ``_check_mixed``); returns those (on this rank). Where some rank had it out of the buckets for another
        reason (a None of a source of unknown shape, a dense one of a shape unknown while traced: reduced on its own
        there), an error on every rank naming it (it was only on the ranks with it in a bucket: the others went on
        without it); so where the ranks that had it out of the buckets had it so in other ways (IndexedSlices, dense
        of an unknown shape, None), though no rank had it in a bucket: each waited for what the others never sent."""
        sparse = {(dtype_name(np.dtype(np.float32)), ())}  # (what the ranks with IndexedSlices registered)
        fine = [i for i in buckets.excluded_somewhere if buckets.excluded_as.get(i) == sparse]
        # and those IndexedSlices on every rank: their tables must be alike too (a vocabulary built from each rank's
        # own shard gave tables of other row counts under one name: the gathered rows landed in the wrong places, or
        # out of range on some rank, far from the cause). Checked with the others, in the first step only.
        everywhere = [i for i, how in buckets.excluded_as.items() if how == sparse and i not in fine]
        self._check_mixed(buckets, sorted(fine + everywhere), given)

        def kind(i):
            if i in self.excluded:
                return _OUT_KINDS[tuple(self.specs[i].shape)]
            return "None" if i in self._absent_now else "dense"

        differ = [i for i in buckets.excluded_somewhere if i not in fine]
        differ += [i for i, how in buckets.excluded_as.items() if len(how) > 1 and i not in differ]
        if differ:
            here = f"on this rank (rank {aiacc.rank()})"
            raise TensorMismatchError("in the first step of a reduction a gradient travelled otherwise on some ranks "
                "than on others, reduced on its own on some as one of a shape unknown there: " + "; ".join(
                    f"the gradient of {self.specs[i].label!r} is {kind(i)} {here}" for i in sorted(differ)[:5]) +
                " (None of a variable of unknown shape, or dense of a shape unknown while traced, is reduced on its "
                "own: give the variable a static shape, or compute its gradient the same way on every rank in the "
                "first step)")
        return [i for i in fine if i not in self.excluded]

    def _check_mixed(self, buckets: GradientBuckets, mixed: Sequence[int], given: dict) -> None:
        """First step: gradients ``mixed`` (the same on every rank) were IndexedSlices on some ranks (or all) and dense
        or None (in a bucket) on the others. One collective checks that every rank has them of the same dtype and shape
        (the buckets' check leaves out a gradient out of the buckets anywhere; an IndexedSlices rank's is its variable's
        shape, whose unknown dimensions match any size, see ``check_same_gradients``: a table of shape [None, 2] in a
        tf.function, looked up with tf.gather there and densely as (6, 2) on another rank): else an error on every
        rank naming the gradient, what differs and the ranks. Then each that this rank
        gave dense goes to ``_gather`` as every row, with a ``DENSE`` mark; a rank that had it None takes its dtype (the
        dense ranks' in ``params``)."""
        if not mixed:
            return
        entries = []
        for i in mixed:
            if i in self.excluded:  # (IndexedSlices here: the variable's shape, the values' dtype)
                dtype, shape = self.sparse_shapes.get(i, (None, None))
            else:  # (dense or None here: in a bucket as the ranks that had it dense, see guess_dtype)
                dtype, shape = buckets.params[i].dtype, buckets.params[i].shape
            entries.append((self.specs[i].label, "unknown" if dtype is None else dtype_name(np.dtype(dtype)),
                            None if shape is None else tuple(-1 if d is None else int(d) for d in shape)))
        check_same_gradients(self.engine, entries, f"{BUCKET_SETUP_PREFIX}{self.setup}.kinds", self.options["op"],
                             self.options["compression"])
        for i in mixed:
            if i in given:
                array = given[i]
                self._sparse[i] = (array, np.append(np.arange(array.shape[0] if array.ndim else 0), DENSE))
            elif i in self._absent_now:
                self.specs[i] = self.specs[i]._replace(dtype=np.dtype(buckets.params[i].dtype))

    @property
    def settled(self) -> bool:
        """The first step's wait has settled these buckets on the running engine (see ``Batch.join``)."""
        buckets = self.buckets
        return buckets is not None and buckets.established and self.engine is aiacc.engine_for(self.process_set)

    def gone(self, index: int) -> bool:
        """(After the wait) no rank had gradient ``index`` in this step."""
        return index in self._gone

    def result(self, index: int, none_if_gone: bool = True) -> Optional[np.ndarray]:
        """The reduced gradient ``index``: a new view of its bucket, watched until TensorFlow lets go; None
        (``none_if_gone``) where no rank had it in this step."""
        if none_if_gone and index in self._gone:
            return None
        view = self.buckets.view(index)[...]
        self._held[index] = weakref.ref(view)
        return view

    def describe(self) -> Tuple[list, ...]:
        """The labels in each bucket (for tests and logs)."""
        return tuple(self.buckets.describe()) if self.buckets is not None else ()
