"""The timeline under Horovod's variables (HOROVOD_TIMELINE, HOROVOD_TIMELINE_MARK_CYCLES), read while
the job runs: after one allreduce, rank 0's file already holds that tensor's phases under Horovod's
names and cycle marks (it is flushed after each cycle), before shutdown closes it. Tracks are named as
Horovod's PyTorch core names its ops (``allreduce.live``, ``broadcast.live``: one name, two collectives)."""

import json
import os
import time

import numpy as np

import aiacc
from report import say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
got = aiacc.allreduce(np.arange(3, dtype=np.float32), op=aiacc.Sum, name="live")
assert (got == np.arange(3) * n).all()
root = aiacc.broadcast(np.full(2, r, dtype=np.int64), root_rank=0, name="live")
assert (root == 0).all()
checks = 1
path = os.environ["HOROVOD_TIMELINE"]
if r == 0:
    events, deadline = [], time.monotonic() + 30
    while time.monotonic() < deadline:  # (the engine thread may still be finishing the cycle)
        with open(path) as f:
            events = [json.loads(line.rstrip().rstrip(",")) for line in f if line.startswith("{")]
        tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        live = {e["name"] for e in events if e.get("ph") == "X" and tracks.get(e["tid"]) == "allreduce.live"}
        sent = {e["name"] for e in events if e.get("ph") == "X" and tracks.get(e["tid"]) == "broadcast.live"}
        marks = [e for e in events if e.get("ph") == "i" and e["name"] == "CYCLE_START"]
        if "ALLREDUCE" in live and "BROADCAST" in sent and marks:
            break
        time.sleep(0.01)
    assert live == {"QUEUE", "NEGOTIATE_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE",
                    "MEMCPY_OUT_FUSION_BUFFER"}, (live, sorted(tracks.values()))
    assert {"NEGOTIATE_BROADCAST", "BROADCAST"} <= sent, (sent, sorted(tracks.values()))
    assert marks and all(tracks[e["tid"]] == "cycles" for e in marks), marks
    checks += 3
aiacc.barrier()
aiacc.shutdown()
if r == 0:
    with open(path) as f:
        closed = json.load(f)  # a closed JSON array after shutdown
    assert any(e.get("name") == "CYCLE_START" for e in closed)
    checks += 1
say(f"OK rank={r} checks={checks}")
