"""Collectives from several threads of each rank, with the default caller cycles (a waiting thread runs the
engine's cycles itself), and a completion callback that waits for another collective.

Three threads per rank each run 150 synchronous named allreduces of their own names, pausing at different
steps on different ranks. A waiting thread used to queue for the cycle lock behind another waiting thread,
which held it until its own handle was done: that could need this thread's next collective on the other
rank, whose threads were stuck the same way (the job hung in 6 runs of 8). A callback (add_done_callback)
runs on the engine's thread: waiting there for another collective hung the engine; now an error says so.
"""

import threading
import time

import numpy as np

import aiacc
from report import say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
STEPS = 150
done = []


def work(t):
    for i in range(STEPS):
        if (i + t + r) % 3 == 0:
            time.sleep(0.002)
        out = aiacc.allreduce(np.full(4, float(r + t)), name=f"t{t}.i{i}", op=aiacc.Sum)
        assert out.tolist() == [float(sum(range(n)) + n * t)] * 4, (t, i, out)
    done.append(t)


threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
for th in threads:
    th.start()
for th in threads:
    th.join()
assert sorted(done) == [0, 1, 2], done

seen = {}


def callback(handle):
    try:
        aiacc.allreduce(handle.wait(), name="in.callback", op=aiacc.Sum)
    except RuntimeError as exc:
        seen["error"] = str(exc)


first = aiacc.allreduce_async(np.ones(3), name="first", op=aiacc.Sum)
first.add_done_callback(callback)
assert aiacc.synchronize(first).tolist() == [float(n)] * 3
assert "waiting for tensor 'in.callback' in a completion callback" in seen.get("error", ""), seen
aiacc.synchronize(aiacc.allreduce_async(np.ones(1), name="after", op=aiacc.Sum))  # the engine goes on
say(f"OK rank={r} threads={len(done)} steps={STEPS}")
