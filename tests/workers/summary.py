"""aiacc.summary() and AIACC_SUMMARY: what the engine did, counted (2 ranks, numpy API).

Three steps of 10 named allreduces, one grouped allreduce of 3 arrays, one broadcast and one allgather:
33 allreduce requests (a grouped allreduce counts once) of known bytes, fused into fewer collectives;
every operation agreed once, the first step's by full negotiation; 3 broadcasts and 3 allgathers."""

import numpy as np

import aiacc
from report import say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
STEPS, EACH, GROUPED = 3, 1000, 100
for step in range(STEPS):
    handles = [aiacc.allreduce_async(np.full(EACH, r + i, np.float32), op=aiacc.Sum, name=f"t{i}") for i in range(10)]
    for i, h in enumerate(handles):
        assert np.array_equal(aiacc.synchronize(h), np.full(EACH, sum(range(n)) + n * i, np.float32))
    aiacc.grouped_allreduce([np.ones(GROUPED, np.float32)] * 3, op=aiacc.Sum, name="g")
    assert aiacc.broadcast(np.arange(4.0) + r, 0, name="b")[1] == 1.0
    assert aiacc.allgather(np.full(2, r), name="a").shape == (2 * n,)
d = aiacc.summary()
assert d["enabled"] and (d["rank"], d["ranks"]) == (r, n), d
assert d["allreduce_requests"] == STEPS * 11, d
assert d["allreduce_bytes"] == STEPS * 4 * (10 * EACH + 3 * GROUPED), d
assert STEPS <= d["allreduces"] <= STEPS * 11, d  # fused: one collective per step at best
assert d["through_shared_window"] <= d["allreduces"], d
assert d["agreed_from_cache"] + d["negotiated"] == STEPS * 13, d  # every operation agreed once
assert d["negotiated"] >= 13, d  # the first step's names were new
assert (d["broadcast"], d["allgather"], d["alltoall"], d["adasum"]) == (STEPS, STEPS, 0, 0), d
assert d["cycles"] >= STEPS and d["allreduce_seconds"] > 0 and d["cycle_cpu_seconds"] > 0, d
assert d["engine_thread_cpu_seconds"] >= 0, d
say(f"OK rank={r} cached={d['agreed_from_cache']} collectives={d['allreduces']} shared={d['through_shared_window']}")
