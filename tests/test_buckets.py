"""Gradient buckets (aiacc.buckets), one process: layout, the per-gradient counter, the first step.

The engine here is a stand-in for a job of one rank (an allgather returns the input, an allreduce
its input); it records what the buckets submit. Real multi-rank training through the buckets is
tested in test_torch.py and test_mxnet.py.
"""

import numpy as np
import pytest

from aiacc.buckets import GradientBuckets, ParamSpec, _check_same_parameters, agree_unknown
from aiacc.names import BUCKET_SETUP_PREFIX
from aiacc.exceptions import TensorMismatchError
from aiacc.ops import Collective


class _Done:
    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result

    def done(self):
        return True


class OneRank:
    """An engine of one rank: collectives return their input; submits are recorded."""

    closed = False

    def __init__(self):
        self.submitted = []

    def submit(self, kind, array, name=None, labels=(), **_):
        self.submitted.append((Collective(kind), name, labels))
        return _Done(array)


def _params(*sizes, dtype=np.float32):
    return [ParamSpec(f"p{i}", (n,), np.dtype(dtype), "cpu", float(len(sizes) - i)) for i, n in enumerate(sizes)]


def _allreduces(engine):  # (the buckets' own: not those of the first step's agreement)
    return [s for s in engine.submitted if s[0] == Collective.ALLREDUCE and not s[1].startswith(BUCKET_SETUP_PREFIX)]


def test_first_step_learns_the_arrival_order_and_buckets_follow_it():
    engine = OneRank()
    # p3 and p2 arrive first (the last layers), 40 KB each; caps: first bucket 64 KB, then 100 KB
    b = GradientBuckets(engine, _params(100, 200, 10_000, 10_000), cap=100_000, first_cap=64_000)
    grads = {i: np.full(n, float(i + 1), np.float32) for i, n in enumerate((100, 200, 10_000, 10_000))}
    for i in (3, 2, 1, 0):
        b.ready(i, grads[i])
    assert not b.established
    b.wait()
    assert b.describe() == [["p3", "p2"], ["p1", "p0"]]  # first bucket closes at 64 KB, the rest fits
    for i, g in grads.items():  # the first step's gradients were copied into the buckets
        assert np.array_equal(b.view(i), g)
    assert [s[2] for s in _allreduces(engine)] == [("p3", "p2"), ("p1", "p0")]


def test_steady_state_submits_a_bucket_when_its_last_gradient_is_ready():
    engine = OneRank()
    b = GradientBuckets(engine, _params(1000, 1000, 1000), cap=8000, first_cap=8000)
    for i in (2, 1, 0):
        b.ready(i, np.zeros(1000, np.float32))
    b.wait()
    assert b.describe() == [["p2", "p1"], ["p0"]]
    engine.submitted.clear()
    b.ready(2)
    assert _allreduces(engine) == []  # p1 is still missing from the first bucket
    b.ready(1)
    assert len(_allreduces(engine)) == 1
    b.ready(0)
    assert len(_allreduces(engine)) == 2
    b.wait()
    assert len(_allreduces(engine)) == 2  # nothing submitted twice


def test_views_are_64_byte_aligned_and_padding_stays_zero():
    engine = OneRank()
    b = GradientBuckets(engine, _params(3, 5, 7), cap=1 << 20)
    for i in (2, 1, 0):
        b.ready(i, np.ones((3, 5, 7)[i], np.float32))
    b.wait()
    for i in range(3):
        assert b.view(i).__array_interface__["data"][0] % 64 == 0
    (bucket,) = b.buckets
    assert bucket.buffer.sum() == 15  # the ones; the padding between them is zero


def test_renew_moves_a_bucket_to_new_memory_and_leaves_the_old_to_its_holders():
    engine = OneRank()
    b = GradientBuckets(engine, _params(100, 30, 1000), cap=1000, first_cap=1000)
    for i, n in ((2, 1000), (1, 30), (0, 100)):
        b.ready(i, np.full(n, i + 1.0, np.float32))
    b.wait()
    assert b.describe() == [["p2"], ["p1", "p0"]]
    held = b.view(0)  # a result the framework still holds when the next step begins
    b.ready(1, np.full(30, 7.0, np.float32))
    assert b.renew(0) == [1, 0]
    assert np.array_equal(b.view(1), np.full(30, 7.0))  # what this step put in moved along
    assert not np.shares_memory(b.view(0), held) and b.view(0).ctypes.data % 64 == 0
    b.ready(0, np.full(100, 9.0, np.float32))  # completes the bucket, in its new memory
    assert np.array_equal(held, np.full(100, 1.0)), "the old memory must stay as it was"
    b.ready(2, np.full(1000, 5.0, np.float32))
    with pytest.raises(RuntimeError, match="p2.*in flight"):
        b.renew(2)
    b.wait()
    assert np.array_equal(b.view(0), np.full(100, 9.0)) and np.array_equal(b.view(2), np.full(1000, 5.0))


def test_a_bucket_has_one_dtype():
    engine = OneRank()
    params = _params(10, 10) + [ParamSpec("h", (10,), np.dtype(np.float16))]
    b = GradientBuckets(engine, params, cap=1 << 20)
    b.submit_rest()  # no gradient arrived: registration order reversed
    assert sorted(map(sorted, b.describe())) == [["h"], ["p0", "p1"]]


def test_missing_gradients_are_sent_as_they_are_and_zero_zeroes_every_bucket():
    engine = OneRank()
    b = GradientBuckets(engine, _params(4, 4), cap=1 << 20)
    b.ready(1, np.ones(4, np.float32))
    b.wait()  # p0 never arrived: its bucket is sent anyway (another rank may have it)
    assert b.view(0).tolist() == [0, 0, 0, 0] and b.view(1).tolist() == [1, 1, 1, 1]
    b.zero()
    assert not b.view(1).any()


def test_marking_a_gradient_twice_in_one_step_is_an_error_naming_it():
    b = GradientBuckets(OneRank(), _params(4, 4), cap=1 << 20)
    b.ready(0, np.ones(4, np.float32))
    with pytest.raises(RuntimeError, match="'p0' was marked ready twice"):
        b.ready(0, np.ones(4, np.float32))


def test_release_resets_a_bucket_once_all_its_gradients_are_consumed():
    engine = OneRank()
    b = GradientBuckets(engine, _params(4, 4), cap=1 << 20)
    for i in (1, 0):
        b.ready(i, np.ones(4, np.float32))
    b.wait_for(1)
    b.release(1)
    assert b.marked(0)  # the bucket still holds p0's consumer
    b.release(0)
    assert not b.marked(0) and not b.marked(1)
    b.ready(0)  # a new step
    b.ready(1)


def test_unique_names_are_required():
    with pytest.raises(ValueError, match="repeated: 'x'"):
        GradientBuckets(OneRank(), [ParamSpec("x", (1,), np.dtype(np.float32))] * 2)


def test_parameters_that_differ_across_ranks_are_named_with_the_ranks():
    same = [("w", "float32", (6, 4)), ("b", "float32", (4,))]
    _check_same_parameters([same, same], 0, None)  # no error
    with pytest.raises(TensorMismatchError, match=r"tensor 'w': shape differs across ranks \(rank 0: \(6, 4\); "
                                                  r"rank 1: \(7, 4\)\)"):
        _check_same_parameters([same, [("w", "float32", (7, 4)), same[1]]], 0, None)
    with pytest.raises(TensorMismatchError, match=r"number of gradients to average differs across ranks "
                                                  r"\(rank 0: 2; rank 1: 1\) \(only rank 0 has 'b'\)"):
        _check_same_parameters([same, same[:1]], 0, None)
    # three ranks, one without 'b': the two that have it are named together (each used to be named as the
    # only one: "only rank 0 has 'b'; only rank 2 has 'b'")
    with pytest.raises(TensorMismatchError, match=r"\(rank 0: 2; rank 1: 1; rank 2: 2\) \(only ranks 0,2 have 'b'\)"):
        _check_same_parameters([same, same[:1], same], 0, None)
    with pytest.raises(TensorMismatchError, match=r"\(only ranks 0,2 have 'b'; only rank 1 has 'c', 'd'\)"):
        _check_same_parameters([same, same[:1] + [("c", "float32", (4,)), ("d", "float32", (4,))], same], 0, None)
    with pytest.raises(TensorMismatchError, match=r"gradient 1 has different names across ranks \(rank 0: 'b'; "
                                                  r"rank 1: 'c'\)"):
        _check_same_parameters([same, [same[0], ("c", "float32", (4,))]], 0, None)
    # on a process set's engine: the ranks in the job, and the set
    with pytest.raises(TensorMismatchError, match=r"differs across ranks \(rank 1: 2; rank 3: 1\) in the process "
                                                  r"set of ranks \[1, 3\]"):
        _check_same_parameters([same, same[:1]], 0, None, ranks=[1, 3], in_set=[1, 3])


def test_shapes_unknown_on_some_rank_match_any_size_but_known_sizes_must_agree():
    """check_same_gradients' rule: a dimension a rank did not know (-1: traced as None) or a shape it did not know
    (None) matches the others'; two known sizes that differ are an error naming both shapes and the ranks."""
    def check(*shapes):
        _check_same_parameters(agree_unknown([[("t", "float32", s)] for s in shapes]), 0, None)

    check((-1, 2), (6, 2))
    check(None, (6, 2), (-1, 2))
    check((-1, -1), (6, -1), (-1, 2))
    for shapes, texts in ((((-1, 2), (6, 3)), ("(*, 2)", "(6, 3)")), (((-1, 2), (6, 2), (7, 2)), ("(6, 2)", "(7, 2)")),
                          (((-1,), (6, 2)), ("(*,)", "(6, 2)")), ((None, (6, 2), (7, 2)), ("unknown", "(7, 2)"))):
        with pytest.raises(TensorMismatchError) as e:
            check(*shapes)
        assert all(t in str(e.value) for t in texts + ("'t'", "rank 1")), str(e.value)


def test_flags_travel_after_the_gradients_of_the_first_float32_bucket_without_a_request_of_their_own():
    """A float16 bucket fills first; the flags go to the float32 one, past its gradients, and come back as
    whether any rank set them (one rank here: as set). Each step costs one request per bucket of gradients."""
    engine = OneRank()
    params = [ParamSpec("h", (10,), np.dtype(np.float16)), *_params(10, 10)]
    b = GradientBuckets(engine, params, cap=1 << 20, flags=3)
    b.set_flags([True, False, True])
    for i in (0, 2, 1):
        b.ready(i, np.full(10, i + 1.0, params[i].dtype))
    b.wait()
    assert b.describe() == [["h"], ["p1", "p0"]]
    assert b.flags_set().tolist() == [True, False, True]
    half, single = b.buckets
    assert single.buffer[-3:].tolist() == [1, 0, 1] and half.buffer.size == 32  # (10, padded to 64 bytes)
    for i in range(3):  # the flags never show in a gradient
        assert np.array_equal(b.view(i), np.full(10, i + 1.0))
    engine.submitted.clear()
    b.set_flags(np.array([0, 1, 0]))
    for i in (0, 2, 1):
        b.ready(i)
    b.wait()
    assert len(_allreduces(engine)) == 2 and b.flags_set().tolist() == [False, True, False]


def test_flags_go_in_a_float16_bucket_where_there_is_no_wider_float_one_and_alone_where_no_float_one():
    b = GradientBuckets(OneRank(), [ParamSpec("h", (4,), np.dtype(np.float16))], flags=1)
    b.set_flags([1])
    b.ready(0, np.ones(4, np.float16))
    b.wait()
    assert b.buckets[0].buffer.size == 33 and b.flags_set().tolist() == [True]
    engine = OneRank()  # integer gradients: an Average would round 1/n to 0; the flags travel in float32, alone
    b = GradientBuckets(engine, [ParamSpec("i", (4,), np.dtype(np.int32))], flags=1, setup_name="int")
    for flag in (1, 0):
        engine.submitted.clear()
        b.set_flags([flag])
        b.ready(0, np.ones(4, np.int32))
        b.wait()
        assert b.describe() == [["i"]] and b.flags_set().tolist() == [bool(flag)]
        sent = sorted(s[1] for s in engine.submitted if s[1] not in ("int.size", "int.data"))  # (not the setup's)
        assert sent == ["bucket[i]", "int.flags"]


def test_presence_names_the_gradients_no_rank_had_after_the_wait():
    b = GradientBuckets(OneRank(), _params(3, 5, 7), presence=True)
    b.absent(0)
    b.absent(1)
    b.ready(1, np.full(5, 2.0, np.float32))  # (ready undoes absent)
    b.ready(2, np.full(7, 3.0, np.float32))
    b.wait()  # submits the bucket with gradient 0 missing, marked absent on this (every) rank
    assert b.absent_everywhere() == [0] and b.absent_everywhere(1) == [0]
    assert np.array_equal(b.view(1), np.full(5, 2.0)) and np.array_equal(b.view(2), np.full(7, 3.0))
    for i in (2, 1, 0):  # every gradient in: ready submits the bucket, all present
        b.ready(i)
    b.wait()
    assert b.absent_everywhere() == []
    with pytest.raises(ValueError, match="Average or Sum"):
        from aiacc.ops import ReduceOp
        GradientBuckets(OneRank(), _params(4), op=ReduceOp.ADASUM, presence=True)


def test_flags_are_refused_with_adasum_and_must_be_one_per_slot():
    from aiacc.ops import ReduceOp
    with pytest.raises(ValueError, match="Average or Sum"):
        GradientBuckets(OneRank(), _params(4), op=ReduceOp.ADASUM, flags=1)
    b = GradientBuckets(OneRank(), _params(4), flags=1)
    with pytest.raises(ValueError, match="expected 1 flags"):
        b.set_flags([1, 0])


def test_flags_last_travel_in_the_bucket_that_fills_last_which_waits_for_submit_rest():
    """``flags_last`` (Keras on PyTorch sets its flags in ``apply``, after backward): the flags ride in the last
    float32 bucket to fill, which ``ready`` never submits even when full; every other bucket still goes as soon as
    its last gradient is in, and ``submitted`` says which have gone."""
    engine = OneRank()
    # p2, p1 arrive first (the last layers); p0 last. Caps: first bucket 64 KB, then 100 KB: [p2, p1], [p0]
    b = GradientBuckets(engine, _params(1000, 10_000, 10_000), cap=100_000, first_cap=64_000, flags=2,
                        flags_last=True)
    for i in (2, 1, 0):
        b.ready(i, np.full(b.params[i].shape, i + 1.0, np.float32))
    b.set_flags([1, 0])
    b.wait()
    assert b.describe() == [["p2", "p1"], ["p0"]]
    first, last = b.buckets
    assert last.buffer.size == 1008 + 2 and last.buffer[-2:].tolist() == [1, 0]  # (p0 padded to 64 bytes)
    assert b.flags_set().tolist() == [True, False]
    for step, flags in enumerate(([0, 1], [1, 1])):
        engine.submitted.clear()
        b.ready(2)
        assert not b.submitted(2) and not _allreduces(engine)
        b.ready(1)  # the first bucket is full: it goes now
        assert b.submitted(1) and [s[1] for s in _allreduces(engine)] == ["bucket[p2..p1]"]
        b.ready(0)  # full too, but it carries the flags: held back
        assert not b.submitted(0) and len(_allreduces(engine)) == 1
        b.set_flags(flags)
        b.submit_rest()
        assert b.submitted(0) and [s[1] for s in _allreduces(engine)] == ["bucket[p2..p1]", "bucket[p0]"]
        b.wait()
        assert b.flags_set().tolist() == [bool(f) for f in flags] and not b.submitted(0)
        for i in range(3):  # the flags never show in a gradient
            assert np.array_equal(b.view(i), np.full(b.params[i].shape, i + 1.0))
