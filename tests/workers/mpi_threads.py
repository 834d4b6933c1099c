"""``mpi_threads_supported()`` says what MPI provides (Horovod's: MPI_THREAD_MULTIPLE or not). Usage:
mpi_threads.py LEVEL, where LEVEL is mpi4py's thread level the script starts MPI with before aiacc.init()
("multiple", "serialized"), or "aiacc" to let aiacc start MPI (it asks for multiple)."""

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
aiacc.shutdown()
