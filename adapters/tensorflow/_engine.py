"""How TensorFlow code reaches the engine: directly when eager, through numpy_function ops in tf.function.

Two shapes of call:

* :func:`run_now` -- one blocking operation (the public collectives). Eagerly: submit and wait. In a
  graph: one ``numpy_function`` op that submits and waits, run on tf.data's threads (``_graph``). Errors
  are TensorFlow's classes (``_errors``).
* :class:`Batch` -- many operations handed to the engine one by one as their inputs appear, collected
  together later (gradients, variable broadcasts). In a graph::

      grad_9 ──► submit op ─┐   each submit op runs as soon as its gradient exists and returns at once
      grad_8 ──► submit op ─┤   (the Handle waits in a Python table), so TF's executor goes on computing
        ...                 │   the earlier layers' gradients while the engine already sends these
      grad_0 ──► submit op ─┴─► collect op (control-dependent on every submit) ─► results

  A gradient whose sources are registered in buckets (``Batch.ready``, see ``_buckets``) has a submit op
  too: it copies the gradient into its bucket, and the bucket's last gradient sends the bucket; the
  collect op waits for the buckets as well and hands out views of them. Small gradients that backprop
  makes one after the other share one submit op (``Batch.ready`` takes them together): a ``numpy_function`` costs tens
  of microseconds, which a model of hundreds of small gradients paid per gradient.

  Every submit runs before any wait on every rank, so ranks can never wait on each other in a cycle.
  Submit ops are taken out of the chain in which tf.function's automatic control dependencies put
  stateful ops (they have no order to keep), and TensorFlow's executor alone would still run them late:
  it may compute a gradient long after its inputs exist (with one inter-op thread, weight gradients
  at the very end of backprop). ``collect(in_submit_order=True)`` adds the control edges of
  ``_ordering`` that make each submit run before any work that only later submits need; callers create
  the submit ops in the order backprop makes the tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Callable, List, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf

import aiacc
from aiacc.api import check_process_set
from aiacc.exceptions import TensorMismatchError
from aiacc.ops import Collective

from ._bridge import (check_dtype, from_graph_output, from_numpy, graph_dtype, numpy_in, numpy_out, to_graph_input,
                      to_numpy)
from ._buckets import DENSE
from ._ordering import exempt_from_automatic_control_dependencies, run_submits_in_backprop_order
from ._errors import to_tf
from ._graph import blocking_op, check_process, process_token

__all__ = ["run_now", "Batch", "check_not_xla", "labelled"]

_pending = {}  # key -> Handle of a graph-mode submit, until its collect op takes it
_keys = itertools.count()
_after_wait = threading.local()  # ``hook``: the tracing thread's, see ``after_graph_wait``
_TOKEN = np.zeros((), np.int32)


@contextlib.contextmanager
def after_graph_wait(hook: Optional[Callable[[], None]]):
    """While a reduction is traced inside this block: its graph wait op (the next ``Batch.collect`` in a graph) calls
    ``hook()`` each time it runs, on every rank, once all of the step's collectives went through (no error) and before
    the errors this rank finds alone (``_absent_but_had``): a collective ``hook`` makes is then joined by every rank
    (the same-start check of a traced tape, ``_same_start``). Not called where the batch has nothing to wait for.
    A hook with a ``runs`` attribute (an int it keeps) also gets an output of the wait op: ``hook.step`` is set to
    that int64 scalar tensor, its ``runs`` once ``hook()`` returned (a TF1 graph's count of its runs: the wait op is
    a host call each run makes anyway, ``_same_start``)."""
    previous, _after_wait.hook = getattr(_after_wait, "hook", None), hook
    try:
        yield
    finally:
        _after_wait.hook = previous


def check_not_xla(what: str) -> None:
    """Refuse to build an engine op inside XLA-compiled code (it cannot call Python)."""
    try:
        from tensorflow.python.ops import control_flow_util  # noqa: PLC0415 - private, hence guarded

        inside = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except Exception:  # noqa: BLE001
        inside = False
    if inside:
        raise RuntimeError(f"{what}: aiacc cannot run inside XLA-compiled code (jit_compile=True); "
                           "use jit_compile=False (for Keras: model.compile(..., jit_compile=False); Keras' default, "
                           "'auto', turns XLA on where TensorFlow sees a GPU)")


def _results(kind: Collective, result, grouped: bool) -> List[np.ndarray]:
    """The engine's result of one submit as a flat list of arrays."""
    if kind == Collective.ALLTOALL:
        rows, received = result
        return [rows, np.asarray(received, dtype=np.int32)]
    return list(result) if grouped else [result]


def _out_dtypes(kind: Collective, dtypes: Sequence[tf.DType]) -> List[tf.DType]:
    return [dtypes[0], tf.int32] if kind == Collective.ALLTOALL else list(dtypes)


def _prepare(tensors, name, splits):
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        check_dtype(t, name or "(unnamed)")
    if splits is not None:
        # in the caller's dtype (a list: numpy's): the core checks it (floats are its error, not truncated)
        splits = tf.reshape(tf.convert_to_tensor(splits if isinstance(splits, (tf.Tensor, tf.Variable))
                                                 else np.asarray(splits)), [-1])
    return tensors, splits


class _Submitter:
    """The numpy side of one submit: converts arrays and calls the engine."""

    def __init__(self, kind, dtypes, name, grouped, has_splits, kwargs):
        self.kind, self.dtypes, self.name, self.grouped = kind, dtypes, name, grouped
        self.has_splits, self.kwargs = has_splits, kwargs

    def __call__(self, arrays):
        kwargs = self.kwargs
        if self.has_splits:
            arrays, kwargs = arrays[:-1], dict(kwargs, splits=arrays[-1])
        arrays = [numpy_in(a, d) for a, d in zip(arrays, self.dtypes)]
        return aiacc.submit(self.kind, arrays if self.grouped else arrays[0], name=self.name, **kwargs)


def _shaped(outputs, shapes):
    for t, shape in zip(outputs, shapes):
        if shape is not None:
            t.set_shape(shape)
    return outputs


def run_now(kind: Collective, tensors: Sequence, name: Optional[str], out_shapes: Sequence, *,
            grouped: bool = False, splits=None, **kwargs) -> List[tf.Tensor]:
    """One collective, blocking; returns its output tensors (alltoall: rows and received splits)."""
    tensors, splits = _prepare(tensors, name, splits)
    dtypes = [t.dtype for t in tensors]
    submitter = _Submitter(kind, dtypes, name, grouped, splits is not None, kwargs)
    inputs = tensors + ([splits] if splits is not None else [])
    if tf.executing_eagerly():
        try:
            handle = submitter([to_numpy(t) for t in inputs])
            return [from_numpy(a) for a in _results(kind, handle.wait(), grouped)]
        except Exception as exc:  # noqa: BLE001 - the TensorFlow class Horovod raises (see _errors)
            raise to_tf(exc).with_traceback(exc.__traceback__) from None
    check_not_xla(f"{kind} of tensor {name!r}")
    # a set that is not registered: the error now, as in eager mode (Horovod raises it when the op is made);
    # a set this rank is not in fails when the op runs
    check_process_set(kwargs.get("process_set"), f"{kind} of {name or '(unnamed)'!r}")
    out_dtypes = _out_dtypes(kind, dtypes)

    def blocking(*arrays):
        return [numpy_out(a) for a in _results(kind, submitter(list(arrays)).wait(), grouped)]

    # on tf.data's threads, not TensorFlow's few inter-op threads, which waiting collectives could all hold
    outs = blocking_op(blocking, [to_graph_input(t) for t in inputs], [graph_dtype(d) for d in out_dtypes],
                       name=f"aiacc_{kind}")
    return _shaped([from_graph_output(o, d) for o, d in zip(outs, out_dtypes)], out_shapes)


class _Item(NamedTuple):
    """One submit of a :class:`Batch`."""

    handle: object  # eager: the engine's Handle; in a graph: its key in ``_pending``; None in buckets
    kind: Collective
    dtypes: list  # of the outputs
    shapes: list  # of the outputs (None: unknown)
    grouped: bool
    buckets: object = None  # a gradient in buckets: its ``_buckets.SourceBuckets`` ...
    index: int = -1  # ... and its index there
    absent: tuple = ()  # in buckets: the gradients of the reduction this rank has none of (see ``Batch.absent``)
    vacant: str = ""  # the indices' allgather of a sparse gradient this rank has none of: its label (see ``submit``)


def labelled(error: BaseException, labels: dict) -> BaseException:
    """``error`` saying what each tensor it names is to the caller (``labels``: engine name -> a variable's name,
    which only this rank knows: Keras numbers variables per process, so they are sent under their position)."""
    text = str(error)
    found = [f"{name!r} is {what}" for name, what in labels.items() if repr(name) in text]
    if not found:
        return error
    try:
        return type(error)(f"{text} (on rank {aiacc.rank()}: {'; '.join(found)})")
    except Exception:  # noqa: BLE001 - a class of other arguments: its own message
        return error


def _finish(items: Sequence[_Item], handles: list, labels: Optional[dict] = None,
            none_if_gone: bool = False, joined: Sequence = (), after: Optional[Callable[[], None]] = None
            ) -> List[List[np.ndarray]]:
    """Per item, its result arrays, once every handle and every bucket of ``items`` is done. All are
    waited for even when one fails (nothing stays in flight); the first error is raised after.

    The buckets first: a first step settles them in a collective that checks that every rank has the same
    gradients. When that check fails, or a wait finds that some rank changed its gradients alone, the other handles
    are not waited for: they are named by position, so a rank with more gradients waited for names no other rank had
    submitted (until the stall check).
    ``none_if_gone``: a gradient in buckets that no rank had is None (eagerly). Else (in a graph, whose gradients
    None on this rank were None when it was traced, and its reduction returns None for them), such a gradient that
    another rank had in this step is an error here: this rank would not apply what the others do. ``joined``: buckets
    that no item is in, waited for until they are settled (see ``Batch.join``). ``after``: called once every wait
    went through, before this rank's own errors (``after_graph_wait``)."""
    error, results = None, None
    waits = {id(b): (b, ()) for b in joined if not b.settled}
    waits.update({id(item.buckets): (item.buckets, item.absent) for item in items if item.buckets is not None})
    for buckets, absent in waits.values():
        try:
            buckets.wait(absent)
        except Exception as exc:  # noqa: BLE001 - the first error is raised below
            # the first step's check failed (its set was dropped, see _buckets), or the ranks' lists differ now (some
            # rank changed its sources alone, see ``_buckets.SourceBuckets._retire_previous``): the other handles are
            # named by position, which another rank may never send under these names
            if buckets.buckets is None or isinstance(exc, TensorMismatchError):
                raise labelled(exc, labels) if labels else exc
            error = error or exc
    try:
        results = iter(aiacc.synchronize_all(handles))
    except Exception as exc:  # noqa: BLE001 - raised below, once the buckets are done too
        error = error or exc
    if error is not None:
        raise labelled(error, labels) if labels else error
    if after is not None:
        after()
    out = [_bucket_result(item, none_if_gone) if item.buckets is not None
           else _results(item.kind, next(results), item.grouped) for item in items]
    error = None if none_if_gone else _absent_but_had(items, out)
    if error is not None:
        raise labelled(error, labels) if labels else error
    return out


def _bucket_result(item: _Item, eager: bool) -> list:
    """The result arrays of a gradient given to buckets: its reduced gradient; where it is out of the buckets now
    (IndexedSlices on some rank, see ``_buckets.SourceBuckets.ready_sparse``), the gathered values and indices
    (in a graph, a gradient None here when traced: zeros of the one output it was traced with, not used; traced
    dense: their sum, dense)."""
    gathered = item.buckets.gathered.get(item.index)
    if gathered is None:
        view = item.buckets.result(item.index, eager)
        want = None if eager else item.dtypes[0].as_numpy_dtype
        if want is None or view is None or view.dtype == want:
            return [view]
        return [np.zeros(view.shape, want)]  # (None here when traced, as the variable's dtype: the others cast it)
    if eager or len(item.dtypes) == 2:
        return list(gathered)
    spec, want = item.buckets.specs[item.index], item.dtypes[0].as_numpy_dtype  # (a None traced as a guessed dtype)
    dense = np.zeros(spec.shape, want)
    if item.index not in item.absent:  # traced dense (its kind changed since on some rank): the sum of the slices
        values, indices = gathered
        np.add.at(dense, indices[indices >= 0], values.astype(want, copy=False))
    return [dense]


def _absent_but_had(items: Sequence[_Item], results: list) -> Optional[TensorMismatchError]:
    """In a graph: the gradients None on this rank when the function was traced (returned as None) that another
    rank had in this step, as an error naming them (None if there are none). ``results``: the items' arrays (a
    sparse one that another rank had: its gathered indices hold that rank's mark, see ``_kinds``)."""
    gathered = [item.index in item.buckets.gathered if item.buckets is not None else False for item in items]
    had = [item.buckets.specs[item.index].label for item, out in zip(items, gathered)
           if item.buckets is not None and item.index in item.absent and not out and not item.buckets.gone(item.index)]
    marks = [(item.vacant, arrays[0]) for item, arrays in zip(items, results) if item.vacant]
    marks += [(item.buckets.specs[item.index].label, item.buckets.gathered[item.index][1])  # (left the buckets)
              for item, out in zip(items, gathered) if out and item.index in item.absent]
    sparse = [label for label, ids in marks if bool((ids < 0).any()) and not bool((ids == DENSE).any())]
    had += [label for label, ids in marks if bool((ids == DENSE).any())]  # (another rank had it dense)
    if not had and not sparse:
        return None
    remedy = []
    if had:
        remedy.append("ask the tape for zeros: tape.gradient(loss, variables, "
                      "unconnected_gradients=tf.UnconnectedGradients.ZERO)")
    if sparse:
        remedy.append("look the embedding up on every rank (a lookup of no rows is enough: its gradient is a "
                      "tf.IndexedSlices of none)")
    return TensorMismatchError(
        f"the gradient of {', '.join(repr(label) for label in (had + sparse)[:5])} is None on this rank "
        f"(rank {aiacc.rank()}) in this tf.function, fixed when it was traced, but another rank computed it in this "
        "step: this rank would not apply the update the others apply. In a graph every rank's loss must depend on the "
        "same variables (a gradient None on some ranks only works eagerly); " + "; for an IndexedSlices one, ".join(
            remedy))


class Batch:
    """Operations submitted one at a time (each as soon as its inputs exist) and collected together."""

    def __init__(self, labels: Optional[dict] = None):
        """``labels``: engine name -> what that tensor is (``"variable 'dense/kernel'"``), added to errors."""
        self.eager = tf.executing_eagerly()
        self._labels = labels
        self._items: List[_Item] = []
        self._tokens = []
        self._chained = False  # some graph submit op stayed in automatic control dependencies' chain
        self._joined: list = []  # buckets this batch waits for until they are settled (see ``join``)

    def submit(self, kind: Collective, tensors: Sequence, name: str, out_shapes: Sequence, *,
               grouped: bool = False, vacant: str = "", **kwargs) -> int:
        """Hand one operation to the engine; returns its index for :meth:`collect`. ``vacant``: the gathered indices
        of gradient ``vacant``, None on this rank when the graph was traced: a -1 in them (another rank had it) is
        an error in the graph's wait (see ``_kinds``)."""
        tensors, _ = _prepare(tensors, name, None)
        dtypes = [t.dtype for t in tensors]
        submitter = _Submitter(kind, dtypes, name, grouped, False, kwargs)
        out_dtypes = _out_dtypes(kind, dtypes)
        if self.eager:
            self._items.append(_Item(submitter([to_numpy(t) for t in tensors]), kind, out_dtypes, out_shapes,
                                     grouped, vacant=vacant))
        else:
            check_not_xla(f"{kind} of tensor {name!r}")
            key = next(_keys)

            def submit(mark, *arrays):
                check_process(mark)
                _pending[key] = submitter(list(arrays))
                return _TOKEN

            self._graph_submit(submit, tensors)
            self._items.append(_Item(key, kind, out_dtypes, out_shapes, grouped, vacant=vacant))
        return len(self._items) - 1

    def ready(self, buckets, indices: Sequence[int], tensors: Sequence, names: Sequence[str],
              absent: Sequence[int] = ()) -> List[int]:
        """Hand gradients ``indices`` of ``buckets`` (a ``_buckets.SourceBuckets``) over, each copied into its
        bucket, which goes to the engine when its last gradient is in; their results are views of the
        buckets. In a graph, ONE submit op for all of them (gradients that backprop makes one after the
        other: it runs when the last one exists), so a model of many small gradients pays the op's cost per
        group, not per gradient. ``absent``: as given to :meth:`absent` (after it). Returns their indices for
        :meth:`collect`."""
        absent = tuple(absent)
        prepared = [_prepare([t], nm, None)[0][0] for t, nm in zip(tensors, names)]
        members = [(index, t.dtype) for index, t in zip(indices, prepared)]
        if self.eager:
            for index, t in zip(indices, prepared):
                buckets.ready(index, to_numpy(t), absent)
        else:
            check_not_xla(f"the gradient {names[0]!r}")

            def submit(mark, *arrays):
                check_process(mark)
                for (index, dtype), array in zip(members, arrays):
                    buckets.ready(index, numpy_in(array, dtype), absent)
                return _TOKEN

            self._graph_submit(submit, prepared)
        first = len(self._items)
        self._items.extend(_Item(None, Collective.ALLREDUCE, [t.dtype], [t.shape], False, buckets, index, absent)
                           for index, t in zip(indices, prepared))
        return list(range(first, len(self._items)))

    def ready_sparse(self, buckets, index: int, values, indices, name: str, absent: Sequence[int] = ()) -> int:
        """Hand gradient ``index`` of ``buckets``, IndexedSlices on this rank (``values``, and ``indices`` as int64
        ending with -1), over: see ``_buckets.SourceBuckets.ready_sparse``. Its result is the gathered values and
        indices. Returns its index for :meth:`collect`."""
        absent = tuple(absent)
        values, indices = _prepare([values, indices], name, None)[0]
        if self.eager:
            buckets.ready_sparse(index, to_numpy(values), to_numpy(indices), absent)
        else:
            check_not_xla(f"the gradient {name!r}")
            dtype = values.dtype

            def submit(mark, v, i):
                check_process(mark)
                buckets.ready_sparse(index, numpy_in(v, dtype), i, absent)
                return _TOKEN

            self._graph_submit(submit, [values, indices])
        self._items.append(_Item(None, Collective.ALLGATHER, [values.dtype, tf.int64],
                                 [[None] + values.shape[1:], [None]], False, buckets, index, absent))
        return len(self._items) - 1

    def absent(self, buckets, indices: Sequence[int], dtypes: Sequence[tf.DType], shapes: Sequence) -> List[int]:
        """Gradients ``indices`` of ``buckets`` that this rank has none of in this step (before any
        :meth:`ready` of these buckets, which gets the same ``indices``): their buckets send zeros for them and
        say so (presence), and their results are the reduction of the ranks that had them -- eagerly None
        where no rank had them. No op of their own. Returns their indices for :meth:`collect`."""
        absent = tuple(indices)
        first = len(self._items)
        self._items.extend(_Item(None, Collective.ALLREDUCE, [d], [s], False, buckets, index, absent)
                           for index, d, s in zip(indices, dtypes, shapes))
        return list(range(first, len(self._items)))

    def join(self, buckets) -> None:
        """Take part in the first step of ``buckets`` (a ``_buckets.SourceBuckets``) though no gradient of this batch
        goes in them: a rank whose gradients are all out of the buckets (IndexedSlices, dense of a shape unknown while
        traced, None of a source of unknown shape), while another rank has some of them in buckets, must meet that
        rank's first-step collective (which checks the kinds and the tables' shapes, see
        ``SourceBuckets._check_kinds``), or both waited until the stall inspector. The wait settles them once; after
        that it skips them (one attribute test a step)."""
        self._joined.append(buckets)

    def _graph_submit(self, submit, tensors) -> None:
        token = tf.numpy_function(submit, [process_token(), *[to_graph_input(t) for t in tensors]], tf.int32,
                                  stateful=True, name="aiacc_submit")
        self._chained |= not exempt_from_automatic_control_dependencies(token.op)
        self._tokens.append(token)

    def collect(self, in_submit_order: bool = False) -> List[List[tf.Tensor]]:
        """Wait for everything submitted; per submit, the list of its output tensors.

        ``in_submit_order`` (graph mode): each submit op runs before any work that only later submits
        need (see ``_ordering``); for gradients submitted in the order backprop makes them. A batch with nothing
        submitted but buckets joined (``join``: a rank whose gradients are all None of sources of unknown shape) still
        waits for them: eagerly here, in a graph in a wait op of one unused output (run by automatic control
        dependencies, as every stateful op of a tf.function)."""
        if not self._items and not self._joined:
            return []
        if in_submit_order and not self.eager:
            run_submits_in_backprop_order([t.op for t in self._tokens], self._chained)
        items = self._items
        if self.eager:
            try:
                results = _finish(items, [item.handle for item in items if item.buckets is None], self._labels,
                                  none_if_gone=True, joined=self._joined)
            except Exception as exc:  # noqa: BLE001 - the TensorFlow class Horovod raises (see _errors), as run_now
                raise to_tf(exc).with_traceback(exc.__traceback__) from None
            return [[None if a is None else from_numpy(a) for a in arrays] for arrays in results]

        labels, joined = self._labels, list(self._joined)
        # (the first wait this thread traces in ``after_graph_wait``'s block: another thread's tracing has its own)
        after, _after_wait.hook = getattr(_after_wait, "hook", None), None

        counted = after is not None and hasattr(after, "runs")

        def wait(*_tokens):
            results = _finish(items, [_pending.pop(item.handle) for item in items if item.buckets is None], labels,
                              joined=joined, after=after)
            out = [numpy_out(a) for arrays in results for a in arrays] or [np.zeros((), np.int32)]
            return out + [np.int64(after.runs)] if counted else out

        # (a blocking op: its error leaves the graph as the TensorFlow class Horovod raises, as every collective's;
        # a plain numpy_function made a mismatch found here an InvalidArgumentError. In program order, as before.)
        flat_dtypes = [d for item in items for d in item.dtypes] or [tf.int32]  # (joined only: one unused output)
        inputs = list(self._tokens) or [tf.zeros((), tf.int32)]  # (joined only: an op needs an input too)
        flat = blocking_op(wait, inputs, [graph_dtype(d) for d in flat_dtypes] + [tf.int64] * counted,
                           name="aiacc_wait", independent=False)
        if counted:
            after.step = flat.pop()
            after.step.set_shape(())
        flat = [from_graph_output(o, d) for o, d in zip(flat, flat_dtypes)]
        out, at = [], 0
        for item in items:
            out.append(_shaped(flat[at:at + len(item.dtypes)], item.shapes))
            at += len(item.dtypes)
        return out


