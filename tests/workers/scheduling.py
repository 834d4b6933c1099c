"""A numpy 'training loop' whose results must not depend on scheduling.

Each step reduces tensors of mixed sizes (some larger than the partition size)
with mixed priorities; values are small integers in float32, so every sum is
exact and any scheduling (priority order, partitions, credit, autotuned
settings) must give exactly the reference. Prints the engine's final settings
so the test can check all ranks agree.
"""

import os
import sys

import numpy as np

import aiacc
from aiacc.buckets import GradientBuckets, ParamSpec
from report import say

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 12
for setting in sys.argv[2:]:  # VAR=VALUE@RANK: a variable set on that rank only (as a wrapper script may)
    assignment, _, only = setting.rpartition("@")
    if os.environ.get("PMI_RANK") == only:
        os.environ.__setitem__(*assignment.split("=", 1))
aiacc.init()
r, n = aiacc.rank(), aiacc.size()
sizes = [3, 70_000, 17, 300_000, 5, 1_000, 150_000, 9]
# before the steps, allreduces that never come round again: an unnamed one, and the one-time agreement of a
# set of gradient buckets (as a DistributedOptimizer's first step makes; then stepped with the others): the
# autotuner must not count steps by them (it took the first allreduce agreed, and never tuned)
aiacc.allreduce(np.ones(2, np.float32), op=aiacc.Sum)
# and a named one that never comes round again (the number of batches agreed before training), and, below, a named
# one every 5 steps (a logged loss): the autotuner took the first named one for its step and never tuned, silently
aiacc.allreduce(np.ones(1, np.float32), op=aiacc.Min, name="num_batches")
buckets = GradientBuckets(aiacc.get_engine(), [ParamSpec(f"w{i}", (4,), np.dtype(np.float32)) for i in range(2)])
for step in range(steps):
    for i in range(2):
        buckets.ready(i, np.full(4, r + i + step, np.float32))
    if step % 5 == 0:
        aiacc.allreduce(np.ones(1, np.float32), name="loss")
    buckets.wait()
    assert np.array_equal(buckets.view(1), np.full(4, (n - 1) / 2 + 1 + step, np.float32)), buckets.view(1)
    handles = []
    # submitted in "backward" order (last layer first); priority = closeness to the input
    for i in reversed(range(len(sizes))):
        x = ((np.arange(sizes[i]) % 7) + r + step + i).astype(np.float32)
        handles.append((i, aiacc.allreduce_async(x, op=aiacc.Sum, name=f"layer{i}", priority=len(sizes) - i)))
    for i, h in handles:
        want = ((np.arange(sizes[i]) % 7) * n + n * (step + i) + n * (n - 1) // 2).astype(np.float32)
        got = aiacc.synchronize(h)
        assert np.array_equal(got, want), f"step {step} layer{i}: {got[:4]} != {want[:4]}"
e = aiacc.get_engine()
settings = (e.fusion_threshold, round(e.cycle_time * 1000, 6), e.scheduler.partition_bytes, e.scheduler.credit_bytes)
everyone = aiacc.allgather_object(settings)
assert all(s == settings for s in everyone), f"ranks disagree on settings: {everyone}"
tuned = e.autotuner.done if e.autotuner is not None else None
say(f"OK rank={r} settings={settings} autotune_done={tuned}")
