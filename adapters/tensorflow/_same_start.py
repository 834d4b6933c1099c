"""The TensorFlow and Keras wrappers' check that every rank starts from the same variables (see ``aiacc.same_start``).

Where the second step is, and what is compared:

* Keras' ``DistributedOptimizer`` (Keras 3 on the TensorFlow, PyTorch and JAX backends, Keras 2): the call of ``apply``
  (Keras 2: of ``compute_gradients`` / ``get_gradients``) made when the optimizer's own step counter
  (``iterations``; under gradient accumulation Keras 3's count of micro-batches) reads 1, comparing the variables
  it trains: not the non-trainable ones (BatchNorm's moving statistics, which each rank may keep its own of), not
  ``register_local_var``'s, not ``BroadcastGlobalVariablesCallback(local_variables=...)``'s. On JAX, whose step is
  one compiled function (``apply`` traced in Keras' stateless scope), the same step: ``_jax_at_second_step``.
* ``DistributedGradientTape``: a script makes a new tape every step, so the count is kept per tape name, process set
  and variables among the sources (the same objects: a new model counts anew): the second ``gradient()`` for them
  compares those variables (watched tensors are inputs, and ``register_local_source``'s differ by design). A
  persistent tape asked twice for the same sources in its first step compares at that second call. A traced
  ``gradient()`` is counted and compared in its reduction's graph wait (``wait_hook``): there every rank has
  gone through the step's collectives and none has raised an error of its own yet (a gradient None on that rank
  only, ``_engine._absent_but_had``), so every rank joins the comparison; a ``tf.cond`` after the reduction (as
  Keras') would leave the others waiting in it for a rank that failed its step, and a traced counter would need a
  variable, which a function traced again may not make.
* TF1's ``DistributedOptimizer`` (``compute_gradients``): the same as the tape, counted per optimizer name, process set
  and variables (not ``register_local_var``'s).
* In a TF1 graph run by a ``Session`` (a tape's or TF1's optimizer's), whose variables Python cannot read while it
  runs: the reduction's wait op counts the runs of the graph (``_Runs``) and outputs the count, and a ``tf.cond`` on it
  reads the variables in the graph at the second run (as in ``tf.function`` below).

In ``tf.function`` (``model.fit``, a traced Keras step) the count is Keras' variable and the comparison sits in a
``tf.cond`` that runs on the step that reads 1: its collective waits for every reduction of that call (a control
dependency on the reduced gradients, so no rank blocks in it while another still needs it for a gradient) and runs
on tf.data's threads (``_graph.blocking_op``), and the update waits for it (the values compared are the ones before
the update). Every later step runs the ``tf.cond``'s empty branch: no collective. Eagerly, a Python check.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

import aiacc
from aiacc.same_start import check_same_start, user_site

from ._bridge import to_graph_input
from ._graph import blocking_op

__all__ = ["keras_step", "tape_step", "tape_hook", "wait_hook", "legacy_optimizer_step", "exempt",
           "in_tf1_graph", "KERAS_FIX", "TAPE_FIX", "LEGACY_FIX", "GRAPH_FIX"]

KERAS_FIX = ("Broadcast rank 0's variables when training starts: model.fit(..., callbacks=["
             "hvd.callbacks.BroadcastGlobalVariablesCallback(0)]) (in a custom loop: "
             "hvd.broadcast_variables(model.variables, root_rank=0) and hvd.broadcast_variables(optimizer.variables, "
             "root_rank=0) after the first step).")
TAPE_FIX = ("Broadcast rank 0's variables after the first step: hvd.broadcast_variables(model.variables, root_rank=0) "
            "and hvd.broadcast_variables(optimizer.variables, root_rank=0).")
LEGACY_FIX = ("Broadcast rank 0's variables after the first step: hvd.broadcast_variables(var_list, root_rank=0) and "
              "hvd.broadcast_variables(optimizer.variables(), root_rank=0).")
GRAPH_FIX = ("Broadcast rank 0's variables when the session starts: hooks=[hvd.BroadcastGlobalVariablesHook(0)] in the "
             "MonitoredTrainingSession, or session.run(hvd.broadcast_global_variables(0)) after the initializer.")


_numbers: dict = {}  # (what, prefix, process set id) -> the numbers of its checks' collectives


def _tag(what: str, prefix: str, process_set) -> str:
    """The name of a new check's collectives: two may run at once in a traced step (a GAN's two tapes or optimizers
    under one name), numbered per name and process set, whose ranks make the same checks in the same order."""
    key = (what, prefix, getattr(process_set, "process_set_id", 0))
    return f"{what}.{prefix}.{next(_numbers.setdefault(key, itertools.count()))}"


def _enabled(process_set) -> bool:
    if aiacc.outside_process_set(process_set):
        return False
    engine = aiacc.engine_for(process_set)
    return engine is not None and engine.config.check_same_start


def _is_variable(v) -> bool:
    """A variable (tf.Variable, a Keras one) of a dtype whose bytes say its value; not a watched tensor."""
    if not (isinstance(v, tf.Variable) or (hasattr(v, "assign") and hasattr(v, "path"))):
        return False
    try:
        dtype = tf.as_dtype(v.dtype)
    except TypeError:
        return False
    return dtype.is_floating or dtype.is_integer or dtype.is_complex or dtype.is_bool


def _name(v, i: int) -> str:
    name = getattr(v, "path", None) or getattr(v, "name", None)
    return name.split(":")[0] if isinstance(name, str) and name else f"variable {i}"


def _numpy(v) -> np.ndarray:
    if isinstance(v, tf.Variable):
        return v.numpy()
    import keras  # noqa: PLC0415 - a Keras variable (any backend)

    return np.asarray(keras.ops.convert_to_numpy(v))


def _compared(variables: Sequence) -> List[Tuple[str, object]]:
    return [(_name(v, i), v) for i, v in enumerate(variables) if _is_variable(v)]


def _on_host(pairs: List[Tuple[str, object]], skip: Callable[[], set], what: str, fix: str, process_set,
             tag: str) -> Callable[..., np.ndarray]:
    """The host side of a compiled step's comparison: ``run(*arrays)``, the values of ``pairs``' variables in their
    order, compares those that ``skip()`` (asked then) does not leave out and returns how many differ (int32)."""
    ids, where = [id(v) for _, v in pairs], user_site()  # (the script's line that builds the step)

    def run(*arrays) -> np.ndarray:
        left_out = skip()
        bad = check_same_start(((n, np.asarray(a)) for (n, _), i, a in zip(pairs, ids, arrays) if i not in left_out),
                               what, fix, process_set, stacklevel=1, name=tag, where=where)
        return np.array(len(bad), np.int32)

    return run


@tf.autograph.experimental.do_not_convert  # (plain Python while a function is traced)
def at_second_step(step, grads: list, variables: Sequence, skip: Callable[[], set], what: str, fix: str,
                   process_set, tag: str, stacklevel: int) -> list:
    """``grads`` (a flat list; None stays None), once the comparison of ``variables`` ran where ``step`` (the calls
    before this one: a Python int eagerly, a scalar tensor in a graph) is 1. ``skip()``: the ids of variables left
    out, asked when the comparison runs (the broadcast callback names its local variables after the first trace)."""
    pairs = _compared(variables)
    if not pairs:
        return grads
    if tf.executing_eagerly():
        if int(step) == 1:
            left_out = skip()
            check_same_start(((n, _numpy(v)) for n, v in pairs if id(v) not in left_out), what, fix, process_set,
                             stacklevel=stacklevel + 1, name=tag, where=user_site())  # (Keras' fit: its line)
        return grads
    deps = [t for g in grads if g is not None for t in tf.nest.flatten(g, expand_composites=True)]
    run = _on_host(pairs, skip, what, fix, process_set, tag)

    def compare():
        with tf.control_dependencies(deps):  # (after this call's reductions, on every rank)
            values = [to_graph_input(tf.identity(tf.convert_to_tensor(v))) for _, v in pairs]
        return blocking_op(lambda *arrays: [run(*arrays)], values, [tf.int32], name="aiacc_same_start")[0]

    done = tf.cond(tf.equal(step, 1), compare, lambda: tf.constant(0, tf.int32))
    with tf.control_dependencies([done]):  # (the update reads these: after the comparison)
        return [None if g is None else tf.identity(g) for g in grads]


# ---- Keras' DistributedOptimizer -------------------------------------------------------------------------------
def exempt(optimizer, variables) -> None:
    """Leave ``variables`` out of ``optimizer``'s comparison (and of the inner optimizer's of a loss-scale one):
    ``BroadcastGlobalVariablesCallback``'s local variables, which keep each rank's value."""
    while optimizer is not None:
        skipped = optimizer.__dict__.get("_aiacc_same_start_skip")
        if skipped is None:
            skipped = {}
            object.__setattr__(optimizer, "_aiacc_same_start_skip", skipped)  # (not tracked by Keras)
        skipped.update((id(v), v) for v in variables)  # (held, so that the ids are not reused)
        optimizer = getattr(optimizer, "inner_optimizer", None)


def _keras_backend() -> str:
    import keras  # noqa: PLC0415 - Keras 3 (its variables: the optimizer's step counter)

    return keras.backend.backend()


@tf.autograph.experimental.do_not_convert
def keras_step(opt, grads, variables, step) -> list:
    """``DistributedOptimizer``'s gradients for its update, once ``step`` (its count of earlier calls) is 1: then
    after the comparison of ``variables`` across the ranks (Keras 3 on TensorFlow, PyTorch and JAX, Keras 2)."""
    grads = list(grads)
    reducer = opt.__dict__.get("_aiacc_reducer")
    if reducer is None or opt.__dict__.get("_aiacc_same_start_done") or not _enabled(reducer.process_set):
        return grads
    jax = not isinstance(step, tf.Variable) and _keras_backend() == "jax"  # (also run_eagerly: a jax.lax.cond)
    if not jax and tf.executing_eagerly():
        step = int(_numpy(step))
        if step >= 1:
            object.__setattr__(opt, "_aiacc_same_start_done", True)  # (eagerly: no question after the second call)
    elif not jax:
        step = tf.convert_to_tensor(step)

    def skip() -> set:
        return set(opt.__dict__.get("_aiacc_local") or ()) | set(opt.__dict__.get("_aiacc_same_start_skip") or ())

    tag = opt.__dict__.get("_aiacc_same_start_tag")
    if tag is None:  # (numbered at the first call: in the same order on every rank)
        tag = _tag("DistributedOptimizer", reducer.prefix, reducer.process_set)
        object.__setattr__(opt, "_aiacc_same_start_tag", tag)
    if jax:
        return _jax_at_second_step(step, grads, list(variables), skip, "DistributedOptimizer", KERAS_FIX,
                                   reducer.process_set, tag, reduced=not opt.gradient_accumulation_steps,
                                   local=opt.__dict__.get("_aiacc_local") or {})
    return at_second_step(step, grads, list(variables), skip, "DistributedOptimizer", KERAS_FIX,
                          reducer.process_set, tag, stacklevel=3)


def _jax_at_second_step(step, grads: list, variables: Sequence, skip: Callable[[], set], what: str, fix: str,
                        process_set, tag: str, reduced: bool, local) -> list:
    """``at_second_step`` on Keras' JAX backend, whose train step is one compiled function (the variables' values
    are traced ones, in Keras' stateless scope): a ``jax.lax.cond`` on ``step`` whose true branch hands the values
    to the host (``keras._jax_call.host_call``), where they are compared. Every rank makes the step's collectives
    in the same order: where the gradients are ``reduced`` (one host call made all of those not in ``local``), the
    values are taken after one element of one of them, so the comparison comes after that call (a dependency on
    every gradient would keep XLA from reading them straight out of the reduction's flat array: a copy per
    gradient), and the smallest gradient is returned through a select on the comparison's result (the call has no
    side effects for XLA: a result nobody reads could be dropped); gradients to be reduced later (Keras'
    accumulation averages in its update branch) all come out after the comparison. Later steps run the empty
    branch: nothing crosses to the host."""
    import jax  # noqa: PLC0415 - Keras on JAX only
    import jax.numpy as jnp  # noqa: PLC0415

    from .keras._jax_call import host_call  # noqa: PLC0415

    pairs = _compared(variables)
    if not pairs:
        return grads
    present = [i for i, g in enumerate(grads) if g is not None]
    values = [jnp.asarray(v.value) for _, v in pairs]
    sent = [i for i in present if id(variables[i]) not in local]
    if reduced and sent:
        values, _ = jax.lax.optimization_barrier((values, jnp.ravel(grads[sent[0]])[:1]))
    run = _on_host(pairs, skip, what, fix, process_set, tag)

    def compare(values):
        return host_call(run, jax.ShapeDtypeStruct((), np.int32), *values)

    step = jnp.asarray(step.value if hasattr(step, "value") else step)
    done = jax.lax.cond(step == 1, compare, lambda values: jnp.zeros((), jnp.int32), values)
    out = list(grads)
    if reduced and present:
        i = min(present, key=lambda k: int(np.prod(grads[k].shape)))
        out[i] = jnp.where(done < 0, jnp.zeros_like(grads[i]), grads[i])  # (never: a count of variables)
    elif present:
        kept, _ = jax.lax.optimization_barrier(([grads[i] for i in present], done))
        for i, g in zip(present, kept):
            out[i] = g
    return out


# ---- DistributedGradientTape, TF1's DistributedOptimizer ------------------------------------------------------
class _Count:
    """The eager ``gradient()`` calls of one list of sources (``compute_gradients`` calls of a TF1 optimizer's)."""

    def __init__(self, variables: list, reducer, what: str):
        self.calls = 0
        self.refs = [weakref.ref(v) for v in variables]  # (not held: a dead one frees the entry, see _count_for)
        self.tag = _tag(what, reducer.prefix, reducer.process_set)

    def of(self, variables: list) -> bool:
        return len(self.refs) == len(variables) and all(r() is v for r, v in zip(self.refs, variables))


_counts: dict = {}  # (wrapper, its name, process set id, the variables' ids) -> _Count


def _count_for(reducer, variables: list, what: str) -> _Count:
    """The count of ``gradient()`` calls for ``variables`` (a new model's: a new count, even where its variables have
    the names of an earlier one's)."""
    key = (what, reducer.prefix, getattr(reducer.process_set, "process_set_id", 0), tuple(map(id, variables)))
    count = _counts.get(key)
    if count is None or not count.of(variables):
        for old in [k for k, c in _counts.items() if any(r() is None for r in c.refs)]:
            del _counts[old]
        count = _counts[key] = _Count(variables, reducer, what)
    return count


def in_tf1_graph() -> bool:
    """Building a TF1 graph, which a ``Session`` runs (not eager, not ``tf.function``)."""
    return not tf.executing_eagerly() and not tf.compat.v1.executing_eagerly_outside_functions()


def _tape_variables(tape, sources) -> list:
    local = tape.__dict__.get("_aiacc_local") or {}
    return [v for v in tf.nest.flatten(sources) if _is_variable(v) and id(v) not in local]


def _counted_step(reducer, flat: list, variables: list, skip: Callable[[], set], what: str, fix: str,
                  stacklevel: int, hook) -> list:
    """``flat`` (gradients, None stays None) after the comparison of ``variables`` at the second call for them:
    eagerly counted here; in a TF1 graph at the second run of the graph (``hook``, ``wait_hook``'s ``_Runs``). Not in
    ``tf.function`` (``wait_hook``'s comparison in the reduction's wait)."""
    if not variables or not _enabled(reducer.process_set):
        return flat
    if in_tf1_graph():
        if not isinstance(hook, _Runs) or hook.step is None:  # (no wait op traced: nothing was reduced)
            return flat
        tag = _tag(what, reducer.prefix, reducer.process_set)  # (a graph is built in the same order on every rank)
        return at_second_step(hook.step, flat, variables, skip, what, GRAPH_FIX, reducer.process_set, tag,
                              stacklevel=stacklevel + 1)
    if not tf.executing_eagerly():
        return flat
    count = _count_for(reducer, variables, what)
    if count.calls >= 2:
        return flat
    count.calls += 1
    return at_second_step(count.calls - 1, flat, variables, skip, what, fix, reducer.process_set, count.tag,
                          stacklevel=stacklevel + 1)


class _Runs:
    """A TF1 graph's count of its runs (a ``Session`` runs it; Python cannot read its variables meanwhile): the hook
    of its reduction's wait op (``_engine.after_graph_wait``), a host call each run makes anyway, which then outputs
    ``runs``, the runs before this one, as ``step`` (an int64 scalar tensor). The comparison is ``at_second_step``'s
    ``tf.cond`` on it, reading the variables in the graph; later runs take its empty branch."""

    def __init__(self):
        self.runs = -1
        self.step = None  # (set when the wait op is traced)

    def __call__(self) -> None:
        self.runs += 1


def tape_step(tape, reducer, grads, sources, hook):
    """The gradients ``tape.gradient()`` returns (a nest like ``sources``'s), after the comparison of the variables
    among ``sources`` at the second eager call for these sources, or the second run of a TF1 graph (``hook``:
    ``tape_hook``'s, given to the reduction's wait)."""
    if tape.__dict__.get("_aiacc_undistributed") or not _enabled(reducer.process_set):
        return grads
    flat = _counted_step(reducer, tf.nest.flatten(grads), _tape_variables(tape, sources), set,
                         "DistributedGradientTape", TAPE_FIX, 5, hook)  # (stacklevel; +1: do_not_convert's wrapper)
    return tf.nest.pack_sequence_as(grads, flat)


def tape_hook(tape, reducer, sources):
    """(While ``gradient()`` is traced.) ``wait_hook`` for the variables among ``sources``; eagerly None at once (no
    look at the sources on every step)."""
    if tape.__dict__.get("_aiacc_undistributed") or tf.executing_eagerly():
        return None
    return wait_hook(reducer, _tape_variables(tape, sources), set, "DistributedGradientTape", TAPE_FIX)


def wait_hook(reducer, variables: list, skip: Callable[[], set], what: str, fix: str):
    """(While a reduction is traced in a graph.) What its wait op calls each time it runs
    (``_engine.after_graph_wait``). In ``tf.function``: at the second run for these variables (counted with the eager
    calls), the comparison of those that ``skip()`` does not leave out, read there: after every collective of the step
    went through on every rank and before any rank raises an error of its own (a gradient None on that rank only), so
    that every rank joins it, and before the update (which waits for the reduced gradients). In a TF1 graph: a
    ``_Runs`` (``_counted_step`` compares in the graph). None where nothing is compared (eagerly: ``_counted_step``)."""
    if tf.executing_eagerly() or not _enabled(reducer.process_set):
        return None
    variables = [v for v in variables if _is_variable(v)]
    if not variables:
        return None
    if in_tf1_graph():
        return _Runs()
    count, pairs, process_set = _count_for(reducer, variables, what), _compared(variables), reducer.process_set
    where = user_site()  # (the script's line that traces the step)

    def after() -> None:
        if count.calls >= 2:
            return
        count.calls += 1
        if count.calls == 2:
            left_out = skip()
            check_same_start(((n, _numpy(v)) for n, v in pairs if id(v) not in left_out), what, fix, process_set,
                             stacklevel=1, name=count.tag, where=where)

    return after


def legacy_optimizer_step(opt, reducer, flat: list, variables: list, hook) -> list:
    """TF1 ``DistributedOptimizer.compute_gradients``' gradients (a list, None stays None), after the comparison of
    its variables (not ``register_local_var``'s) at the second call for them: eagerly, or at the second run of a TF1
    graph (``hook``: ``wait_hook``'s, given to the reduction's wait; in ``tf.function`` that hook compares)."""
    if not _enabled(reducer.process_set):
        return flat
    return _counted_step(reducer, flat, [v for v in variables if _is_variable(v)], lambda: set(opt._aiacc_local),
                         "DistributedOptimizer", LEGACY_FIX, 6, hook)  # (stacklevel: the script)
