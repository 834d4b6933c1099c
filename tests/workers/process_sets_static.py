"""HOROVOD_DYNAMIC_PROCESS_SETS / AIACC_DYNAMIC_PROCESS_SETS: the sets of init(process_sets=[...]) only when
off (Horovod's static sets), any time when on (aiacc's default), and init(process_sets="dynamic") overrides off.

argv[1]: "off" (the variable is 0: adding and removing raise ValueError naming it, on every rank, with no hang;
the sets given to init work), "on" (adding and removing work), "init-dynamic" (off, but init(process_sets=
"dynamic") turns it on, as Horovod's init sets HOROVOD_DYNAMIC_PROCESS_SETS=1).
"""

import os
import sys

import numpy as np

import aiacc
from report import raises, say

mode = sys.argv[1]
var = next(v for v in ("AIACC_DYNAMIC_PROCESS_SETS", "HOROVOD_DYNAMIC_PROCESS_SETS") if v in os.environ)
checks = 0
if mode == "init-dynamic":
    aiacc.init(process_sets="dynamic")
    first = None
else:
    first = aiacc.ProcessSet([0])
    aiacc.init(process_sets=[first])
r, n = aiacc.rank(), aiacc.size()
if first is not None:  # the set given to init() is registered and runs, in every mode
    assert first.process_set_id == 1, first
    if r == 0:
        assert aiacc.allreduce(np.ones(2), op=aiacc.Sum, name="first", process_set=first).tolist() == [1.0, 1.0]
    checks += 1
if mode == "off":
    message = (f"{var} is off: adding process sets after init() is not allowed (static process sets, Horovod's "
               f"default); set {var}=1 or call init(process_sets=\"dynamic\") to allow adding and removing them")
    raises(ValueError, lambda: aiacc.add_process_set([1]), message)
    raises(ValueError, lambda: aiacc.remove_process_set(first), message.replace("adding process", "removing process"))
    assert first.process_set_id == 1 and aiacc.allreduce(np.ones(1), op=aiacc.Sum, name="after").tolist() == [n]
    checks += 2
else:
    second = aiacc.add_process_set([1])
    if r == 1:
        assert aiacc.allreduce(np.ones(2), op=aiacc.Sum, name="second", process_set=second).tolist() == [1.0, 1.0]
    assert aiacc.remove_process_set(second) and second.process_set_id is None
    checks += 1
say(f"OK rank={r} checks={checks}")
