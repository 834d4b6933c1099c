"""Inside ``tf.function``: make each gradient's submit op run as soon as its gradient exists.

Why (measured with TF 2.21 on CPU, 2 ranks on 2 cores, the 5-layer MLP the timeline test used, with
the TF profiler and aiacc's timeline): two things held every submit back to the end of backprop.

1. TensorFlow's executor runs the ops that are ready in no guaranteed order. With one inter-op thread
   (``set_inter_op_parallelism_threads(1)``, how one rank per core is run), an op that finishes runs
   one expensive successor inline and queues the others on the inter-op pool, i.e. behind the same
   thread's inline work: they run only once the inline chain has ended, last queued first. In backprop
   that chain is the input-gradient path down to the first layer; every ``BiasAddGrad`` and some weight
   ``MatMul`` ran after it, in the last 1.4 ms of a 21 ms backprop.
2. tf.function's automatic control dependencies chain every stateful op without resource inputs (each
   ``numpy_function(stateful=True)``) in creation order. The first submit (the last layer's bias
   gradient) was among the gradients left to the end, so every submit waited for it, also those whose
   gradient had existed for 20 ms.

All ten submits then ran within 0.7 ms, after the last gradient kernel; in 8 steps of 8 no gradient was
sent while backprop ran. Not the cause: the engine (with two inter-op threads the same graph overlapped
in 9 steps of 10) and the model size (backprop took 10-20 ms).

What this module does, once per traced gradient call (graph construction only, nothing at run time)::

    backprop ops needed by  g0 ──► submit0
                                      │ control edge
                                      ▼
    backprop ops needed by g1, not by g0 ──► submit1
                                               │
                                               ▼
    backprop ops needed by g2, not by g0, g1 ──► submit2   ...

The gradients are taken in the order backprop makes them. The ops that the k-th gradient needs and no
earlier one does form its *stage*; the first ops of stage k (those whose inputs all come from earlier
stages or from the forward pass) get a control input from submit k-1. So no work of a later gradient can
start before the earlier gradient has been handed to the engine, whatever order the executor prefers,
and the executor cannot leave a gradient (or its submit) for the end. Nothing is reordered within a
stage, no op is added or removed, and every edge points from an op to work that did not precede it, so
the graph stays acyclic (also after automatic control dependencies add theirs, see ``_AcdChain``, and
after Grappler folds shape arithmetic and oneDNN fuses ops: shape arithmetic gets no edge, see ``_gate``).

The price: none with one inter-op thread (the same kernels run one after another, only in another
order). With several inter-op threads and one intra-op thread, two stages no longer run side by side (a
layer's input gradient waits for its weight gradient); on this 2-core machine that was lost in the noise
of A/B runs. On a GPU the executor only launches kernels, and a control edge behind a submit (which
copies its gradient to the host) would stall the launches: so the adapter applies this on host-only
TensorFlow (see ``gradients.py``). Building the edges is one walk over the graph per trace (12 ms for the
818 ops of the transformer benchmark).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Set

import tensorflow as tf

__all__ = ["exempt_from_automatic_control_dependencies", "run_submits_in_backprop_order"]


# AutoGraph would convert these plain graph walks (they run while tf.function traces): seconds per trace.
@tf.autograph.experimental.do_not_convert
def exempt_from_automatic_control_dependencies(op: tf.Operation) -> bool:
    """Take a submit op out of the chain that automatic control dependencies (tf.function) put every
    stateful op without resource inputs in: a submit has no order to keep with other stateful ops, and
    in that chain it would wait for any stateful op created before it (say, the gradient of an aiacc
    collective used by the model, deep in backprop). It still runs: the graph's outputs wait for it.
    Returns False where the graph has no such manager (eager, or a TF1-style graph)."""
    manager = getattr(op.graph, "experimental_acd_manager", None)
    if manager is None:
        return False
    manager.run_independently(op)
    return True


def _producers(op: tf.Operation) -> List[tf.Operation]:
    return [t.op for t in op.inputs] + list(op.control_inputs)


class _AcdChain:
    """The ops that automatic control dependencies may still order among themselves when the function is
    finished, and a conservative model of that order.

    It orders stateful ops and ops on resources, always an earlier-created op before a later one (outside
    TF1-style control flow, where nothing is added here). Taking each such op to depend on *all* such ops
    created before it covers every edge it can add: a stage that needs one of them also takes all the
    earlier ones, so no edge added later can point from a later stage back into an earlier one (which
    would be a cycle through the control edges added here)."""

    def __init__(self, ops: Sequence[tf.Operation], skip: Set[tf.Operation]):
        self.ops = [op for op in ops if op not in skip and _may_be_ordered(op)]
        self.position: Dict[tf.Operation, int] = {op: i for i, op in enumerate(self.ops)}
        self.taken = 0  # self.ops[:taken] are in some stage already

    def before(self, op: tf.Operation) -> List[tf.Operation]:
        """The chain ops created before ``op`` that no stage has taken yet, if ``op`` is in the chain (they
        all come first); marks them and ``op`` as taken."""
        end = self.position.get(op)
        if end is None or end < self.taken:
            return []
        earlier, self.taken = self.ops[self.taken:end], end + 1
        return earlier

    def all_remaining(self) -> List[tf.Operation]:
        rest, self.taken = self.ops[self.taken:], len(self.ops)
        return rest


def _may_be_ordered(op: tf.Operation) -> bool:
    return op._is_stateful or any(t.dtype == tf.resource for t in op.inputs)  # noqa: SLF001


@tf.autograph.experimental.do_not_convert
def run_submits_in_backprop_order(submits: Sequence[tf.Operation], chained: bool) -> int:
    """Add the control edges described in the module docstring; ``submits`` in the order backprop makes
    their inputs, all in one graph. ``chained``: the submits could not be exempted from automatic control
    dependencies (the first then waits for every stateful op before it). Returns the edges added."""
    if len(submits) < 2:
        return 0
    ops = submits[0].graph.get_operations()
    if any(op._control_flow_context is not None for op in ops):  # noqa: SLF001
        # TF1-style control flow (Switch/Merge, only with control flow v2 switched off): automatic control
        # dependencies may point a Merge back at later ops there, which the model below does not cover.
        return 0
    mine = set(submits)
    chain = _AcdChain(ops, mine)
    done: Set[tf.Operation] = set()
    added = 0
    previous = None
    for k, submit in enumerate(submits):
        roots = [p for p in _producers(submit) if p not in mine]
        if chained and k == 0:
            roots += chain.all_remaining()
        stage = _take_stage(roots, done, chain)
        done.add(submit)
        if previous is not None:
            added += _gate(stage, previous)
        previous = submit
    return added


def _take_stage(roots, done: Set[tf.Operation], chain: _AcdChain) -> List[tf.Operation]:
    """Every op that ``roots`` need and no earlier stage took, marked as taken."""
    stage = []
    stack = list(roots)
    while stack:
        op = stack.pop()
        if op in done:
            continue
        done.add(op)
        stage.append(op)
        stack.extend(_producers(op))
        stack.extend(chain.before(op))
    return stage


# Ops that compute only from shapes. Grappler folds them into constants when the shapes are static, and a
# control input of a folded op moves onto its constant: an edge there would no longer hold the op that does
# the work back, but let the remapper fuse that op with work of an earlier stage. oneDNN fuses a layer's
# Conv2DBackpropFilter with its BiasAddGrad: with the bias gradient in an earlier submit than the kernel's (an
# L2 regularizer adds to the kernel's), the edge from that submit to the filter gradient's ShapeN became a
# cycle through the fused op ("1696 nodes in a cycle": Keras' ResNet50 with regularizers, Horovod's ImageNet
# example). They are seen through instead: the op that uses them is gated itself, and an op with a control
# input is not fused.
_SHAPE_SOURCES = frozenset({"Shape", "ShapeN", "Size", "Rank"})
_SHAPE_ARITHMETIC = frozenset({"StridedSlice", "Slice", "Pack", "Unpack", "ConcatV2", "Concat", "Gather", "GatherV2",
                               "Cast", "Prod", "Sum", "Add", "AddV2", "Sub", "Mul", "Maximum", "Minimum",
                               "FloorDiv", "RealDiv", "BroadcastGradientArgs", "BroadcastArgs", "Reshape",
                               "Identity", "Range", "Fill", "ExpandDims", "Squeeze"})


def _shape_only(stage: List[tf.Operation]) -> Set[tf.Operation]:
    """The ops of ``stage`` that compute only from shapes (and constants) of tensors made before it."""
    found: Set[tf.Operation] = {op for op in stage if op.type in _SHAPE_SOURCES}
    members = set(stage)
    candidates = [op for op in reversed(stage) if op.type in _SHAPE_ARITHMETIC and op.inputs]
    grew = True
    while grew:  # (mostly one pass: a stage lists an op before what it needs, so reversed, producers come first)
        grew = False
        for op in candidates:
            if op not in found and all(p in found or (p not in members and p.type == "Const") for p in _producers(op)):
                found.add(op)
                grew = True
    return found


def _gate(stage: List[tf.Operation], submit: tf.Operation) -> int:
    """Give the first ops of ``stage`` that do work a control input from ``submit`` (shape arithmetic is
    seen through, see ``_SHAPE_SOURCES``); returns how many."""
    members = set(stage)
    shapes = _shape_only(stage)
    added = 0
    for op in stage:
        if op in shapes:
            continue
        producers = _producers(op)
        if not producers:
            continue  # a source (constant, function argument): nothing to wait for, nothing to hold back
        if any(p in members and p not in shapes and _producers(p) for p in producers):
            continue  # an op of this stage comes first; holding that one back holds this one back too
        op._add_control_input(submit)  # noqa: SLF001 - what automatic control dependencies use themselves
        added += 1
    return added
