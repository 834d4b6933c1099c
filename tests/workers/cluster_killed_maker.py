"""`cluster up` (a cluster that stays) whose maker gets SIGNAL half-way through making it: at the 8th `ip` command
(the bridge and the first host are up), the process sends itself the signal. Usage: cluster_killed_maker.py
TERM|KILL NAME. SIGTERM must unwind through the removal; after SIGKILL the state names the dead maker, so the
next `up` removes what is left."""

import os
import signal
import sys

from aiacc.bench import cluster

sig, name = getattr(signal, f"SIG{sys.argv[1]}"), sys.argv[2]
run, calls = cluster._run, [0]


def run_then_signal(cmd):
    calls[0] += 1
    if calls[0] == 8:
        os.kill(os.getpid(), sig)
    return run(cmd)


cluster._run = run_then_signal
with cluster.EmulatedCluster(hosts=3, name=name, persistent=True):
    pass
print("MADE", flush=True)  # (the signal came too late: never, at the 8th of ~30 commands)
