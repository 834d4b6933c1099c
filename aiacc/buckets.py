"""Gradient buckets: a training step costs the engine per bucket, not per tensor.

An optimizer wrapper knows its parameters up front and registers them once
(:class:`GradientBuckets`). The first step learns the order in which their
gradients arrive and checks, in one collective, that every rank registered
the same parameters; it then assigns them to buckets in rank 0's arrival
order (at most ``bucket_cap`` bytes each, the first at most 1 MiB so that
communication starts early in backward; one dtype and device per bucket,
DDP's reducer's rules) and allocates one flat, 64-byte aligned buffer per
bucket. From then on, per step::

    gradient i ready:  ready(i)   one counter less for its bucket; the last one submits the
                                  bucket as ONE request (agreed by one cache bit, reduced
                                  where it lies, never fused again)
    step():            wait()     waits for the buckets' handles

so the engine's work per step follows the number of buckets. Where a
framework lets its gradients live in that memory (PyTorch: ``p.grad`` is a
view of its bucket, DDP's ``gradient_as_bucket_view``), nothing is copied;
elsewhere ``ready(i, array)`` copies the gradient in (one numpy call) and
the adapter reads the result from ``view(i)``. An adapter that hands those
views to its framework as results (TensorFlow) calls ``renew(i)`` before the
next step's gradients go in if the framework still holds last step's: the
bucket moves to new memory and the old stays with its holders.

Flags: an adapter that must tell the other ranks a few facts per gradient each step (MXNet: which
gradients this rank's backward reached) asks for ``flags`` slots and sets them with ``set_flags``
before the step's gradients go in; they travel at the end of one bucket's buffer (a float bucket,
float32 or wider where there is one), so they cost no request of their own, and ``flags_set()`` says
after ``wait()`` which ones any rank set (a sum, or an average, of 0s and 1s is 0 exactly when no rank
set it, whatever the scale factors or the fp16 / bf16 wire). Only a job whose gradients are all
integers gets a bucket of flags alone. With ``flags_last`` the flags are set after the step's gradients
are in (Keras on PyTorch: in ``apply``, once backward has handed its gradients over): they travel in the
bucket that fills last (the last float one), which ``ready`` never submits: ``submit_rest`` (or a wait)
does, after ``set_flags``, while every other bucket still goes as soon as it is full.

Presence (``presence=True``, PyTorch): whether *any* rank had a gradient of a parameter this step, so
that a parameter no rank produced a gradient for (unused in every rank's forward, or frozen with
``requires_grad_(False)``) can be left out of the update as one process (and DDP) leaves it, instead of
being stepped on zeros. Each bucket's buffer ends with the number of its gradients this rank marked
``absent`` (before ``submit_rest``; a bucket that ``ready`` submits has every gradient in: 0), then one
element per gradient: 1 from a rank that had it, 0 from one that marked it. The same reduction carries
them (a sum or average of 0s and 1s, or of counts, is 0 exactly when every rank sent 0, on any wire);
after the wait ``absent_everywhere()`` reads one element per bucket, and the gradients' only where some
rank marked one. No request of its own. A rank about to register other gradients (``retire``: PyTorch parameters
frozen, unfrozen or added between steps) sends its buckets once more with that count -inf, so that a rank that
did not change sees it in its next step's wait and every rank raises an error naming the ranks at once.

Sparse gradients that turn up in a bucket (with presence): before the first step nothing tells a parameter with
sparse gradients (PyTorch's ``nn.Embedding(sparse=True)``) from a dense one, so one that no rank used in the first
step is bucketed. A rank that gets a sparse gradient for a bucketed one later marks it ``sparse`` (its place in the
bucket is not filled: whatever is there goes); the presence elements end with the count of such marks, then one
element per gradient, reduced alike. After the wait ``leave_sparse()`` reads that count per bucket and, where some
rank marked a gradient, takes it out of its bucket for good on every rank (every rank read the same reduction):
the bucket is rebuilt without it in new memory that keeps what the others hold; the adapter reduces that
gradient on its own from this step on, as it does one excluded before the buckets settled. What its place in the
bucket reduced to (``departed``) is the part of the ranks that gave it dense in that step, where the ranks that
marked it put zeros there.

Guessed dtypes (``guess_dtype``): a rank that has no gradient of a parameter in the first step registers the
parameter's dtype, which the gradient need not have (TensorFlow: cast by the user before the optimizer). The first
step's collective gives it the dtype of the ranks that had the gradient, where they agree.

Everything here runs on the caller's threads (the training thread, autograd's
hooks); the engine thread sees only the buckets' requests.
"""

from __future__ import annotations

import pickle
import threading
import weakref
from typing import Callable, List, NamedTuple, Optional, Sequence

import numpy as np

from . import devices
from .compression import bfloat16_dtype
from .exceptions import NotInitializedError, TensorMismatchError
from .fusion import SEEN_WHILE_JOINED
from .names import BUCKET_SETUP_PREFIX, only_on_some_ranks
from .negotiation import Meta, _ranks, describe_mismatch
from .ops import Average, Collective, ReduceOp
from .tensors import ALIGNMENT, dtype_from_name, dtype_name

__all__ = ["ParamSpec", "GradientBuckets", "FIRST_BUCKET_CAP", "registration_priority", "check_same_gradients"]

FIRST_BUCKET_CAP = 1 << 20  # bytes: the first bucket (the last layers' gradients) is small, DDP's choice

# engine -> GradientBuckets made on it so far: the k-th set of an engine names its first-step collective
# by k alone, so ranks whose parameters differ (in number, or in name: a layer frozen on one rank, another
# model) meet in it at once and get the error that says how, instead of waiting in collectives named after
# what differs (tried: named by the first gradient, the error came at the second stall check, or never with
# the stall check off; two nn.Sequential models in threads both named '0.weight'). So every rank makes its
# optimizers in the same order (Horovod matches gradients by name alone). Only where the sets are made in
# program order (torch, MXNet); an adapter that makes them as concurrent graph ops run (TensorFlow: two tapes
# in one tf.function) names them itself (``setup_name``: the reduction's name prefix, numbered per call in a
# traced function, which is the same on every rank whatever its parameters)
_SETS_MADE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_SETS_LOCK = threading.Lock()  # (optimizers made in threads at once took the same number)


def registration_priority(index: int, count: int) -> float:
    """The priority of the ``index``-th of ``count`` parameters registered in the order the model uses
    them: nearer the input is needed earlier by the next forward pass, so it is more urgent."""
    return float(count - index)


class ParamSpec(NamedTuple):
    """A parameter whose gradient is reduced: ``label`` names it across ranks and in errors.

    ``priority``: higher is needed earlier by the next forward pass. By default (None) the rule every
    adapter shares: parameters are registered in the order the model uses them, so an earlier one
    (nearer the input) is more urgent."""

    label: str
    shape: tuple
    dtype: np.dtype
    device: str = devices.CPU
    priority: Optional[float] = None


class _Bucket:
    __slots__ = ("members", "offsets", "buffer", "pending", "handle", "name", "labels", "priority", "released",
                 "held", "presence")

    def __init__(self, members: List[int], offsets: List[int], buffer, name: str, labels: tuple, priority: float):
        self.members = members
        self.offsets = offsets  # where each member's gradient starts in ``buffer`` (elements)
        self.buffer = buffer
        self.held = 0  # 1: ``ready`` never submits it (the flags bucket of ``flags_last``)
        # with presence: where its count of absent gradients is in ``buffer``, then each one's presence, then the
        # count of gradients marked sparse, then each one's mark
        self.presence = None
        self.pending = len(members)
        self.handle = None
        self.name = name
        self.labels = labels
        self.priority = priority
        self.released = 0


class GradientBuckets:
    """The gradients of a fixed list of parameters, reduced in buckets.

    ``op``/``prescale``/``postscale``/``compression`` apply to every gradient (Horovod's
    ``DistributedOptimizer`` arguments). ``cap``: largest bucket in bytes.
    """

    def __init__(self, engine, params: Sequence[ParamSpec], *, op=Average, prescale: float = 1.0,
                 postscale: float = 1.0, compression=None, cap: int = 25 << 20, first_cap: int = FIRST_BUCKET_CAP,
                 engine_of: Optional[Callable[[], object]] = None, setup_name: Optional[str] = None,
                 flags: int = 0, flags_last: bool = False, presence: bool = False, regroup_hint: str = ""):
        labels = [p.label for p in params]
        if len(set(labels)) != len(labels):
            dup = sorted({x for x in labels if labels.count(x) > 1})
            raise ValueError(f"gradient names must be unique; repeated: {', '.join(map(repr, dup[:5]))}")
        self.engine = engine
        # the engine to use once ``engine`` has stopped (aiacc shut down and initialized again: Horovod's
        # optimizers go on with the new one); None: the stopped engine's error
        self._engine_of = engine_of
        if setup_name is None:
            with _SETS_LOCK:
                serial = _SETS_MADE.get(engine, 0)
                _SETS_MADE[engine] = serial + 1
            setup_name = f"{BUCKET_SETUP_PREFIX}{serial}"
        self._setup_name = setup_name
        self._regroup_hint = regroup_hint  # (see ``retire``)
        n = len(params)
        self.params = [p if p.priority is not None else p._replace(priority=registration_priority(i, n))
                       for i, p in enumerate(params)]
        self.op, self.prescale, self.postscale, self.compression = op, prescale, postscale, compression
        self.cap, self.first_cap = int(cap), int(min(first_cap, cap))
        self.buckets: Optional[List[_Bucket]] = None  # until the first step has run
        self._bucket_of: Optional[List[_Bucket]] = None
        self._views: Optional[list] = None
        self._marked = bytearray(len(self.params))  # ready this step
        self._arrival: List[int] = []  # first step: the order gradients arrived in
        self._stash: dict = {}  # first step: index -> the gradient given to ready()
        self._excluded: set = set()  # gradients the adapter reduces itself (sparse ones), in no bucket
        self.excluded_somewhere: List[int] = []  # (settled) gradients excluded on some ranks only
        self.excluded_how: dict = {}  # (settled) how the ranks had each of those (see ``_establish``)
        self.excluded_as: dict = {}  # (settled) what the ranks excluding each excluded one registered (``_establish``)
        self.submits = 0  # bucket requests submitted so far (a test counts them)
        if flags and ReduceOp(int(op)) not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError(f"flags travel in a bucket reduced by Average or Sum, not {ReduceOp(int(op))}")
        self.flags = int(flags)
        self.flags_last = bool(flags_last)  # the flags go in the last bucket, held back for submit_rest
        self._flag_values = np.zeros(self.flags, np.float32)  # what this rank sends this step
        self._flag_bucket: Optional[_Bucket] = None  # the bucket whose buffer ends with the flags, once settled
        self._mark_bucket: Optional[_Bucket] = None  # with presence: the bucket ``wait`` looks at (see ``retire``)
        self._flag_offset = 0
        if presence and ReduceOp(int(op)) not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError(f"presence travels in buckets reduced by Average or Sum, not {ReduceOp(int(op))}")
        self.presence = bool(presence)
        self._absent = bytearray(len(self.params))  # marked absent on this rank this step
        self._absent_count = 0
        self._sparse: set = set()  # marked sparse on this rank this step (see the module's doc)
        self._guessed: set = set()  # first step: gradients whose dtype this rank only guessed (``guess_dtype``)
        self.departed: dict = {}  # (after ``leave_sparse``) index -> its reduced values in the bucket it left

    # ---- per gradient (the hot path) ---------------------------------------------------
    def ready(self, index: int, array=None) -> None:
        """Gradient ``index`` is final for this step. ``array``: where it is, when it does not
        already live in ``view(index)`` (copied in)."""
        marked = self._marked
        if marked[index]:
            raise RuntimeError(f"the gradient of {self.params[index].label!r} was marked ready twice in one step")
        marked[index] = 1
        if self._absent_count and self._absent[index]:
            self._absent[index] = 0
            self._absent_count -= 1
        bucket_of = self._bucket_of
        if bucket_of is None:  # the first step: learn the arrival order
            self._arrival.append(index)
            if array is not None:
                self._stash[index] = array
            return
        if array is not None:
            view = self._views[index]
            if array is not view:
                devices.array_module(self.params[index].device).copyto(view, array.reshape(view.shape))
        bucket = bucket_of[index]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._submit(bucket)

    def _submit(self, bucket: _Bucket) -> None:
        self.submits += 1
        if bucket.presence is not None:
            start = bucket.presence
            k = len(bucket.members)
            present = bucket.buffer[start:start + 2 + 2 * k]
            present[:1 + k].fill(1)
            present[0] = 0
            present[1 + k:].fill(0)
            if self._absent_count:
                absent = self._absent
                for j, i in enumerate(bucket.members, 1):
                    if absent[i]:
                        present[j] = 0
                        present[0] += 1
            if self._sparse:
                for j, i in enumerate(bucket.members, 2 + k):
                    if i in self._sparse:
                        present[j] = 1
                        present[1 + k] += 1
        if bucket is self._flag_bucket:
            off = self._flag_offset
            bucket.buffer[off:off + self.flags] = self._flag_values
        bucket.handle = self._send(bucket, bucket.buffer)

    def _live_engine(self):
        """The engine to submit to: after ``shutdown()`` and ``init()`` again, the new one (``engine_of``), also for
        the first step's and a regroup's collectives (a wrapper made before and stepped only after)."""
        engine = self.engine
        if engine.closed and self._engine_of is not None:
            try:
                engine = self.engine = self._engine_of() or engine  # (a stopped engine raises its own error)
            except NotInitializedError:  # (shut down, not started again: the stopped engine's error names the bucket;
                pass  # this one named engine_for(), which the script never called: a watchdog's shutdown() mid-step)
        return engine

    def _send(self, bucket: _Bucket, buffer):
        return self._live_engine().submit(
            Collective.ALLREDUCE, buffer, name=bucket.name, op=self.op, prescale=self.prescale,
            postscale=self.postscale, compression=self.compression, priority=bucket.priority,
            outputs=[buffer], labels=bucket.labels)

    def exclude(self, index: int) -> None:
        """Before the first ``submit_rest``: gradient ``index`` goes in no bucket (the adapter reduces it
        another way, as a sparse gradient). Any rank's exclusion counts for every rank."""
        if self.buckets is not None:
            raise RuntimeError(f"the buckets are settled; {self.params[index].label!r} cannot be excluded now")
        self._excluded.add(index)

    def excluded(self, index: int) -> bool:
        return index in self._excluded

    def absent(self, index: int) -> None:
        """With ``presence``: this rank has no gradient ``index`` this step (its bucket sends zeros for it, and
        a 0 in its presence element). Before the bucket is submitted (``submit_rest``); ``ready`` undoes it."""
        if self.presence and not self._absent[index]:
            self._absent[index] = 1
            self._absent_count += 1

    def guess_dtype(self, index: int) -> None:
        """Before the first ``wait``: this rank's dtype of gradient ``index`` is a guess (it has none of it in the
        first step, and gave the parameter's). The first step's collective gives it the dtype of the ranks that had
        it, where those agree (a gradient the framework casts to another dtype than its parameter's: only the ranks
        that computed it know which); ``params[index]`` then holds it."""
        if self.buckets is None:
            self._guessed.add(index)

    def sparse(self, index: int) -> None:
        """With ``presence``: this rank's gradient ``index`` is sparse this step; its place in the bucket is not
        filled (see the module's doc). Before the bucket is submitted, with ``ready`` or before ``submit_rest``."""
        if self.presence:
            self._sparse.add(index)

    def leave_sparse(self, index: Optional[int] = None):
        """With ``presence``, after the wait of every bucket (or of ``index``'s, before any of its gradients is
        released): the gradients of those buckets that some rank marked ``sparse`` leave their buckets for good,
        on every rank alike (see the module's doc). Returns (the gradients that left, the gradients whose
        ``view()`` moved to their bucket's new memory, their results and presence in it). ``departed`` then holds,
        for each that left, what its place in the bucket reduced to (the ranks that gave it dense: their part of
        the result, where the ranks that marked it put zeros there)."""
        self.departed = {}
        if not self.presence or self.buckets is None:
            return [], []
        buckets = self.buckets if index is None else [self._bucket_of[index]]
        left, moved = [], []
        for bucket in buckets:
            if bucket is None or bucket.presence is None:
                continue
            k = len(bucket.members)
            marks = bucket.buffer[bucket.presence + 1 + k:bucket.presence + 2 + 2 * k]
            if not marks[0]:
                continue
            going = [bucket.members[j] for j in np.flatnonzero(marks[1:] != 0).tolist()]
            left += going
            moved += self._rebuild(bucket, set(going))
        return left, moved

    def leave(self, indices: Sequence[int]) -> List[int]:
        """After the wait of every bucket: gradients ``indices`` leave their buckets for good, as ``leave_sparse``'s
        do (every rank must pass the same: an adapter derives them from what every rank read, e.g. gradients that
        ``absent_everywhere`` named). Returns the gradients whose ``view()`` moved to their bucket's new memory.
        ``departed`` is left as it was."""
        if self.buckets is None:
            return []
        departed, moved = dict(self.departed), []
        going = {i for i in indices if i not in self._excluded}
        for bucket in list(self.buckets):
            mine = going.intersection(bucket.members)
            if mine:
                moved += self._rebuild(bucket, mine)
        self.departed = departed
        return moved

    def _rebuild(self, bucket: _Bucket, going: set) -> List[int]:
        """Take ``going`` out of ``bucket`` (waited for, nothing released): new memory holding the rest's results,
        presence and flags. Returns the gradients left in it (their views moved)."""
        old, start = bucket.buffer, bucket.presence
        stay = [(i, off) for i, off in zip(bucket.members, bucket.offsets) if i not in going]
        present = {i: old[start + 1 + j] for j, i in enumerate(bucket.members)}
        for i in going:  # (the old memory is these views' alone from now on)
            self.departed[i] = self._views[i]
        for i in going:
            self._excluded.add(i)
            self._bucket_of[i] = self._views[i] = None
            self._marked[i] = 0
            self._sparse.discard(i)
            if self._absent[i]:
                self._absent[i] = 0
                self._absent_count -= 1
        if not stay and bucket is not self._flag_bucket:
            self.buckets.remove(bucket)
            if bucket is self._mark_bucket:
                self._mark_bucket = next((b for b in self.buckets if b.presence is not None), None)
            return []
        dtype = old.dtype
        per_align = max(1, ALIGNMENT // dtype.itemsize)
        offsets, total = [], 0
        for i, _ in stay:
            offsets.append(total)
            total += -(-int(np.prod(self.params[i].shape, dtype=np.int64)) // per_align) * per_align
        flag_offset = None
        if bucket is self._flag_bucket:
            flag_offset, total = total, total + self.flags
        presence, total = total, total + 2 + 2 * len(stay)
        device = self.params[bucket.members[0]].device
        buffer = devices.empty((max(total, 1),), dtype, device)
        buffer.fill(0)
        xp = devices.array_module(device)
        for (i, off), new in zip(stay, offsets):
            n = int(np.prod(self.params[i].shape, dtype=np.int64))
            xp.copyto(buffer[new:new + n], old[off:off + n])
            self._views[i] = buffer[new:new + n].reshape(tuple(self.params[i].shape))
        if flag_offset is not None:
            flags = old[self._flag_offset:self._flag_offset + self.flags]
            xp.copyto(buffer[flag_offset:flag_offset + self.flags], flags)
            self._flag_offset = flag_offset
        buffer[presence] = old[start]
        for j, (i, _) in enumerate(stay, 1):
            buffer[presence + j] = present[i]
        members = [i for i, _ in stay]
        labels = tuple(self.params[i].label for i in members)
        bucket.members, bucket.offsets, bucket.buffer, bucket.presence = members, offsets, buffer, presence
        bucket.labels = labels
        if labels:
            bucket.name = f"bucket[{labels[0]}..{labels[-1]}]" if len(labels) > 1 else f"bucket[{labels[0]}]"
            bucket.priority = max(self.params[i].priority for i in members)
        bucket.pending = len(members) + bucket.held - sum(self._marked[i] for i in members)
        return members

    def absent_everywhere(self, index: Optional[int] = None) -> List[int]:
        """With ``presence``, after the wait: the gradients (of every bucket, or of ``index``'s) that no rank had
        this step (every rank marked them ``absent``). One look per bucket."""
        if not self.presence or self.buckets is None:
            return []
        buckets = self.buckets if index is None else [self._bucket_of[index]]
        gone = []
        for bucket in buckets:
            if bucket is None or bucket.presence is None:
                continue
            start = bucket.presence
            count = bucket.buffer[start]
            if count:  # some rank marked some of its gradients absent
                if float(count) < 0:  # (or retired these buckets: see ``retire``)
                    self._retired_elsewhere()
                present = bucket.buffer[start + 1:start + 1 + len(bucket.members)]
                gone += [bucket.members[k] for k in np.flatnonzero(present == 0).tolist()]
        return gone

    # ---- per step ----------------------------------------------------------------------
    @property
    def established(self) -> bool:
        return self.buckets is not None

    def submit_rest(self) -> None:
        """Submit every bucket not submitted yet: its missing gradients (parameters unused on this
        rank) count as they are (zeros after ``zero()``); other ranks may have them. The first
        call settles the buckets (a collective: every rank must reach it)."""
        if self.buckets is None:
            self._establish()
        for bucket in self.buckets:
            if bucket.handle is None:
                self._submit(bucket)

    def set_flags(self, values) -> None:
        """This rank's flags for this step (``flags`` values, each 0 or 1 / False or True): before the
        bucket that carries them is submitted, i.e. before this step's first ``ready`` (with ``flags_last``:
        before ``submit_rest``)."""
        values = np.asarray(values)
        if values.shape != (self.flags,):
            raise ValueError(f"set_flags: expected {self.flags} flags, got an array of shape {values.shape}")
        np.copyto(self._flag_values, values, casting="unsafe")

    def flags_set(self) -> np.ndarray:
        """After ``wait()``: for each flag, whether any rank set it this step (bools)."""
        if self._flag_bucket is None:
            return np.zeros(self.flags, bool)
        off = self._flag_offset
        return self._flag_bucket.buffer[off:off + self.flags] != 0

    def wait_for(self, index: int) -> None:
        """Wait until gradient ``index`` holds its reduced value (submitting what is missing)."""
        if self._bucket_of is None:
            self.submit_rest()
        bucket = self._bucket_of[index]
        if bucket.handle is None:
            self._submit(bucket)
        bucket.handle.wait()

    def wait(self) -> None:
        """Wait for every bucket (submitting what is missing); then the next step can start. Every
        bucket is waited for even when one fails; the first error is raised after."""
        self.submit_rest()
        error = None
        for bucket in self.buckets:
            try:
                bucket.handle.wait()
            except Exception as exc:  # noqa: BLE001 - raised below, once no bucket is in flight
                error = error or exc
        self.reset()
        if error is not None:
            raise error
        first = self._mark_bucket
        if first is not None:  # one look a step (see ``retire``; float(): a numpy scalar's < took 0.8 us here)
            count = first.buffer[first.presence]
            if count and float(count) < 0:
                self._retired_elsewhere()

    def release(self, index: int) -> None:
        """Gradient ``index`` has been consumed (for callers that wait per gradient): once every
        gradient of its bucket is, the bucket is ready for the next step."""
        bucket = self._bucket_of[index]
        bucket.released += 1
        if bucket.released == len(bucket.members):
            self._reset_bucket(bucket)

    def reset(self) -> None:
        """Start a new step: no gradient ready, nothing in flight (after ``wait``)."""
        if self.buckets is not None:
            for bucket in self.buckets:
                self._reset_bucket(bucket)

    def _reset_bucket(self, bucket: _Bucket) -> None:
        bucket.pending = len(bucket.members) + bucket.held
        bucket.handle = None
        bucket.released = 0
        marked = self._marked
        for i in bucket.members:
            marked[i] = 0
        if self._sparse:
            self._sparse.difference_update(bucket.members)
        if self._absent_count:
            absent = self._absent
            for i in bucket.members:
                if absent[i]:
                    absent[i] = 0
                    self._absent_count -= 1

    def in_flight(self) -> List[str]:
        """Labels of gradients whose bucket has been submitted and not waited for."""
        if self.buckets is None:
            return []
        return [self.params[i].label for b in self.buckets if b.handle is not None and not b.handle.done()
                for i in b.members]

    def marked(self, index: int) -> bool:
        return bool(self._marked[index])

    def submitted(self, index: int) -> bool:
        """Whether gradient ``index``'s bucket has gone to the engine in this step (False before the buckets
        are settled, and for a gradient in no bucket)."""
        bucket = self._bucket_of[index] if self._bucket_of is not None else None
        return bucket is not None and bucket.handle is not None

    def zero(self) -> None:
        """Set every gradient to zero (one fill per bucket)."""
        if self.buckets is not None:
            for bucket in self.buckets:
                bucket.buffer.fill(0)

    def view(self, index: int):
        """The memory of gradient ``index`` in its bucket (shaped like the parameter)."""
        if self._views is None:
            raise RuntimeError("the buckets are settled by the first step; view() is not available before")
        return self._views[index]

    def renew(self, index: int) -> List[int]:
        """Move gradient ``index``'s bucket to new memory, a copy of the old (so the gradients this step
        has put in already stay), and leave the old memory to whoever still holds views of it: for an
        adapter that handed ``view()`` results to its framework without copying, when the framework
        still holds them as the next step begins. Returns the bucket's gradients (whose ``view()`` is
        new). Not while the bucket is in flight."""
        bucket = self._bucket_of[index] if self._bucket_of is not None else None
        if bucket is None:
            raise RuntimeError(f"the gradient of {self.params[index].label!r} is in no bucket (the buckets are not "
                               "settled yet, or it was excluded)")
        if bucket.handle is not None:
            raise RuntimeError(f"the bucket of {self.params[index].label!r} is in flight; it cannot move now")
        old = bucket.buffer
        p0 = self.params[bucket.members[0]]
        buffer = devices.empty(old.shape, old.dtype, p0.device)
        devices.array_module(p0.device).copyto(buffer, old)
        bucket.buffer = buffer
        for i, off in zip(bucket.members, bucket.offsets):
            view = self._views[i]
            self._views[i] = buffer[off:off + view.size].reshape(view.shape)
        return list(bucket.members)

    # ---- a rank changes its gradients (PyTorch: parameters frozen, unfrozen or added between steps) ---------------
    @property
    def setup_name(self) -> str:
        """The name of the first step's collectives (a set made in place of one never settled keeps it)."""
        return self._setup_name

    def retire(self, labels: Sequence[str], extra=None) -> list:
        """(With ``presence``, settled, between steps.) This rank stops using these buckets: it is about to register
        the gradients ``labels`` instead. The ranks that keep these buckets must hear of it, though all they do is
        submit the next step's buckets: so this sends every bucket once more, zeros with the count of absent
        gradients -inf (a sum or an average is negative exactly when some rank sent one: counts are >= 0), which
        their next step's buckets meet; their ``wait`` (one look a step, at one bucket) or ``absent_everywhere``
        sees it. Then every rank gathers (changed or not, its labels) under this set's name. Where some rank did not
        change (a rank froze, unfroze or added parameters alone, or a step earlier or later), or the ranks' new
        labels differ, a TensorMismatchError on every rank names the ranks and the gradients, instead of the job
        waiting for the stall inspector. Returns every rank's ``extra`` (one allreduce of the buckets and a gather,
        once per change)."""
        if not self.presence or self.buckets is None:
            raise RuntimeError("retire() is for settled buckets with presence")
        handles = []
        for bucket in self.buckets:
            device = self.params[bucket.members[0]].device if bucket.members else devices.CPU
            buffer = devices.empty(bucket.buffer.shape, bucket.buffer.dtype, device)
            buffer.fill(0)
            if bucket.presence is not None:
                buffer[bucket.presence] = -np.inf
            handles.append(self._send(bucket, buffer))
        for handle in handles:
            handle.wait()
        ranks, gathered = self._regroup_exchange(True, list(labels), extra)
        if len({tuple(g[1]) for g in gathered}) > 1:
            only = only_on_some_ranks([g[1] for g in gathered], ranks) or "in different orders"
            raise TensorMismatchError(
                f"the ranks changed the gradients they average between steps to different lists ({only}): every "
                f"rank must make the same change at the same point{self._regroup_hint}")
        return [g[2] for g in gathered]

    def _retired_elsewhere(self) -> None:
        """Some rank retired these buckets (see ``retire``) and this one did not: the error, on every rank."""
        self.reset()
        self._regroup_exchange(False, [p.label for p in self.params], None)

    def _regroup_exchange(self, changed: bool, labels: list, extra):
        ranks, gathered = _gather_setup(self._live_engine(), (changed, labels, extra), f"{self._setup_name}.regroup")
        ranks = _job_ranks_of(self.engine, ranks)
        stayed = [r for r, g in zip(ranks, gathered) if not g[0]]
        if stayed:
            went = [r for r, g in zip(ranks, gathered) if g[0]]
            only = only_on_some_ranks([g[1] for g in gathered], ranks)
            averages = "they average" if len(went) > 1 else "it averages"
            raise TensorMismatchError(
                f"{_ranks(went)} changed the gradients {averages} between steps "
                f"and {_ranks(stayed)} did not{' (now ' + only + ')' if only else ''}: every rank must make the same "
                f"change at the same point between steps{self._regroup_hint}")
        return ranks, gathered

    # ---- the first step -----------------------------------------------------------------
    def _establish(self) -> None:
        """Agree on the parameters and the arrival order with every rank, then build the buckets."""
        mine = [(p.label, dtype_name(np.dtype(p.dtype)), tuple(p.shape)) for p in self.params]
        name = self._setup_name
        ranks, gathered = _gather_setup(self._live_engine(), (mine, self._arrival, sorted(self._excluded),
                                                      (self.cap, self.first_cap), sorted(self._guessed)), name)
        self._adopt_dtypes(gathered)
        excluded = set().union(*(g[2] for g in gathered))
        # in a bucket on some ranks and excluded on others: the same set on every rank, for the adapter's check
        self.excluded_somewhere = sorted(excluded - set.intersection(*(set(g[2]) for g in gathered)))
        # and for each of those, what the ranks had: 'ready' from a rank that gave it to its bucket, else the set of
        # (dtype, shape) that the ranks excluding it registered (an adapter may tell its kinds of exclusion so)
        self.excluded_how = {i: "ready" if any(i in g[1] for g in gathered) else
                             {tuple(g[0][i][1:]) for g in gathered if i in g[2]} for i in self.excluded_somewhere}
        # and, for every gradient excluded on some rank (on all, or also where some rank gave it to its bucket), that
        # set (a rank's kinds of exclusion, as above: an adapter checks what the ranks that exclude it have)
        self.excluded_as = {i: {tuple(g[0][i][1:]) for g in gathered if i in g[2]} for i in sorted(excluded)}
        # a gradient in no bucket on some rank (None or sparse there: a placeholder) is the adapter's to check
        _check_same_parameters([g[0] for g in gathered], self.op, self.compression, skip=excluded,
                               ranks=_job_ranks_of(self.engine, ranks), in_set=getattr(self.engine, "job_ranks", None))
        self._excluded = excluded
        for i in self._excluded:
            self._marked[i] = 0
            if self._absent[i]:  # (in no bucket: nothing sends or resets it)
                self._absent[i] = 0
                self._absent_count -= 1
        # rank 0's order and caps (the first rank's not joined; a bucket_cap_mb given per rank), so every rank
        # builds the same buckets
        arrival, (self.cap, self.first_cap) = gathered[0][1], gathered[0][3]
        seen = set(arrival)
        order = [i for i in list(arrival) + [i for i in reversed(range(len(self.params))) if i not in seen]
                 if i not in self._excluded]
        self._build(order)
        for index, array in self._stash.items():
            view = self._views[index]
            if view is None:  # excluded by another rank
                continue
            devices.array_module(self.params[index].device).copyto(view, array.reshape(view.shape))
        self._stash = {}
        for bucket in self.buckets:  # the first step's gradients are all in already
            bucket.pending = len(bucket.members) + bucket.held - sum(self._marked[i] for i in bucket.members)

    def _adopt_dtypes(self, gathered: list) -> None:
        """A gradient whose dtype some ranks only guessed (``guess_dtype``) takes the dtype of the ranks that had
        it, where they agree and differ from the guess: in the gathered lists, which the check compares next, and
        in ``params`` on a rank that guessed. Where they disagree the check names the dtypes."""
        guessed = [set(g[4]) for g in gathered]
        for i in set().union(*guessed):
            known = {g[0][i][1] for g, gs in zip(gathered, guessed)  # (not an excluded one's placeholder)
                     if i not in gs and i not in g[2] and i < len(g[0])}
            if len(known) != 1:
                continue
            dtype = known.pop()
            for g, gs in zip(gathered, guessed):
                if i in gs and i < len(g[0]):
                    g[0][i] = (g[0][i][0], dtype, g[0][i][2])
            if i in self._guessed and dtype_name(np.dtype(self.params[i].dtype)) != dtype:
                self.params[i] = self.params[i]._replace(dtype=dtype_from_name(dtype))
        self._guessed = set()

    def _build(self, order: List[int]) -> None:
        groups: List[List[int]] = []
        open_groups = {}
        sizes = {}
        first = True
        for i in order:
            p = self.params[i]
            key = (np.dtype(p.dtype), p.device)
            g = open_groups.get(key)
            if g is None:
                g = open_groups[key] = []
                groups.append(g)
                sizes[id(g)] = 0
            g.append(i)
            sizes[id(g)] += int(np.prod(p.shape, dtype=np.int64)) * key[0].itemsize
            cap = self.first_cap if first else self.cap
            if sizes[id(g)] >= cap:
                del open_groups[key]
                first = False
        self.buckets, self._bucket_of, self._views = [], [None] * len(self.params), [None] * len(self.params)
        host = self._flag_host(groups)
        flag_offset = 0
        for g in groups:
            p0 = self.params[g[0]]
            dtype = np.dtype(p0.dtype)
            per_align = max(1, ALIGNMENT // dtype.itemsize)
            offsets, total = [], 0
            for i in g:
                offsets.append(total)
                n = int(np.prod(self.params[i].shape, dtype=np.int64))
                total += -(-n // per_align) * per_align  # each gradient starts 64-byte aligned
            if g is host:  # the flags after the gradients, where the adapter never looks
                flag_offset, total = total, total + self.flags
            presence, total = (total, total + 2 + 2 * len(g)) if self.presence else (None, total)
            buffer = devices.empty((max(total, 1),), dtype, p0.device)
            buffer.fill(0)  # the padding between gradients is reduced too: keep it zero
            labels = tuple(self.params[i].label for i in g)
            name = f"bucket[{labels[0]}..{labels[-1]}]" if len(labels) > 1 else f"bucket[{labels[0]}]"
            bucket = _Bucket(g, offsets, buffer, name, labels, max(self.params[i].priority for i in g))
            bucket.presence = presence
            self.buckets.append(bucket)
            if presence is not None and self._mark_bucket is None:
                self._mark_bucket = bucket
            if g is host:
                self._flag_bucket, self._flag_offset = bucket, flag_offset
                bucket.held = int(self.flags_last)
            for i, off in zip(g, offsets):
                shape = tuple(self.params[i].shape)
                n = int(np.prod(shape, dtype=np.int64))
                self._bucket_of[i] = bucket
                self._views[i] = buffer[off:off + n].reshape(shape)

        if self.flags and host is None:  # no float gradient at all: the flags go alone (float32, CPU)
            buffer = np.zeros(self.flags, np.float32)
            bucket = _Bucket([], [], buffer, f"{self._setup_name}.flags", (), 0.0)
            self.buckets.append(bucket)
            self._flag_bucket, self._flag_offset = bucket, 0

    def _flag_host(self, groups: List[List[int]]) -> Optional[List[int]]:
        """The group whose bucket carries the flags: the first of a float dtype of 32 bits or more (0 and
        1 exact on any wire), else the first float one (float16 / bfloat16: 0 and 1 exact too); with
        ``flags_last`` the last such group (the bucket that fills last, so holding it back until the flags
        are set delays no other); None when there are no flags, or no float gradient (the flags then get a
        bucket of their own)."""
        if not self.flags:
            return None
        bf16 = bfloat16_dtype()
        floats = [g for g in groups if np.dtype(self.params[g[0]].dtype).kind == "f"
                  or (bf16 is not None and np.dtype(self.params[g[0]].dtype) == bf16)]
        wide = [g for g in floats if np.dtype(self.params[g[0]].dtype).itemsize >= 4]
        return (wide or floats or [None])[-1 if self.flags_last else 0]

    def describe(self) -> List[List[str]]:
        """The labels in each bucket of gradients, in the order the buckets fill (for tests and logs)."""
        return [list(b.labels) for b in self.buckets or [] if b.members]


def _gather_setup(engine, obj, name: str):
    """Every rank's ``obj`` through ``engine`` (the buckets may live on any engine): (the ranks on the engine
    that sent one, their objects). Two Sum allreduces in which each rank fills its own slot, because a rank
    that has called ``join()`` takes part in allreduces only (with zeros): the other ranks' first step then
    runs without it, as Horovod's does. One-time bytes: ranks x the largest pickled list."""
    rank, size = getattr(engine, "rank", 0), getattr(engine, "size", 1)
    seen = SEEN_WHILE_JOINED.pop(f"{name}.size", None), SEEN_WHILE_JOINED.pop(f"{name}.data", None)
    if seen[0] is not None and seen[1] is not None and seen[0].size == size:
        # this rank had joined when the others ran this setup (their first step, an epoch it had no batch in): their
        # objects, which they built from, and this rank's own (its check of them); nobody runs the setup again
        ranks, objects = _sent(seen[0].tolist(), seen[1])
        return ranks + [rank], objects + [obj]
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.zeros(size, np.int64)
    sizes[rank] = payload.size
    sizes = engine.submit(Collective.ALLREDUCE, sizes, name=f"{name}.size", op=ReduceOp.SUM).wait().tolist()
    data = np.zeros((size, max(sizes)), np.uint8)
    data[rank, :payload.size] = payload
    return _sent(sizes, engine.submit(Collective.ALLREDUCE, data.reshape(-1), name=f"{name}.data",
                                      op=ReduceOp.SUM).wait())


def _sent(sizes: List[int], data) -> tuple:
    """(the ranks that sent an object, their objects) from ``_gather_setup``'s two sums: the pickles' sizes, and the
    flat rows of their bytes (a pickle is never empty: a size 0 is a rank that joined)."""
    rows = data.reshape(len(sizes), -1)
    ranks = [k for k, n in enumerate(sizes) if n > 0]
    return ranks, [pickle.loads(rows[k, :sizes[k]].tobytes()) for k in ranks]


def _job_ranks_of(engine, ranks: List[int]) -> List[int]:
    """``ranks`` of ``engine`` (as ``_gather_setup`` gives them) as the job's ranks (a process set's engine numbers
    its members from 0), for messages."""
    job_ranks = getattr(engine, "job_ranks", None)
    return ranks if job_ranks is None else [job_ranks[k] for k in ranks]


def check_same_gradients(engine, entries: List[tuple], name: str, op=Average, compression=None) -> None:
    """The first step's check of the buckets (:meth:`GradientBuckets` names what differs) for gradients reduced
    outside buckets: ``entries`` is this rank's ``(label, dtype, shape)`` per gradient, ``label`` the same on
    every rank. Every rank of ``engine`` must call it (a collective named ``name``): an adapter does after a
    grouped reduction of the gradients failed on every rank, whose error could only name a gradient by its
    place in the group. A shape may be partly unknown where a rank computed it (a graph traced with a None
    dimension): a negative dimension matches any size, a shape None (its rank unknown too) any shape (see
    ``agree_unknown``). Raises TensorMismatchError naming the first gradient that differs, or the gradients
    only some ranks have; returns when every rank's entries are the same."""
    ranks, gathered = _gather_setup(engine, [(str(label), str(dtype), None if shape is None else tuple(shape))
                                             for label, dtype, shape in entries], name)
    _check_same_parameters(agree_unknown(gathered), op, compression, ranks=_job_ranks_of(engine, ranks),
                           in_set=getattr(engine, "job_ranks", None))


def _merged_shape(shapes: Sequence[Optional[tuple]]) -> Optional[tuple]:
    """The one shape that ``shapes`` (None: unknown; a negative dimension: unknown) all allow: each dimension as
    the ranks that know it have it (-1 where none does); None where two known ones differ (in rank or size)."""
    known = [s for s in shapes if s is not None]
    if not known:
        return None
    if len({len(s) for s in known}) > 1:
        return None
    merged = []
    for dims in zip(*known):
        sizes = {d for d in dims if d >= 0}
        if len(sizes) > 1:
            return None
        merged.append(sizes.pop() if sizes else -1)
    return tuple(merged)


def agree_unknown(per_rank: List[list]) -> List[list]:
    """Every rank's ``(label, dtype, shape)`` entries (as ``check_same_gradients`` gathers them), where the ranks'
    shapes of an entry differ only by what some rank did not know (a negative dimension, or a shape None): that
    entry with the shape they all allow on every rank, so that only known sizes that differ are an error. The
    rest as they were (a mismatch names each rank's shape, unknown parts as ``*``)."""
    if len({len(p) for p in per_rank}) != 1:
        return per_rank
    out = [list(p) for p in per_rank]
    for i in range(len(per_rank[0])):
        shapes = [p[i][2] for p in per_rank]
        if all(s == shapes[0] for s in shapes):
            continue
        merged = _merged_shape(shapes)
        if merged is not None:
            for p in out:
                p[i] = (p[i][0], p[i][1], merged)
    return out


def _check_same_parameters(per_rank: List[list], op, compression, skip=frozenset(),
                           ranks: Optional[Sequence[int]] = None, in_set: Optional[Sequence[int]] = None) -> None:
    """Raise TensorMismatchError (the same on every rank) unless every rank registered the same
    parameters: their number, then the first gradient whose name, dtype or shape differs (but for the
    indices in ``skip``). ``ranks``: whose lists these are, as the job numbers them (default 0, 1, ...);
    ``in_set``: the ranks of the process set they belong to, named in the message."""
    ranks = list(ranks) if ranks is not None else list(range(len(per_rank)))
    where = f" in the process set of ranks {list(in_set)}" if in_set is not None else ""
    counts = {r: len(p) for r, p in zip(ranks, per_rank)}
    if len(set(counts.values())) > 1:
        detail = "; ".join(f"rank {r}: {n}" for r, n in counts.items())
        only = only_on_some_ranks([[e[0] for e in p] for p in per_rank], ranks)
        raise TensorMismatchError(f"the number of gradients to average differs across ranks ({detail}){where}"
                                  f"{' (' + only + ')' if only else ''}: every rank must wrap an optimizer (or a "
                                  "gradient tape) over the same parameters (that take gradients: frozen on some ranks only?)")
    op = ReduceOp(int(op))
    for i in range(len(per_rank[0])):
        entries = [p[i] for p in per_rank]
        if i in skip or all(e == entries[0] for e in entries):
            continue
        names = {e[0] for e in entries}
        if len(names) > 1:
            detail = "; ".join(f"rank {r}: {e[0]!r}" for r, e in zip(ranks, entries))
            raise TensorMismatchError(f"gradient {i} has different names across ranks ({detail}){where}: every "
                                      "rank must register the same parameters in the same order, and make its "
                                      "distributed optimizers in the same order (the k-th of each rank meet)")
        comp = getattr(compression, "name", "none") if compression is not None else "none"
        metas = {r: Meta(int(Collective.ALLREDUCE), int(op), 0, 1.0, 1.0, comp, ((e[1], e[2]),))
                 for r, e in zip(ranks, entries)}
        raise TensorMismatchError(describe_mismatch(entries[0][0], metas) + where)
