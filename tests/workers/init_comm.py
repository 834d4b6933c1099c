"""``init(comm=[ranks])``, Horovod's list form of ``comm``: 3 processes, aiacc on ranks [2, 0] of COMM_WORLD
(in that order: world rank 2 is aiacc's rank 0). The process left out gets a ValueError naming it (it was
"'list' object has no attribute 'Dup'"); a list that is not ranks of the job is refused before any MPI call.
"""

import numpy as np
from mpi4py import MPI

import aiacc
from report import raises, say

world = MPI.COMM_WORLD.Get_rank()
raises(ValueError, lambda: aiacc.init(comm=[0, 0]), "init(comm=[0, 0]): expected distinct ranks")
raises(ValueError, lambda: aiacc.init(comm=[0, 7]), "(not: [7])")
raises(TypeError, lambda: aiacc.init(comm=5), "init(comm=...) takes an mpi4py communicator or a list of ranks of "
       "MPI.COMM_WORLD, got int 5")  # (AttributeError: 'int' object has no attribute 'Dup')
if world == 1:
    raises(ValueError, lambda: aiacc.init(comm=[2, 0]), "this process (rank 1 of MPI.COMM_WORLD) is not among")
    say(f"LEFT-OUT world={world}")
else:
    aiacc.init(comm=[2, 0])
    r = aiacc.rank()
    assert aiacc.size() == 2 and r == {2: 0, 0: 1}[world], (aiacc.size(), r)
    total = aiacc.allreduce(np.full(3, float(world)), op=aiacc.Sum, name="x")
    assert total.tolist() == [2.0, 2.0, 2.0], total
    say(f"OK rank={r} world={world}")
