"""Timelines with credit and process sets (3 ranks, AIACC_TIMELINE=<path> and AIACC_TIMELINE_ALL_RANKS=1):
buffers in flight together, a set's engine started after start_timeline / stop_timeline, and a set's files
named by the rank in the job."""

import json
import os
import sys

import numpy as np

import aiacc
from report import say

aiacc.init()
r, n = aiacc.rank(), aiacc.size()
base = sys.argv[1]
# several large allreduces at once, partitioned, under credit: buffers overlap in time
handles = [aiacc.allreduce_async(np.full(200_000, float(r + i), np.float32), op=aiacc.Sum, name=f"big.{i}")
           for i in range(4)]
for i, h in enumerate(handles):
    assert np.all(aiacc.synchronize(h) == n * i + n * (n - 1) / 2)
aiacc.stop_timeline()
after_stop = aiacc.add_process_set([1, 2])  # added with no timeline written: none for it
if r in (1, 2):
    aiacc.allreduce(np.ones(2), name="quiet", process_set=after_stop)
aiacc.start_timeline(base + ".late")
later = aiacc.add_process_set([0, 2])  # added after start_timeline: writes <late>.set<id>
if r in (0, 2):
    aiacc.allreduce(np.ones(2), name="recorded", process_set=later)
aiacc.barrier()
stopped_id, later_id = after_stop.process_set_id, later.process_set_id  # (shutdown() forgets them)
aiacc.shutdown()
checks = 0
if r == 0:
    def load(path):
        with open(path) as f:
            return json.load(f)

    def tracks(events):
        return {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}

    events = load(f"{base}.rank0")
    names = tracks(events)
    lanes = {}
    for e in events:
        if e.get("ph") == "X":
            lanes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for tid, spans in lanes.items():  # on one track, events nest or are apart (a viewer drops the others)
        spans.sort()
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            assert s1 >= e0 - 0.002 or e1 <= e0 + 0.002, (names[tid], (s0, e0), (s1, e1))  # (microseconds, rounded)
    checks += 1
    assert [name for name in names.values() if name.startswith("buffers")], sorted(names.values())
    # the set added after the stop wrote nothing until start_timeline (then <late>.set<id>, as every engine)
    stopped = os.path.basename(base) + f".set{stopped_id}"
    assert not [p for p in os.listdir(os.path.dirname(base)) if p.startswith(stopped)], os.listdir(os.path.dirname(base))
    for k in (0, 2):  # the later set's files, one per member, named by and labelled with the job rank
        late = load(f"{base}.late.set{later_id}.rank{k}")
        assert {e["pid"] for e in late} == {k}, {e["pid"] for e in late}
        assert any(e["args"]["name"] == f"aiacc rank {k}" for e in late if e["name"] == "process_name")
        assert "allreduce.recorded" in tracks(late).values(), sorted(tracks(late).values())
        checks += 1
say(f"OK rank={r} checks={checks}")
