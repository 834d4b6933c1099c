"""init(process_sets=...) with Horovod's rules, on an MPI that aiacc has to start itself.

Run with 3 ranks. The script tells mpi4py not to start MPI (``mpi4py.rc.initialize = False``, as
Horovod's own tests do): aiacc starts it, and finalizes it at exit (the job exits 0).

Each rank passes its own list: the half of a ``Split`` it is in (ranks 0, 2 or rank 1) as an mpi4py
communicator, and sets of ranks that are the same everywhere. The sets are registered once, those of
communicators first (by position, then sorted), then those of ranks: [0, 1] registered first as ranks
(id 1), then [0, 2] = 2, [1] = 3 (first position), and from a second split ([0] and [1, 2]) 4 and 5
(third position; rank by rank, [0] would come before [1]). A list that repeats a set (here the global set, as a duplicate of the job's communicator,
and [0, 2] once more on the even ranks) raises ValueError on the ranks whose list repeats, with the job
initialized and the others registered; init again with a clean list works, and every set reduces among
its ranks. A communicator that is null on one rank is the same error on every rank, naming that rank.
"""

import mpi4py

mpi4py.rc.initialize = False  # before MPI is imported anywhere
from mpi4py import MPI  # noqa: E402

import numpy as np  # noqa: E402

import aiacc  # noqa: E402
from aiacc.process_sets import HorovodBasics  # noqa: E402
from report import raises, say  # noqa: E402

assert not MPI.Is_initialized()
world = MPI.COMM_WORLD
checks = 0

# a Split needs MPI, which aiacc starts in init: so the first init has sets of ranks only, with a repeat
sets = [aiacc.ProcessSet([0, 1]), aiacc.ProcessSet([2, 1, 0])]  # the second is the global set
raises(ValueError, lambda: aiacc.init(process_sets=sets), "entry 1", "repeats")
assert MPI.Is_initialized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE
r, n = aiacc.rank(), aiacc.size()
assert n == 3 and aiacc.is_initialized()
assert sets[0].process_set_id == 1 and sets[1].process_set_id is None, sets
checks += 1

half = world.Split(color=r % 2, key=r)
even_ranks = [0, 2]
mine = even_ranks if r % 2 == 0 else [1]
world_copy = world.Dup()
apart = world.Split(color=int(r == 0), key=r)  # [0] and [1, 2]
# entry 1 is the global set again (every rank); entry 3 the even ranks' communicator again, as ranks
repeat = [aiacc.ProcessSet(half), aiacc.ProcessSet(world_copy), aiacc.ProcessSet([0, 1]), aiacc.ProcessSet(even_ranks),
          aiacc.ProcessSet(apart)]
raises(ValueError, lambda: aiacc.init(process_sets=repeat), f"on rank {r}", "entry 1", "repeats",
       *(["entry 3"] if r % 2 == 0 else []))
assert repeat[1].process_set_id is None and (repeat[3].process_set_id is None) == (r % 2 == 0), repeat
checks += 1
ids = HorovodBasics._get_process_set_ids_and_ranks()
assert ids == {0: [0, 1, 2], 1: [0, 1], 2: [0, 2], 3: [1], 4: [0], 5: [1, 2]}, ids
checks += 1

clean = [aiacc.ProcessSet(half), aiacc.ProcessSet([0, 1]), aiacc.ProcessSet(apart)]
aiacc.init(process_sets=clean)
assert clean[0].ranks == mine and clean[0].process_set_id == (2 if r % 2 == 0 else 3), clean
assert clean[1].process_set_id == 1 and HorovodBasics._comm_process_set_id(half) == clean[0].process_set_id
assert clean[2].process_set_id == (4 if r == 0 else 5), clean
assert HorovodBasics._get_process_set_ids_and_ranks() == ids  # nothing new
assert aiacc.global_process_set.mpi_comm is None and aiacc.global_process_set.ranks == [0, 1, 2]
checks += 1

for ps, members in ((clean[0], mine), (clean[1], [0, 1]), (clean[2], [0] if r == 0 else [1, 2])):
    if r in members:
        got = aiacc.allreduce(np.full(5, r + 1.0), op=aiacc.Sum, name="x", process_set=ps)
        assert (got == sum(k + 1.0 for k in members)).all(), (ps, got)
        checks += 1

# a communicator this rank is not in (null on rank 1 only): every rank fails, naming rank 1
other = world.Split(color=0 if r != 1 else MPI.UNDEFINED, key=r)
raises(ValueError, lambda: aiacc.init(process_sets=[aiacc.ProcessSet(other)]), "rank 1", "COMM_NULL")
assert HorovodBasics._get_process_set_ids_and_ranks() == ids  # nothing registered by the failed call
checks += 1
got = aiacc.allreduce(np.ones(3), op=aiacc.Sum, name="after")  # the job still works
assert (got == 3).all()
checks += 1

aiacc.shutdown()
for c in (half, world_copy, apart, other):
    if c != MPI.COMM_NULL:
        c.Free()
say(f"OK rank={r} checks={checks}")
