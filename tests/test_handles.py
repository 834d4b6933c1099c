"""Handles, one process: a thread that blocks in ``wait()`` is woken by the completion it waits for.

No MPI here: requests come from the real RequestFactory and complete the way the engine completes them
(``finish_allreduces`` for a step's allreduces, ``_set`` for anything else, errors included).
"""

import random
import threading

import numpy as np
import pytest

from aiacc.ops import Collective, Sum
from aiacc.requests import RequestFactory, Waker, finish_allreduces


def _factory():
    return RequestFactory(0, 2, Waker(threading.Event(), threading.Event()))


def _request(factory, name):
    a = np.arange(4, dtype=np.float32)
    return factory.make(Collective.ALLREDUCE, a, name, Sum, 0, 1.0, 1.0, None, 0.0, [a], None, None)


def _waiter(handle, results, key, timeout=None):
    def run():
        try:
            results[key] = handle.wait(timeout)
        except BaseException as exc:  # noqa: BLE001 - the test looks at what came back
            results[key] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_threads_blocked_on_a_steps_handles_all_return_when_the_step_completes():
    factory = _factory()
    rnd = random.Random(3)
    for trial in range(100):  # completions before, among and after the waiters' start: none is lost
        reqs = [_request(factory, f"t{trial}.{i}") for i in range(rnd.randint(1, 8))]
        results, threads = {}, []
        done_at = rnd.randint(0, len(reqs))
        inflight = {r.name: r for r in reqs}
        for i, r in enumerate(reqs):
            if i == done_at:
                finish_allreduces(reqs, inflight)
            threads.append(_waiter(r, results, i))
        if done_at == len(reqs):
            finish_allreduces(reqs, inflight)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), f"trial {trial}: a waiter was never woken"
        assert all(results[i] is r.outputs[0] for i, r in enumerate(reqs))
        assert not inflight


def test_a_blocked_thread_gets_the_operations_error():
    factory = _factory()
    req = _request(factory, "bad")
    results = {}
    thread = _waiter(req, results, 0)
    req._set(None, ValueError("tensor 'bad' failed on rank 1"))
    thread.join(30)
    assert isinstance(results[0], ValueError) and "'bad'" in str(results[0])


def test_wait_with_a_timeout_names_the_tensor_and_a_later_wait_still_returns():
    factory = _factory()
    req = _request(factory, "slow")
    with pytest.raises(TimeoutError, match="'slow' did not finish within 0.05 s"):
        req.wait(0.05)
    results = {}
    thread = _waiter(req, results, 0, timeout=60)
    finish_allreduces([req], {"slow": req})
    thread.join(30)
    assert results[0] is req.outputs[0]


def test_a_completion_callback_may_wait_for_its_own_handle():
    factory = _factory()
    req = _request(factory, "cb")
    seen = []
    req.add_done_callback(lambda h: seen.append(h.wait()))
    results = {}
    thread = _waiter(req, results, 0)
    finish_allreduces([req], {"cb": req})
    thread.join(30)
    assert seen == [req.outputs[0]] and results[0] is req.outputs[0]
