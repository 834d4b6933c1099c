"""Agreement, the response cache and the scheduler, one process.

The negotiation runs for N ranks as N threads, each with its own Negotiator, over a transport made
for this test (``Ranks``): its collectives meet at a barrier and combine what every thread
deposited, which is all the Negotiator asks of MPI. So the agreement logic (the cache bits, the slow
path, mismatches, eviction, join) is exercised exactly, quickly, and without MPI; the real transport
is what the multi-process tests run on.
"""

import threading

import numpy as np
import pytest

from aiacc.negotiation import JOIN_NAME, Negotiator, ResponseCache
from aiacc.ops import Collective, Max, Sum
from aiacc.requests import RequestFactory, Waker
from aiacc.scheduler import Scheduler


class Ranks:
    """N ranks' collectives in one process: each rank's thread deposits, all meet, all combine."""

    def __init__(self, n: int):
        self.n = n
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, timeout=10)

    def transport(self, rank: int):
        world = self

        class Transport:
            def bitwise_and(self, vec):
                return world._exchange(rank, vec.copy(), lambda xs: np.bitwise_and.reduce(np.stack(xs)))

            def allgather_object(self, obj):
                return world._exchange(rank, obj, list)

        return Transport()

    def _exchange(self, rank, value, combine):
        self.slots[rank] = value
        self.barrier.wait()
        result = combine(list(self.slots))
        self.barrier.wait()
        return result


def run_ranks(n: int, body, capacity: int = 8):
    """Run ``body(rank, negotiator, factory)`` on n threads; return each rank's result (or raise)."""
    world = Ranks(n)
    results, errors = [None] * n, []

    def main(rank):
        try:
            negotiator = Negotiator(rank, n, world.transport(rank), cache_capacity=capacity)
            factory = RequestFactory(rank, n, Waker(threading.Event(), threading.Event()))
            results[rank] = body(rank, negotiator, factory)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            world.barrier.abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def allreduce(factory, name, shape=(4,), dtype=np.float32, op=Sum):
    a = np.zeros(shape, dtype)
    return factory.make(Collective.ALLREDUCE, a, name, op, 0, 1.0, 1.0, None, 0.0, [a], None, None)


def agree(negotiator, want: int, cycles: int = 10):
    """Cycle until ``want`` tensors are agreed; (names agreed in order, cycles that took the slow path)."""
    names = []
    for _ in range(cycles):
        cycle = negotiator.cycle(False, False)
        names += [e.name for e in cycle.entries] + [r.name for r in cycle.responses]
        if len(names) >= want:
            break
    return names


@pytest.mark.parametrize("n", [2, 3])
def test_tensors_submitted_in_different_orders_are_agreed_and_cached(n):
    def body(rank, negotiator, factory):
        names = [f"t{i}" for i in range(5)]
        order = names if rank % 2 == 0 else names[::-1]
        for name in order:
            negotiator.add(allreduce(factory, name))
        first = sorted(agree(negotiator, 5))
        slow = negotiator.slow_cycles
        for name in names[::-1] if rank == 0 else names:  # again, orders swapped
            negotiator.add(allreduce(factory, name))
        second = sorted(agree(negotiator, 5))
        return first, second, negotiator.slow_cycles - slow

    for first, second, slow_again in run_ranks(n, body):
        assert first == second == [f"t{i}" for i in range(5)]
        assert slow_again == 0  # the second round was one bit each: no slow path


def test_a_shape_mismatch_is_the_same_error_on_every_rank_naming_the_ranks():
    def body(rank, negotiator, factory):
        negotiator.add(allreduce(factory, "w", shape=(6, 4) if rank == 0 else (7, 4)))
        cycle = negotiator.cycle(False, False)
        return [r.error for r in cycle.responses]

    results = run_ranks(3, body)
    assert results[0] == results[1] == results[2] == [
        "tensor 'w': shape differs across ranks (rank 0: (6, 4); ranks 1,2: (7, 4))"]


def test_a_changed_signature_of_a_cached_name_becomes_a_mismatch_not_a_hang():
    def body(rank, negotiator, factory):
        negotiator.add(allreduce(factory, "x"))
        assert agree(negotiator, 1) == ["x"]
        # rank 1 now sends the cached name with another dtype: it announces it, which evicts it everywhere
        negotiator.add(allreduce(factory, "x", dtype=np.float64 if rank == 1 else np.float32))
        for _ in range(5):
            cycle = negotiator.cycle(False, False)
            if cycle.responses or cycle.entries:
                return [r.error for r in cycle.responses], len(cycle.entries)
        return None

    for errors, cached in run_ranks(2, body):
        assert cached == 0 and errors == ["tensor 'x': dtype differs across ranks (rank 0: float32; rank 1: float64)"]


def test_the_cache_evicts_the_least_recently_used_name_and_agreement_still_completes():
    def body(rank, negotiator, factory):
        seen = []
        for name in ("a", "b", "c", "a", "c"):
            negotiator.add(allreduce(factory, name))
            seen += agree(negotiator, 1)
        return seen, sorted(negotiator.cache.by_name)

    for seen, cached in run_ranks(2, body, capacity=2):  # room for two names
        assert seen == ["a", "b", "c", "a", "c"]
        assert cached == ["a", "c"]  # b was the least recently used when a came back


def test_a_full_cache_evicts_the_oldest_lowest_bit_first_never_one_agreed_this_cycle():
    """The victim is the same on every rank: the least recently agreed name, the lowest bit among equals; none
    while every name was agreed in the current cycle (one numpy argmin, not a Python scan of every entry)."""
    factory = RequestFactory(0, 1, Waker(threading.Event(), threading.Event()))
    meta = allreduce(factory, "m").meta
    cache, evicted = ResponseCache(3), []

    def evict(name):
        evicted.append(name)
        cache.remove(name)

    for name, cycle in (("a", 5), ("b", 3), ("c", 3)):
        cache.put(name, meta, 0.0, cycle, evict)
    cache.put("d", meta, 0.0, 7, evict)  # b and c were agreed last in cycle 3: b holds the lower bit
    cache.put("e", meta, 0.0, 7, evict)
    assert evicted == ["b", "c"] and sorted(cache.by_name) == ["a", "d", "e"]
    cache.last_used[:] = 8
    assert cache.put("f", meta, 0.0, 8, evict) is None and evicted == ["b", "c"]


def test_a_joined_rank_lets_cached_allreduces_through_and_errors_other_collectives():
    def body(rank, negotiator, factory):
        for name in ("g", "bc"):  # both names cached while everyone is present
            if name == "g":
                negotiator.add(allreduce(factory, name, op=Max))
            else:
                a = np.zeros(3)
                negotiator.add(factory.make(Collective.BROADCAST, a, name, Sum, 0, 1.0, 1.0, None, 0.0, None, None,
                                            None))
            agree(negotiator, 1)
        if rank == 1:
            negotiator.add(factory.make(Collective.JOIN, [], JOIN_NAME, Sum, 0, 1.0, 1.0, None, 0.0, None, None, None))
            agree(negotiator, 1)
            out = []
            for _ in range(4):
                cycle = negotiator.cycle(False, False)
                out += negotiator.responses_of(cycle)
            return [(r.name, r.request, r.error) for r in out]
        agree(negotiator, 1)  # rank 1's join
        negotiator.add(allreduce(factory, "g", op=Max))
        a = np.zeros(3)
        negotiator.add(factory.make(Collective.BROADCAST, a, "bc", Sum, 0, 1.0, 1.0, None, 0.0, None, None, None))
        out = []
        for _ in range(4):
            cycle = negotiator.cycle(False, False)
            out += negotiator.responses_of(cycle)
        return [(r.name, r.request is not None, r.error) for r in out]

    rank0, rank1 = run_ranks(2, body)
    error = "tensor 'bc': broadcast cannot run while rank 1 has called join(); only allreduce can"
    assert sorted(rank0) == [("bc", True, error), ("g", True, None)]
    assert sorted(rank1, key=lambda x: x[0]) == [("bc", None, error), ("g", None, None)]


# ---- the scheduler --------------------------------------------------------------------------
def _responses(sizes, priorities, prefix="t"):
    from aiacc.negotiation import Response

    factory = RequestFactory(0, 2, Waker(threading.Event(), threading.Event()))
    out = []
    for i, (n, p) in enumerate(zip(sizes, priorities)):
        req = allreduce(factory, f"{prefix}{i}", shape=(n,))
        out.append(Response(req.name, req.meta, p, req))
    return out


def test_credit_sends_the_most_urgent_first_and_lets_later_urgent_ones_overtake():
    s = Scheduler(priority=True, partition_bytes=0, credit_bytes=1000)
    s.push(_responses([200, 200, 200], [1.0, 3.0, 2.0]))  # 800 bytes each
    # most urgent first; 800 < 1000 so a second one is taken, then the credit is spent
    assert [p.response.name for p in s.take()] == ["t1", "t2"]
    s.push(_responses([10], [9.0], prefix="urgent"))  # agreed later, more urgent than what is left
    assert [p.response.name for p in s.take()] == ["urgent0", "t0"]
    assert len(s) == 0


def test_partitions_split_a_large_tensor_so_an_urgent_one_gets_in_between():
    s = Scheduler(priority=True, partition_bytes=400, credit_bytes=400)
    s.push(_responses([300], [1.0]))  # 1200 bytes: three partitions of 100 floats
    assert [(p.start, p.count) for p in s.take()] == [(0, 100)]
    s.push(_responses([10], [5.0], prefix="urgent"))
    assert [(p.response.name, p.start) for p in s.take()] == [("urgent0", 0), ("t0", 100)]
    assert [(p.start, p.count) for p in s.take()] == [(200, 100)]
    assert len(s) == 0


@pytest.mark.parametrize("bits", [[], [0], [0, 7, 8, 1002], list(range(0, 1003, 15)), list(range(1003))])
def test_agreed_bits_are_read_in_order_with_few_or_many_set_and_padding_ignored(bits):
    """The bits of an AND result, few (read off a Python int) or many (numpy), in ascending order; a
    joined rank's 0xFF also sets the padding bits past the capacity (1003 bits in 126 bytes: 5 of them),
    which are no cache slots."""
    negotiator = Negotiator(0, 1, transport=None, cache_capacity=1003)
    negotiator.cache.high = 1003  # (every bit given out)
    vector = np.zeros(1003, dtype=bool)
    vector[bits] = True
    packed = np.packbits(vector)
    assert packed.size == 126
    assert negotiator._ready_bits(packed) == bits
    packed[-1] |= 0b00011111  # the padding bits, as a joined rank's 0xFF leaves them after the AND
    assert negotiator._ready_bits(packed) == bits


def test_a_cycle_exchanges_the_bits_in_use_not_the_whole_capacity():
    """The bit vector of a cycle covers the bits given out so far (the same on every rank), as Horovod's
    ``num_active_bits``: at the largest capacity a job with a few names exchanged and packed 128 KiB every cycle
    (0.93 ms a cycle). Bits are given lowest first, a freed one again first; eviction and agreement unchanged."""
    sizes = []

    def body(rank, negotiator, factory):
        exchange = negotiator.transport.bitwise_and

        def recorded(vec):
            if rank == 0:
                sizes.append(vec.size)
            return exchange(vec)

        negotiator.transport.bitwise_and = recorded
        seen = []
        for step in range(3):
            for name in ("a", "b", "c")[:step + 1]:
                negotiator.add(allreduce(factory, name))
            seen += agree(negotiator, step + 1)
        bits = {name: e.bit for name, e in negotiator.cache.by_name.items()}
        negotiator.cache.remove("b")  # freed: the next name takes its bit
        negotiator.cache.put("d", allreduce(factory, "d").meta, 0.0, negotiator.cycle_no, negotiator._evict)
        return seen, bits, negotiator.cache.by_name["d"].bit, negotiator.cache.high

    for seen, bits, d_bit, high in run_ranks(2, body, capacity=1 << 20):
        assert seen == ["a", "a", "b", "a", "b", "c"]
        assert bits == {"a": 0, "b": 1, "c": 2} and d_bit == 1 and high == 3
    assert max(sizes) == 2 and min(sizes) == 1, sizes  # the flags byte, then one byte of bits once a name is cached
