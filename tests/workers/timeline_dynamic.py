"""Horovod's start_timeline / stop_timeline under HOROVOD_TIMELINE=DYNAMIC (no file until started), through
aiacc.torch: what happens between start and stop is in the file, complete JSON once stopped, with the op's
track and Horovod's phases; what happens after stop is in no file; a second start writes a new file (with
CYCLE_START marks asked for); a path that cannot be written is a ValueError naming it (on rank 0, which writes), and the
running timeline goes on."""

import json
import os
import sys

import torch

import aiacc
import aiacc.torch as hvd
from report import raises, say

out = sys.argv[1]
os.chdir(out)  # where a file named after the variable's value would appear
hvd.init()
r = hvd.rank()
checks = 0
assert not os.path.exists("DYNAMIC"), "HOROVOD_TIMELINE=DYNAMIC made a file named DYNAMIC"

first, second = os.path.join(out, "first.json"), os.path.join(out, "second.json")
hvd.allreduce(torch.ones(3), name="before")  # before any timeline: recorded nowhere
hvd.start_timeline(first)
hvd.allreduce(torch.ones(3), name="during")
hvd.stop_timeline()
hvd.allreduce(torch.ones(3), name="after")
hvd.stop_timeline()  # stopping again: nothing to do
hvd.start_timeline(second, mark_cycles=True)
if r == 0:  # (the other ranks write no timeline: nothing to fail there)
    bad = os.path.join(first, "inside-a-file.json")
    raises(ValueError, lambda: hvd.start_timeline(bad), "start_timeline", "inside-a-file.json")
hvd.broadcast(torch.ones(2), root_rank=0, name="second")
hvd.barrier()
# the file being written again: it goes on (as Horovod's writer; a second writer cut it short, the events
# before lost); a tensor queued before a start and done after it starts at the file's start, not before
hvd.start_timeline(second, mark_cycles=True)
queued = hvd.allreduce_async(torch.ones(2), name="queued")
hvd.start_timeline(os.path.join(out, "queued.json"))
hvd.synchronize(queued)
hvd.stop_timeline()
hvd.start_timeline(second, mark_cycles=True)  # (a fresh file: the one above was stopped)
hvd.broadcast(torch.ones(2), root_rank=0, name="second")
if r == 0:
    os.symlink(out, os.path.join(out, "link"))
hvd.barrier()
hvd.start_timeline(os.path.join(out, "link", "second.json"), mark_cycles=True)  # (the same file, by a symlink)
hvd.allreduce(torch.ones(2), name="again")
hvd.barrier()
hvd.stop_timeline()
checks += 1


def tracks_of(path):
    with open(path) as f:
        events = json.load(f)  # complete JSON once stopped
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = {}
    for e in events:
        if e.get("ph") == "X":
            spans.setdefault(names[e["tid"]], set()).add(e["name"])
    return spans, events


if r == 0:
    spans, _ = tracks_of(first)
    assert {"QUEUE", "NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= spans.get("allreduce.during", set()), sorted(spans)
    assert not any(t.endswith((".before", ".after", ".second")) for t in spans), sorted(spans)
    _, events = tracks_of(os.path.join(out, "queued.json"))  # (with allreduce.queued, or without if it was done)
    assert all(e["ts"] >= 0 for e in events if "ts" in e), [e for e in events if e.get("ts", 0) < 0]
    spans, events = tracks_of(second)
    assert "BROADCAST" in spans.get("broadcast.second", set()) and "ALLREDUCE" in spans.get("allreduce.again", set())
    assert "allreduce.during" not in spans, sorted(spans)
    assert any(e.get("name") == "CYCLE_START" for e in events), "mark_cycles=True left no CYCLE_START"
    checks += 2
else:  # rank 0 alone writes the timeline (without AIACC_TIMELINE_ALL_RANKS)
    hvd.start_timeline(os.path.join(out, "third.json"))
    assert aiacc.get_engine().timeline is None and not os.path.exists(os.path.join(out, "third.json.rank1"))
    hvd.stop_timeline()
    checks += 2
hvd.shutdown()
say(f"OK rank={r} checks={checks}")
