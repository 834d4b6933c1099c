"""Fusion and bucketing, one process: the pure parts the engine's hot path relies on.

No MPI here: requests are built by the real RequestFactory; the rank-to-rank wiring is what the
multi-process tests check.
"""

import random
import threading

import numpy as np
import pytest

from aiacc.fusion import Bucket, FusionBuffers, PlanCache, Run, pack, plan, plan_cached, unpack
from aiacc.negotiation import CacheEntry, Response
from aiacc.ops import Average, Collective, Max, Sum
from aiacc.requests import RequestFactory, Waker
from aiacc.scheduler import Scheduler


def _factory(size=2):
    return RequestFactory(0, size, Waker(threading.Event(), threading.Event()))


def _request(factory, name, n, dtype=np.float32, op=Sum, postscale=1.0, compression=None, priority=0.0,
             outputs=True, labels=()):
    a = np.arange(n, dtype=dtype) + 1
    return factory.make(Collective.ALLREDUCE, a, name, op, 0, 1.0, postscale, compression, priority,
                        [a] if outputs else None, None, None, labels)


def _generic(entries, reqs, threshold, priority):
    """What the engine's general path makes of the same agreed tensors: responses -> queue -> plan."""
    scheduler = Scheduler(priority, 0, 0)
    scheduler.push([Response(e.name, e.meta, e.priority, r) for e, r in zip(entries, reqs)])
    return plan(scheduler.take(), threshold)


@pytest.mark.parametrize("seed", range(30))
def test_buckets_from_cache_entries_equal_the_general_path(seed):
    rnd = random.Random(seed)
    factory = _factory()
    reqs, entries = [], []
    for i in range(rnd.randint(1, 40)):
        dtype = rnd.choice([np.float32, np.float64, np.int32])
        op, postscale, priority = rnd.choice([Sum, Average, Max]), rnd.choice([1.0, 0.5]), float(rnd.randint(0, 3))
        if rnd.random() < 0.15:  # a grouped allreduce of one dtype travels whole
            arrays = [np.ones(rnd.randint(1, 500), dtype) for _ in range(rnd.randint(2, 4))]
            r = factory.make(Collective.ALLREDUCE, arrays, f"t{i}", op, 0, 1.0, postscale, None, priority, arrays,
                             None, None)
        else:
            labels = ("a", "b") if rnd.random() < 0.1 else ()
            r = _request(factory, f"t{i}", rnd.randint(1, 3000), dtype=dtype, op=op, postscale=postscale,
                         priority=priority, labels=labels)
        reqs.append(r)
        entries.append(CacheEntry(r.name, r.meta, r.priority, i))
    threshold = rnd.choice([0, 1000, 16 << 10, 64 << 20])
    priority = rnd.random() < 0.7
    runs = plan_cached(entries, reqs, threshold, priority, 2)
    buckets = _generic(entries, reqs, threshold, priority)
    assert all(b.__class__ is Bucket for b in buckets)

    def starts(bucket):  # each request once, with the offset of its first tensor
        seen = {}
        for p in bucket.pieces:
            seen.setdefault(p.response.request.name, p.offset)
        return list(seen.items())

    assert [list(zip((r.name for r in run.requests), run.offsets)) for run in runs] == [starts(b) for b in buckets]
    for run, b in zip(runs, buckets):
        assert run.count == b.count and run.wire == b.wire
        assert (run.op, run.postscale, run.device) == (b.op, b.postscale, b.device)


def test_a_tensor_that_needs_a_cast_or_a_group_of_several_dtypes_takes_the_general_path():
    factory = _factory()
    cast = _request(factory, "fp16", 10, compression="fp16")
    plain = _request(factory, "plain", 10)
    group = factory.make(Collective.ALLREDUCE, [np.ones(3, np.float32), np.ones(4, np.int64)], "g", Sum, 0, 1.0,
                         1.0, None, 0.0, None, None, None)
    for other in (cast, group):
        entries = [CacheEntry(r.name, r.meta, 0.0, i) for i, r in enumerate([plain, other])]
        assert not entries[1].whole
        assert plan_cached(entries, [plain, other], 1 << 20, True, 2) is None


def test_a_gradient_bucket_is_never_fused_with_other_tensors():
    factory = _factory()
    reqs = [_request(factory, "x", 10), _request(factory, "bucket", 100, labels=("w", "b")), _request(factory, "y", 10)]
    entries = [CacheEntry(r.name, r.meta, 0.0, i) for i, r in enumerate(reqs)]
    runs = plan_cached(entries, reqs, 1 << 20, True, 2)
    assert [[r.name for r in run.requests] for run in runs] == [["x", "y"], ["bucket"]]


def test_pack_prescales_and_unpack_averages_and_postscales_each_tensor():
    factory = _factory(size=4)
    a = np.arange(5, dtype=np.float32) + 1
    pre = factory.make(Collective.ALLREDUCE, a, "a", Average, 0, 0.5, 2.0, None, 0.0, [a], None, None)
    plain = _request(factory, "b", 3, op=Average, postscale=2.0)
    scheduler = Scheduler(True, 0, 0)
    scheduler.push([Response(r.name, r.meta, 0.0, r) for r in (pre, plain)])
    (bucket,) = plan(scheduler.take(), 1 << 20)
    assert not bucket.plain  # a prescale: packed tensor by tensor
    buf = FusionBuffers().get(bucket.wire, bucket.count)
    pack(bucket, buf)
    assert buf.tolist() == [0.5, 1, 1.5, 2, 2.5, 1, 2, 3]
    buf *= 4  # as if 4 ranks had the same values
    unpack(bucket, buf, 4)
    assert pre.outputs[0].tolist() == [1, 2, 3, 4, 5]  # prescale 0.5, average, postscale 2
    assert plain.outputs[0].tolist() == [2, 4, 6]


def test_run_counts_its_bytes():
    factory = _factory()
    run = Run(np.dtype(np.float64), int(Sum), 1.0, "cpu", 2)
    run.add(_request(factory, "a", 3, dtype=np.float64), 3)
    run.add(_request(factory, "b", 5, dtype=np.float64), 5)
    assert run.offsets == [0, 3] and run.count == 8 and run.nbytes == 64 and not run.grouped


def test_a_remembered_layout_takes_the_new_requests_and_equals_a_fresh_plan():
    """The steady state: the same cache entries agreed again reuse their layout, with this cycle's requests;
    a different threshold, priority setting or set of entries gets its own layout."""
    rnd = random.Random(7)
    factory = _factory()

    def step(k):
        reqs = []
        for i in range(30):
            dtype = (np.float32, np.float64)[i % 3 == 0]
            if i % 7 == 6:
                arrays = [np.ones(5 + i, dtype) for _ in range(2)]
                reqs.append(factory.make(Collective.ALLREDUCE, arrays, f"t{i}", Sum, 0, 1.0, 1.0, None, float(i % 4),
                                         arrays, None, None))
            else:
                reqs.append(_request(factory, f"t{i}", 10 + 3 * i, dtype=dtype, priority=float(i % 4)))
        return reqs

    first = step(0)
    entries = [CacheEntry(r.name, r.meta, r.priority, i) for i, r in enumerate(first)]
    plans = PlanCache()
    for threshold, priority in [(200, True), (200, True), (1 << 20, True), (200, False), (200, True)]:
        reqs = step(1)
        got = plans.runs(entries, reqs, threshold, priority, 2)
        want = plan_cached(entries, reqs, threshold, priority, 2)
        assert [[r.name for r in run.requests] for run in got] == [[r.name for r in run.requests] for run in want]
        assert all(a is b for run, ref in zip(got, want) for a, b in zip(run.requests, ref.requests))
        assert [(r.offsets, r.count, r.wire, r.op, r.postscale, r.grouped) for r in got] == \
               [(r.offsets, r.count, r.wire, r.op, r.postscale, r.grouped) for r in want]
    assert len(plans._layouts) == 3  # noqa: SLF001 - one layout per (entries, threshold, priority)
    subset = rnd.sample(range(30), 10)
    sub_entries = [entries[i] for i in sorted(subset)]
    reqs = step(2)
    sub_reqs = [reqs[i] for i in sorted(subset)]
    got = plans.runs(sub_entries, sub_reqs, 200, True, 2)
    want = plan_cached(sub_entries, sub_reqs, 200, True, 2)
    assert [[r.name for r in run.requests] for run in got] == [[r.name for r in run.requests] for run in want]


def test_a_remembered_layout_keeps_its_tensors_parts_of_the_buffer_it_last_used():
    factory = _factory()
    entries, reqs = [], []
    for i, n in enumerate([3, 5, 2]):
        reqs.append(_request(factory, f"t{i}", n))
        entries.append(CacheEntry(reqs[-1].name, reqs[-1].meta, 0.0, i))
    plans = PlanCache()
    first = np.arange(10, dtype=np.float32)
    (run,) = plans.runs(entries, reqs, 1 << 20, False, 2)
    parts = run.views(first)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9]]
    (again,) = plans.runs(entries, reqs, 1 << 20, False, 2)
    assert again.views(first) is parts  # the same buffer: kept
    other = np.arange(10, 20, dtype=np.float32)
    assert [p.tolist() for p in again.views(other)] == \
           [[10, 11, 12], [13, 14, 15, 16, 17], [18, 19]]
    plain = Run(np.dtype(np.float32), int(Sum), 1.0, "cpu", 2)  # not from a layout: made each time
    plain.add(reqs[0], 3)
    plain.add(reqs[1], 5)
    assert [p.tolist() for p in plain.views(other[:8])] == [[10, 11, 12], [13, 14, 15, 16, 17]]
