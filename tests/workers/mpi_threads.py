"""``mpi_threads_supported()`` says what MPI provides (Horovod's: MPI_THREAD_MULTIPLE or not). Usage:
mpi_threads.py LEVEL, where LEVEL is mpi4py's thread level the script starts MPI with before aiacc.init()
("multiple", "serialized"), or "aiacc" to let aiacc start MPI (it asks for multiple). Then a process set:
refused below MPI_THREAD_MULTIPLE."""

import sys

import mpi4py

level = sys.argv[1]
if level != "aiacc":
    mpi4py.rc.thread_level = level
    from mpi4py import MPI  # noqa: F401 - MPI starts here, at the script's level

import aiacc  # noqa: E402
from report import say  # noqa: E402

aiacc.init()
say(f"RANK {aiacc.rank()} THREADS {aiacc.mpi_threads_supported()}")
assert aiacc.allreduce([1.0, 2.0], name="works").tolist() == [1.0, 2.0]
# a process set's engine calls MPI from its own thread: below MPI_THREAD_MULTIPLE refused on every rank, by name
try:
    subset = aiacc.add_process_set([0])
except aiacc.AiaccError as e:
    assert level == "serialized" and "MPI_THREAD_MULTIPLE" in str(e) and "add_process_set" in str(e), e
    say(f"RANK {aiacc.rank()} REFUSED")
else:
    assert level != "serialized"
    if aiacc.rank() == 0:
        assert aiacc.allreduce([3.0], name="in set", process_set=subset).tolist() == [3.0]
    aiacc.remove_process_set(subset)
assert aiacc.allreduce([1.0, 2.0], name="still works").tolist() == [1.0, 2.0]
aiacc.shutdown()
